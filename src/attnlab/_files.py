"""Files on disk, whatever their format: atomic writes, bounded reads of regular files, and
bounded, checksummed JSON.

Hostile input: reads open regular files only (`open_regular`, `read_regular_file`) and read at
most their ``fstat`` size; JSON nesting is bounded (`loads`: a RecursionError or a measured
depth, never recursion of ours) and repeated names can be refused (`unique_keys`).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import re
import secrets
import shutil
import stat
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

MAX_JSON_DEPTH = 64  # nesting accepted by `load_json` and `read_config_json`
MAX_CONFIG_BYTES = 16_000_000  # a model's config.json (real ones: a few kB, large label maps ~1 MB)
STALE_SECONDS = 300  # an unlocked temp file of ours this old is a leftover even if its pid lives
_TEMP_MARK = "attnlab"  # temp files are ".<name>.attnlab.<pid>.<8 random chars>.tmp"


class CheckpointError(ValueError):
    """A checkpoint file that cannot be trusted or does not fit: ``CheckpointError(path, cause)``.

    Attributes:
        path: the file.
        cause: what is wrong, in words.
    """

    def __init__(self, path: str | os.PathLike, cause: str) -> None:
        super().__init__(f"{os.fspath(path)}: {cause}")
        self.path = os.fspath(path)
        self.cause = cause


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: alive, another user's
        return True
    return True


def _try_lock(fd: int) -> bool | None:
    """Takes an exclusive non-blocking flock: True taken, False held elsewhere, None unsupported."""
    try:
        import fcntl
    except ImportError:  # not POSIX
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    except OSError:  # a filesystem without locks
        return None
    return True


def _temp_pattern(name: str | None) -> re.Pattern:
    target = re.escape(name) if name is not None else r".+"
    return re.compile(rf"\.({target})\.{_TEMP_MARK}\.(\d+)\.[0-9a-f]{{8}}\.tmp")


def _newest_mtime(fd: int, st: os.stat_result) -> float:
    """The newest mtime of a temp directory and its entries (a writer touches one of them)."""
    newest = st.st_mtime
    with contextlib.suppress(OSError), os.scandir(fd) as entries:
        for e in entries:
            with contextlib.suppress(OSError):
                newest = max(newest, e.stat(follow_symlinks=False).st_mtime)
    return newest


def remove_stale_temps(directory: Path, name: str) -> list[str]:
    """Removes temp entries of `atomic_write`'s naming in ``directory`` whose writer is gone.

    Ours are ``.<target>.attnlab.<pid>.<8 hex>.tmp`` directories (any target). A writer holds
    an exclusive flock on its temp directory until it is done, so an entry whose lock is held
    belongs to a live writer (on any host sharing the lock) and is never touched. An entry
    whose lock is free is stale when its pid is dead or nothing in it changed for
    `STALE_SECONDS` (the pid may have been reused). Files of the naming older attnlab versions
    used (``.<name>.<8 chars>.tmp``, no pid, no lock) are removed once `STALE_SECONDS` old.
    Symlinks are never followed. Returns the names removed.
    """
    ours = _temp_pattern(None)
    legacy = re.compile(rf"\.{re.escape(name)}\.[a-z0-9_]{{8}}\.tmp")
    removed: list[str] = []
    try:
        entries = [e.name for e in os.scandir(directory) if e.name.endswith(".tmp")]
    except OSError:
        return removed
    now = time.time()
    for entry in entries:
        m = ours.fullmatch(entry)
        pid = int(m.group(2)) if m else None
        if m is None and legacy.fullmatch(entry) is None:
            continue
        item = os.path.join(directory, entry)
        try:
            fd = os.open(item, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0))
        except OSError:  # gone, a symlink, unreadable
            continue
        try:
            st = os.fstat(fd)
            is_dir = stat.S_ISDIR(st.st_mode)
            if not (is_dir if m else stat.S_ISREG(st.st_mode)):
                continue
            if _try_lock(fd) is False:  # a live writer holds it
                continue
            old = now - (_newest_mtime(fd, st) if is_dir else st.st_mtime) > STALE_SECONDS
            if not (old or (pid is not None and not _pid_alive(pid))):
                continue
            with contextlib.suppress(OSError):
                if os.stat(item, follow_symlinks=False).st_ino != st.st_ino:
                    continue  # replaced since it was opened
                if is_dir:
                    shutil.rmtree(item)  # never follows symlinks
                else:
                    os.unlink(item)
                removed.append(entry)
        finally:
            os.close(fd)
    return removed


def atomic_write(path: Path, fill: Callable[[str], object]) -> None:
    """``fill(temp)`` writes a temp file beside ``path``; it is fsynced and renamed over ``path``.

    The temp file lives in a private directory ``.<name>.attnlab.<pid>.<8 hex>.tmp`` beside
    ``path``, so whatever ``fill`` creates next to it (e.g. a library's own temp file,
    renamed when done) stays inside. The writer holds an exclusive flock on that directory
    until it is removed, so concurrent writers never remove each other's. A writer killed at
    any point leaves ``path`` as it was; the next write into the directory removes its temp
    directory (`remove_stale_temps`). The output's mode is 0o666 minus the umask, like any
    newly created file.
    """
    directory = path.parent if str(path.parent) else Path(".")
    remove_stale_temps(directory, path.name)
    for _ in range(100):
        tmpdir = os.path.join(
            directory, f".{path.name}.{_TEMP_MARK}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
        )
        try:
            os.mkdir(tmpdir, 0o700)
            break
        except FileExistsError:
            continue
    else:
        raise FileExistsError(errno.EEXIST, "no free temp directory name", str(directory))
    dfd = os.open(tmpdir, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        _try_lock(dfd)
        tmp = os.path.join(tmpdir, path.name)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        mode = stat.S_IMODE(os.fstat(fd).st_mode)  # 0o666 minus the umask
        os.close(fd)
        fill(tmp)
        if stat.S_IMODE(os.stat(tmp).st_mode) != mode:  # fill may have replaced it (0o600)
            os.chmod(tmp, mode)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(OSError):
            shutil.rmtree(tmpdir)
        os.close(dfd)  # releases the lock
    with contextlib.suppress(OSError):  # make the rename durable (POSIX directories only)
        dfd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)


_KINDS = {
    stat.S_IFDIR: "a directory",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
    stat.S_IFIFO: "a FIFO (named pipe)",
    stat.S_IFSOCK: "a socket",
}


def _kind(mode: int) -> str:
    return _KINDS.get(stat.S_IFMT(mode), "not a regular file")


def open_regular(path: Path) -> tuple[Any, int]:
    """``(file, size)``: ``path`` opened for reading (unbuffered) if it is a regular file, else
    `CheckpointError`; checked as `read_regular_file` says. The caller closes the file."""
    try:
        st = os.stat(path)
        if not stat.S_ISREG(st.st_mode):
            raise CheckpointError(path, f"refusing {_kind(st.st_mode)}: expected a regular file")
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise FileNotFoundError(errno.ENOENT, f"checkpoint not found: {path}", str(path)) from None
    f = open(fd, "rb", buffering=0, closefd=True)  # noqa: SIM115 (the caller closes it)
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        f.close()
        raise CheckpointError(path, f"refusing {_kind(st.st_mode)}: expected a regular file")
    return f, st.st_size


def read_at_most(f: Any, size: int) -> bytes:
    """Up to ``size`` bytes of ``f`` (fewer if the file ends first), without an extra copy."""
    chunks: list[bytes] = []
    got = 0
    while got < size:  # a file that shrank while being read is returned short (truncated)
        chunk = f.read(size - got)  # one read for a regular file (up to ~2 GB on Linux)
        if not chunk:
            break
        chunks.append(chunk)
        got += len(chunk)
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def read_regular_file(path: Path, limit: int | None = None) -> bytes:
    """The bytes of the regular file ``path``; anything else raises `CheckpointError`.

    Devices (``/dev/zero`` never ends), FIFOs (a read blocks until a writer comes) and
    directories are refused before any read: the path is checked with ``os.stat``, opened with
    ``O_NONBLOCK`` (opening a FIFO never waits) and checked again with ``fstat`` on the open
    descriptor (the path may have been swapped in between). At most the ``fstat`` size is read;
    a file larger than ``limit`` bytes (if given) is refused unread.
    """
    f, size = open_regular(path)
    with f:
        if limit is not None and size > limit:
            raise CheckpointError(
                path, f"file holds {size} bytes, more than the {limit}-byte limit"
            )
        return read_at_most(f, size)


def unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object's dict, for ``json.loads(..., object_pairs_hook=unique_keys)``: repeated
    names (which ``json`` and many readers resolve silently to the last) raise ValueError."""
    obj = dict(pairs)
    if len(obj) != len(pairs):  # linear: one set, one pass
        seen: set[str] = set()
        dups = sorted({k for k, _ in pairs if k in seen or seen.add(k)})
        more = f" and {len(dups) - 5} more" if len(dups) > 5 else ""
        raise ValueError(f"duplicate keys {dups[:5]}{more}")
    return obj


def _depth(value: Any) -> int:
    """How deep lists and dicts nest in a parsed JSON value (0 for a scalar), without recursion."""
    deepest, stack = 0, [(value, 0)]
    while stack:
        item, level = stack.pop()
        if isinstance(item, (dict, list)):
            deepest = max(deepest, level + 1)
            stack.extend((x, level + 1) for x in (item.values() if type(item) is dict else item))
    return deepest


def loads(path: str | os.PathLike, text: str | bytes, what: str, depth: int, **kwargs: Any) -> Any:
    """``json.loads(text)``; anything malformed or nested deeper than ``depth`` raises
    `CheckpointError` naming ``what`` (never a bare ValueError or RecursionError)."""
    try:
        value = json.loads(text, **kwargs)
    except RecursionError:
        raise CheckpointError(path, f"{what} nests deeper than {depth} levels") from None
    except ValueError as e:
        raise CheckpointError(path, f"{what} is not valid JSON ({e})") from None
    if _depth(value) > depth:
        raise CheckpointError(path, f"{what} nests deeper than {depth} levels")
    return value


def one_line(error: BaseException, limit: int = 300) -> str:
    """The first line of an exception's message, at most ``limit`` characters (torch appends
    C++ stack traces to some messages)."""
    lines = str(error).strip().splitlines() or [type(error).__name__]
    text = " ".join(lines[0].split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


def read_config_json(path: str | os.PathLike, *, limit: int | None = MAX_CONFIG_BYTES) -> Any:
    """A JSON file such as a model's ``config.json``, read bounded; errors name the path.

    Only a regular file of at most ``limit`` bytes (None: any size) is read
    (`read_regular_file`); the text must be UTF-8 JSON nested at most `MAX_JSON_DEPTH` levels
    (`loads`: deep nesting is a `CheckpointError`, never a RecursionError).

    Raises:
        FileNotFoundError: no such file.
        CheckpointError: not a regular file, too large, not UTF-8, not JSON, too deeply nested.
    """
    path = Path(os.fspath(path))
    raw = read_regular_file(path, limit)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise CheckpointError(path, f"not valid UTF-8 JSON ({e})") from None
    return loads(path, text, "the file", MAX_JSON_DEPTH)


def save_json(path: str | os.PathLike, data: Any) -> None:
    """Writes ``{"sha256": …, "data": data}`` atomically; `load_json` verifies the digest."""
    body = json.dumps(data, sort_keys=True, indent=2)
    digest = hashlib.sha256(body.encode("utf-8")).hexdigest()
    text = json.dumps({"sha256": digest, "data": data}, sort_keys=True, indent=2) + "\n"
    atomic_write(Path(os.fspath(path)), lambda tmp: Path(tmp).write_bytes(text.encode("utf-8")))


def load_json(path: str | os.PathLike) -> Any:
    """Reads a file written by `save_json`; raises `CheckpointError` if it was altered."""
    doc = read_config_json(path, limit=None)
    if not isinstance(doc, dict) or set(doc) != {"sha256", "data"}:
        raise CheckpointError(path, "expected a JSON object with exactly 'sha256' and 'data'")
    body = json.dumps(doc["data"], sort_keys=True, indent=2)
    if hashlib.sha256(body.encode("utf-8")).hexdigest() != doc["sha256"]:
        raise CheckpointError(path, "sha256 mismatch: the JSON was altered or corrupted")
    return doc["data"]
