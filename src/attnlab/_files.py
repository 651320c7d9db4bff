"""Files on disk for `attnlab.checkpoint`: atomic writes, reads that refuse pickle, the
safetensors header check, decoding through the safetensors library (`read_safetensors` for any
safetensors file), the header's own sha256, and checksummed JSON.

`parse_header` checks a safetensors file's structure before the safetensors library decodes it.
The library rejects the same files, but its messages name the fault less precisely ("invalid
offset for tensor `b`", "incomplete metadata, file not fully covered") and it accepts duplicate
tensor names (the last one wins) and unknown fields; `parse_header` says which tensor, which
bytes overlap, and how many bytes are missing or trailing. Nothing here imports pickle.

Hostile input: reads open regular files only (`read_regular_file`) and read at most their
``fstat`` size; every header check is linear in the header's length; JSON nesting is bounded
before parsing (`json_outline`, no recursion); the header's size and tensor count are bounded.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import math
import os
import re
import secrets
import shutil
import stat
import struct
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
MAX_JSON_DEPTH = 64  # nesting accepted by `load_json`; a safetensors header nests 3 deep at most
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
ITEMSIZE = {name: dtype.itemsize for name, dtype in DTYPES.items()}
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


def read_file(path: Path, *, safetensors: bool = True) -> bytes:
    """The bytes of ``path``; for ``safetensors``, refuses pickle suffixes and zip/pickle content.

    A safetensors prefix is a little-endian length, so a valid file can start with the same two
    bytes as a pickle (a 896-byte header starts ``80 03``): only content whose prefix cannot be
    safetensors is judged by its magic bytes. Nothing is ever unpickled.
    """
    if safetensors and path.suffix.lower() in PICKLE_SUFFIXES:
        raise CheckpointError(
            path,
            f"refusing {path.suffix!r}: pickle-based checkpoints can run arbitrary code when "
            "loaded; convert it to safetensors in a trusted environment",
        )
    raw = read_regular_file(path)
    if not safetensors or (
        len(raw) >= 9 and 8 + header_length(raw) <= len(raw) and raw[8:9] == b"{"
    ):
        return raw
    if raw[:4] == b"PK\x03\x04":
        raise CheckpointError(path, "refusing a zip archive (torch.save format, pickle inside)")
    if len(raw) >= 2 and raw[0] == 0x80 and 2 <= raw[1] <= 5:
        raise CheckpointError(path, f"refusing a pickle stream (protocol {raw[1]})")
    return raw


def _kind(mode: int) -> str:
    for test, kind in (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISFIFO, "a FIFO (named pipe)"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return kind
    return "not a regular file"


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


def header_length(raw: bytes) -> int:
    """N, the header length in a safetensors file's 8-byte prefix."""
    return struct.unpack("<Q", raw[:8])[0]


def _json_object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj = dict(pairs)
    if len(obj) != len(pairs):  # linear: one set, one pass
        seen: set[str] = set()
        dups = sorted({k for k, _ in pairs if k in seen or seen.add(k)})
        more = f" and {len(dups) - 5} more" if len(dups) > 5 else ""
        raise ValueError(f"duplicate keys {dups[:5]}{more}")
    return obj


_JSON_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"')
_INNERMOST = re.compile(r"[\[{][^\[\]{}]*[\]}]")


def json_outline(text: str, depth: int) -> str | None:
    """``text`` with its strings removed, or None if it nests deeper than ``depth``.

    Linear and without recursion: each pass removes the innermost bracket pairs (those holding
    no bracket), so a pair that survives ``depth`` passes sits more than ``depth`` levels deep.
    Unbalanced text (left for the parser to reject) is too deep if more than ``depth`` opening
    brackets stay unclosed.
    """
    outline = _JSON_STRING.sub('""', text)
    rest = outline
    for _ in range(depth):
        if not any(c in rest for c in "[]{}"):
            return outline
        rest, removed = _INNERMOST.subn("0", rest)
        if not removed:  # no pair left; only unbalanced brackets remain
            break
    if _INNERMOST.search(rest) or rest.count("[") + rest.count("{") > depth:
        return None
    return outline


def loads(path: str | os.PathLike, text: str, what: str, depth: int, **kwargs: Any) -> Any:
    """``json.loads(text)``; anything malformed or nested deeper than ``depth`` raises
    `CheckpointError` naming ``what`` (never a bare ValueError or RecursionError)."""
    if json_outline(text, depth) is None:
        raise CheckpointError(path, f"{what} nests deeper than {depth} levels")
    try:
        return json.loads(text, **kwargs)
    except (ValueError, RecursionError) as e:
        raise CheckpointError(path, f"{what} is not valid JSON ({e})") from None


def _no_constant(name: str) -> Any:
    raise ValueError(f"non-standard JSON constant {name}")


_FIELDS = dict.fromkeys(("dtype", "shape", "data_offsets")).keys()


def _uints(value: Any) -> bool:
    """A list of non-negative ints (bools excluded)."""
    return type(value) is list and all(type(x) is int and x >= 0 for x in value)


def _parse_json(path: Path, text: str, pairs: int) -> Any:
    """The header's JSON; duplicate names anywhere raise `CheckpointError` naming them.

    ``pairs`` is the number of ``name: value`` pairs in the text (its outline's colons). The
    C parser runs alone; only when the parsed objects hold fewer names than that (a name was
    repeated) is the text parsed again with a hook that finds the duplicates.
    """
    try:
        header = json.loads(text, parse_constant=_no_constant)
        if type(header) is dict:
            found = len(header) + sum(len(v) for v in header.values() if type(v) is dict)
            if found != pairs:
                json.loads(text, object_pairs_hook=_json_object, parse_constant=_no_constant)
    except (ValueError, RecursionError) as e:
        raise CheckpointError(path, f"header is not valid JSON ({e})") from None
    return header


def _fill_infos(infos: dict, header: dict) -> None:
    for name, info in header.items():
        infos[name] = (DTYPES[info["dtype"]], tuple(info["shape"]))


def _parse(
    path: Path, raw: bytes, file_len: int, infos: dict | None = None
) -> tuple[dict, dict, int]:
    """`parse_header` on ``raw`` (at least the prefix and header) of a ``file_len``-byte file;
    fills ``infos`` (if given) with ``{name: (dtype, shape)}``."""
    if file_len < 8 or len(raw) < 8:
        raise CheckpointError(
            path,
            f"file too small: {file_len} bytes, a safetensors file needs at least 8 (truncated?)",
        )
    n = header_length(raw)
    if n > MAX_HEADER_BYTES:
        raise CheckpointError(
            path, f"header length {n} exceeds the {MAX_HEADER_BYTES}-byte limit (corrupted?)"
        )
    if 8 + n > file_len or 8 + n > len(raw):
        raise CheckpointError(
            path,
            f"truncated: the header claims {n} bytes but only {file_len - 8} follow the prefix",
        )
    try:
        text = raw[8 : 8 + n].decode("utf-8")
    except UnicodeDecodeError as e:
        raise CheckpointError(path, f"header is not valid UTF-8 ({e})") from None
    outline = json_outline(text, 3)
    if outline is None:
        raise CheckpointError(
            path, "header nests deeper than 3 levels (a safetensors header never does)"
        )
    count = outline.count("{") - 1  # the objects inside the header: tensors and __metadata__
    if count > MAX_TENSORS + 1:
        raise CheckpointError(
            path, f"header lists {count} entries, more than the {MAX_TENSORS}-tensor limit"
        )
    header = _parse_json(path, text, outline.count(":"))
    if not isinstance(header, dict):
        raise CheckpointError(path, f"header must be a JSON object, got {type(header).__name__}")
    meta = header.pop("__metadata__", {})
    if len(header) > MAX_TENSORS:
        raise CheckpointError(
            path, f"header lists {len(header)} tensors, more than the {MAX_TENSORS}-tensor limit"
        )
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise CheckpointError(path, "__metadata__ must be an object of string values")
    spans: dict[str, tuple[int, int]] = {}
    for name, info in header.items():  # one pass, plain type tests: 40,000 entries in ~50 ms
        if type(info) is not dict or info.keys() != _FIELDS:
            raise CheckpointError(
                path, f"tensor {name!r}: expected exactly dtype, shape, data_offsets, got {info!r}"
            )
        dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
        itemsize = ITEMSIZE.get(dtype) if type(dtype) is str else None
        if itemsize is None:
            raise CheckpointError(
                path, f"tensor {name!r}: unknown dtype {dtype!r} (known: {sorted(DTYPES)})"
            )
        if not _uints(shape):
            raise CheckpointError(
                path, f"tensor {name!r}: shape must be a list of non-negative ints, got {shape!r}"
            )
        if not _uints(offsets) or len(offsets) != 2:
            raise CheckpointError(
                path, f"tensor {name!r}: data_offsets must be [begin, end], got {offsets!r}"
            )
        nbytes = math.prod(shape) * itemsize
        if nbytes >= 2**63:
            raise CheckpointError(
                path, f"tensor {name!r}: shape {shape} × {dtype} overflows ({nbytes} bytes)"
            )
        begin, end = offsets
        if end - begin != nbytes:
            raise CheckpointError(
                path,
                f"tensor {name!r}: data_offsets {offsets} span {end - begin} bytes "
                f"but shape {shape} × {dtype} needs {nbytes}",
            )
        spans[name] = (begin, end)
    position, previous = 0, ""
    for name, (begin, end) in sorted(spans.items(), key=lambda item: item[1]):
        if begin < position:
            raise CheckpointError(
                path,
                f"overlapping data_offsets: {name!r} [{begin}, {end}) overlaps {previous!r} "
                f"[{spans[previous][0]}, {spans[previous][1]})",
            )
        if begin > position:
            raise CheckpointError(
                path, f"gap in the data region: bytes [{position}, {begin}) belong to no tensor"
            )
        position, previous = end, name
    data_len = file_len - 8 - n
    if position > data_len:
        raise CheckpointError(
            path, f"truncated: tensors need {position} data bytes but the file holds {data_len}"
        )
    if position < data_len:
        raise CheckpointError(
            path,
            f"{data_len - position} trailing bytes after the last tensor (the data region must "
            "be covered exactly)",
        )
    if infos is not None:
        _fill_infos(infos, header)
    return meta, spans, 8 + n


def parse_header(path: Path, raw: bytes) -> tuple[dict[str, str], dict[str, tuple[int, int]], int]:
    """Checks the safetensors structure; returns ``(metadata, {name: (begin, end)}, data start)``.

    safetensors checks the same and more, but names the fault less precisely and accepts
    duplicate names and unknown fields; this runs first so every error says exactly what is wrong.
    """
    return _parse(path, raw, len(raw))


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
    """The checked header of a safetensors file, reading only its first 8 + N bytes.

    The structure is checked as by `parse_header` (sizes, UTF-8, JSON nesting, dtypes, shapes,
    offsets that cover the data region exactly, as the ``fstat`` size says) without reading any
    tensor data, so a loader can check what the file holds before it allocates anything.
    Pickle suffixes, devices, FIFOs and directories are refused unread.
    """
    path = Path(os.fspath(path))
    if path.suffix.lower() in PICKLE_SUFFIXES:
        raise CheckpointError(
            path,
            f"refusing {path.suffix!r}: pickle-based checkpoints can run arbitrary code when "
            "loaded; convert it to safetensors in a trusted environment",
        )
    f, size = _open_regular(path)
    with f:
        head = _read_at_most(f, min(size, 8))
        if len(head) == 8 and header_length(head) <= min(MAX_HEADER_BYTES, size - 8):
            head += _read_at_most(f, header_length(head))
    infos: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}
    meta, _, start = _parse(path, head, size, infos)
    return Header(path, meta, infos, head[:start])


def decode(path: Path, raw: bytes) -> dict[str, Tensor]:
    """The tensors, decoded by safetensors from the checked bytes."""
    require("safetensors.torch", "models", "reading a checkpoint")  # one line naming the extra
    from safetensors.torch import load

    try:
        return load(raw)
    except Exception as e:  # SafetensorError, or a dtype this safetensors version cannot map
        raise CheckpointError(path, f"safetensors could not decode the file ({e})") from None


def read_safetensors(
    path: str | os.PathLike, *, header: Header | None = None
) -> tuple[dict[str, Tensor], dict[str, str]]:
    """Reads any safetensors file (e.g. a downloaded model) with full structural validation.

    Checks what `load_checkpoint` checks about the structure (sizes, UTF-8, JSON, dtypes,
    shapes, offsets, trailing bytes, pickle refusal) but not checksums, which foreign files lack.

    Args:
        path: the file.
        header: the file's `read_header`, already checked by the caller: the file must still
            have exactly this header (else `CheckpointError`, "changed since its header was
            read"), so what was checked is what gets decoded.

    Returns:
        ``(tensors, metadata)``.
    """
    path = Path(os.fspath(path))
    raw = read_file(path)
    meta, _, start = parse_header(path, raw)
    if header is not None and raw[:start] != header.raw:
        raise CheckpointError(path, "the file changed since its header was read")
    return decode(path, raw), meta


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


def read_config_json(path: str | os.PathLike, *, limit: int = MAX_CONFIG_BYTES) -> Any:
    """A JSON file such as a model's ``config.json``, read bounded; errors name the path.

    Only a regular file of at most ``limit`` bytes is read (`read_regular_file`); the text must
    be UTF-8 JSON nested at most `MAX_JSON_DEPTH` levels (checked before parsing, so deep
    nesting is a `CheckpointError`, never a RecursionError).

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
    raw = read_file(Path(os.fspath(path)), safetensors=False)  # a regular file, read bounded
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise CheckpointError(path, f"not valid UTF-8 JSON ({e})") from None
    doc = loads(path, text, "the file", MAX_JSON_DEPTH)
    if not isinstance(doc, dict) or set(doc) != {"sha256", "data"}:
        raise CheckpointError(path, "expected a JSON object with exactly 'sha256' and 'data'")
    body = json.dumps(doc["data"], sort_keys=True, indent=2)
    if hashlib.sha256(body.encode("utf-8")).hexdigest() != doc["sha256"]:
        raise CheckpointError(path, "sha256 mismatch: the JSON was altered or corrupted")
    return doc["data"]
