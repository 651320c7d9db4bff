"""Files on disk for `attnlab.checkpoint`: atomic writes, bounded reads of regular files that
refuse pickle, safetensors headers and files (checked and decoded by the safetensors library,
plus what it lets through: duplicate names, unknown fields, too many tensors), the header's own
sha256, and bounded, checksummed JSON.

Hostile input: reads open regular files only (`read_regular_file`) and read at most their
``fstat`` size; JSON nesting is bounded (`loads`: a RecursionError or a measured depth, never
recursion of ours); the header's size (safetensors: 100 MB) and tensor count are bounded.
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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from .utils.extras import require

MAX_HEADER_BYTES = 100_000_000  # safetensors' own limit (100 MB)
MAX_TENSORS = 262_144  # per file; far above real single files (a 70B model holds ~700 tensors)
MAX_JSON_DEPTH = 64  # nesting accepted by `load_json` and `read_config_json`
MAX_CONFIG_BYTES = 16_000_000  # a model's config.json (real ones: a few kB, large label maps ~1 MB)
STALE_SECONDS = 300  # an unlocked temp file of ours this old is a leftover even if its pid lives
_TEMP_MARK = "attnlab"  # temp files are ".<name>.attnlab.<pid>.<8 random chars>.tmp"
PICKLE_SUFFIXES = (".pt", ".pth", ".bin", ".pkl", ".pickle", ".ckpt")
# The dtypes attnlab stores and reads: those every safetensors >= 0.4 reader understands.
DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "U16": torch.uint16,
    "U32": torch.uint32,
    "U64": torch.uint64,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
HEADER_KEY = "attnlab.header_sha256"
_HEADER_DIGEST_RE = re.compile(rb'"attnlab\.header_sha256"\s*:\s*"([0-9a-f]{64})"')


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
    ``path``, so whatever ``fill`` creates next to it (safetensors writes its own ``.tmp*``
    file and renames it) stays inside. The writer holds an exclusive flock on that directory
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


def _open_regular(path: Path):
    """``(file, size)``: ``path`` opened for reading if it is a regular file (see below)."""
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


def _read_at_most(f: Any, size: int) -> bytes:
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
    f, size = _open_regular(path)
    with f:
        if limit is not None and size > limit:
            raise CheckpointError(
                path, f"file holds {size} bytes, more than the {limit}-byte limit"
            )
        return _read_at_most(f, size)


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object's dict; repeated names (safetensors keeps the last one) raise ValueError."""
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


def loads(path: str | os.PathLike, text: str, what: str, depth: int, **kwargs: Any) -> Any:
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


_FIELDS = {"dtype", "shape", "data_offsets"}


def _refuse_pickle(path: Path, head: bytes = b"") -> None:
    """Refuses pickle suffixes and, given the first bytes, zip or pickle content.

    A safetensors prefix is a little-endian length, so a valid file can start with the same two
    bytes as a pickle (a 896-byte header starts ``80 03``): only content whose header does not
    open with ``{`` is judged by its magic bytes. Nothing is ever unpickled.
    """
    if path.suffix.lower() in PICKLE_SUFFIXES:
        raise CheckpointError(
            path,
            f"refusing {path.suffix!r}: pickle-based checkpoints can run arbitrary code when "
            "loaded; convert it to safetensors in a trusted environment",
        )
    if head[8:9] == b"{":
        return
    if head[:4] == b"PK\x03\x04":
        raise CheckpointError(path, "refusing a zip archive (torch.save format, pickle inside)")
    if len(head) >= 2 and head[0] == 0x80 and 2 <= head[1] <= 5:
        raise CheckpointError(path, f"refusing a pickle stream (protocol {head[1]})")


def parse_header(
    path: Path, head: bytes, count: int
) -> tuple[dict[str, str], dict[str, tuple[torch.dtype, tuple[int, ...]]]]:
    """``(metadata, {name: (dtype, shape)})`` of a header that safetensors has accepted (its
    ``count`` distinct tensors), refusing what safetensors lets through: more than
    `MAX_TENSORS` tensors, duplicate names (it keeps the last), unknown fields (it ignores
    them) and dtypes attnlab does not read (`DTYPES`)."""
    if count > MAX_TENSORS:
        raise CheckpointError(
            path, f"header lists {count} tensors, more than the {MAX_TENSORS}-tensor limit"
        )
    try:
        header = json.loads(head[8:], object_pairs_hook=_no_duplicates)
    except (ValueError, RecursionError) as e:
        raise CheckpointError(path, f"header is not valid JSON ({e})") from None
    if type(header) is not dict:  # (safetensors accepted these bytes: only if they changed)
        raise CheckpointError(path, f"header must be a JSON object, got {type(header).__name__}")
    meta = header.pop("__metadata__", None) or {}
    infos: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}
    for name, info in header.items():
        if type(info) is not dict or info.keys() != _FIELDS:
            raise CheckpointError(
                path, f"tensor {name!r}: expected exactly dtype, shape, data_offsets, got {info!r}"
            )
        if info["dtype"] not in DTYPES:
            raise CheckpointError(
                path, f"tensor {name!r}: unknown dtype {info['dtype']!r} (known: {sorted(DTYPES)})"
            )
        infos[name] = (DTYPES[info["dtype"]], tuple(info["shape"]))
    return meta, infos


@dataclass(frozen=True)
class Header:
    """A safetensors file's checked header, read without its tensor data (`read_header`).

    Attributes:
        path: the file.
        metadata: the ``__metadata__`` strings.
        tensors: ``{name: (dtype, shape)}`` of every stored tensor, in header order.
        raw: the 8-byte prefix and the header's bytes (to check a later full read against).
    """

    path: Path
    metadata: dict[str, str]
    tensors: dict[str, tuple[torch.dtype, tuple[int, ...]]]
    raw: bytes


def read_header(path: str | os.PathLike) -> Header:
    """The header of a safetensors file, checked by safetensors and `parse_header`, reading
    only its first 8 + N bytes, so a loader can check what the file holds before it allocates
    anything. Pickle suffixes and content, devices, FIFOs and directories are refused unread;
    safetensors opens the descriptor already checked (``/proc/self/fd``) where it can.
    """
    path = Path(os.fspath(path))
    _refuse_pickle(path)
    safe_open = require("safetensors", "models", "reading a checkpoint").safe_open
    f, size = _open_regular(path)
    with f:
        head = _read_at_most(f, min(size, 8))
        n = int.from_bytes(head, "little") if len(head) == 8 else 0
        head += _read_at_most(f, n) if n <= min(MAX_HEADER_BYTES, size - 8) else b""
        _refuse_pickle(path, head)
        same = f"/proc/self/fd/{f.fileno()}"
        try:
            with safe_open(same if os.path.exists(same) else str(path), "pt") as st:
                count = len(st.keys())
        except Exception as e:  # SafetensorError
            raise CheckpointError(path, f"not a valid safetensors file ({one_line(e)})") from None
    meta, infos = parse_header(path, head, count)
    return Header(path, meta, infos, head)


def read_safetensors(
    path: str | os.PathLike, *, header: Header | None = None
) -> tuple[dict[str, Tensor], dict[str, str]]:
    """Reads any safetensors file (e.g. a downloaded model) with full structural validation.

    Checks what `load_checkpoint` checks about the structure (`read_header`, then safetensors
    again on the whole file) but not checksums, which foreign files lack.

    Args:
        path: the file.
        header: the file's `read_header`, already checked by the caller (default: read now).
            The file must still have exactly this header (else `CheckpointError`, "changed
            since its header was read"), so what was checked is what gets decoded.

    Returns:
        ``(tensors, metadata)``.
    """
    path = Path(os.fspath(path))
    header = header or read_header(path)
    raw = read_regular_file(path)
    if raw[: len(header.raw)] != header.raw:
        raise CheckpointError(path, "the file changed since its header was read")
    require("safetensors.torch", "models", "reading a checkpoint")  # one line naming the extra
    from safetensors.torch import load

    try:
        return load(raw), header.metadata
    except KeyError as e:  # a dtype safetensors knows but cannot map to torch
        raise CheckpointError(path, f"unknown dtype {e} (known: {sorted(DTYPES)})") from None
    except Exception as e:  # SafetensorError: the file changed (its data region)
        raise CheckpointError(path, f"not a valid safetensors file ({one_line(e)})") from None


def one_line(error: BaseException, limit: int = 300) -> str:
    """The first line of an exception's message, at most ``limit`` characters (torch appends
    C++ stack traces to some messages)."""
    lines = str(error).strip().splitlines() or [type(error).__name__]
    text = " ".join(lines[0].split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


def seal_header_sha256(head: bytes) -> bytes:
    """``head`` (prefix + header) with its `HEADER_KEY` value, 64 zeros, set to its sha256."""
    digest = hashlib.sha256(head).hexdigest().encode()
    return _HEADER_DIGEST_RE.sub(lambda m: m.group(0).replace(b"0" * 64, digest), head)


def check_header_sha256(path: Path, head: bytes, meta: dict[str, str]) -> None:
    """Checks a header sealed by `seal_header_sha256` (``meta``: its parsed ``__metadata__``)."""
    found = _HEADER_DIGEST_RE.findall(head[8:])
    if len(found) != 1 or meta.get(HEADER_KEY) != found[0].decode():
        raise CheckpointError(path, "header checksum missing or malformed (corrupted header)")
    blank = _HEADER_DIGEST_RE.sub(lambda m: m.group(0).replace(found[0], b"0" * 64), head)
    if hashlib.sha256(blank).hexdigest() != found[0].decode():
        raise CheckpointError(path, "header sha256 mismatch: the header is corrupted")


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
