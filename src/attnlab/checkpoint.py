"""Checkpoints as safetensors files, verified on load; never pickle.

A checkpoint is a standard safetensors file (any safetensors reader opens it)::

    [8 bytes: N, little-endian u64] [N bytes: JSON header, space-padded] [tensor bytes]

with attnlab's fields in the header's ``__metadata__``:

    attnlab.format_version   "1"
    attnlab.sha256           JSON {tensor name: sha256 of its bytes}
    attnlab.ties             JSON {alias: stored name} for tied (identical) tensors
    attnlab.header_sha256    sha256 of the 8-byte prefix and the header, computed with this
                             value set to 64 zeros

`load_checkpoint` reads the file once, parses and validates the header itself (sizes, UTF-8,
JSON, dtypes, shapes, offsets that tile the data region exactly, no trailing bytes), checks the
header and every tensor against their sha256, and only then hands the verified bytes to
safetensors. Any flipped byte or truncation therefore raises `CheckpointError`. Pickle-based
files (``.pt``, ``.bin``, zip or pickle magic) are refused without being opened by torch.load;
this module never imports pickle. `save_checkpoint` writes a temporary file in the target
directory, fsyncs it and renames it over the target, so a killed writer leaves the previous
file intact.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import hashlib
import json
import math
import os
import re
import struct
import sys
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

FORMAT_VERSION = "1"
MAX_HEADER_BYTES = 100_000_000  # safetensors' own limit (100 MB)
PICKLE_SUFFIXES = (".pt", ".pth", ".bin", ".pkl", ".pickle", ".ckpt")
_RESERVED = "attnlab."
_HEADER_KEY = "attnlab.header_sha256"
_ZERO_DIGEST = "0" * 64
_HEADER_DIGEST_RE = re.compile(rb'"attnlab\.header_sha256"\s*:\s*"([0-9a-f]{64})"')

_DTYPES: dict[str, torch.dtype] = {
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
_NAMES = {dtype: name for name, dtype in _DTYPES.items()}
_ITEMSIZE = {name: torch.empty(0, dtype=dtype).element_size() for name, dtype in _DTYPES.items()}


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


@dataclass
class Checkpoint:
    """What `load_checkpoint` returns.

    Attributes:
        path: the file it was read from.
        tensors: every tensor in the file (tied names share one tensor).
        metadata: the user metadata passed to `save_checkpoint` (attnlab's own fields removed).
        missing_keys: module entries the file lacks (after a non-strict `load_into`).
        unexpected_keys: file entries the module lacks (after a non-strict `load_into`).
    """

    path: str
    tensors: dict[str, Tensor]
    metadata: dict[str, str]
    missing_keys: list[str] = field(default_factory=list)
    unexpected_keys: list[str] = field(default_factory=list)

    def load_into(
        self,
        module: nn.Module,
        strict: bool = True,
        allow_cast: bool = False,
        *,
        prefix: str = "",
    ) -> Checkpoint:
        """Copies the tensors into ``module`` in place (see `load_checkpoint`); returns self."""
        if not isinstance(module, nn.Module):
            raise TypeError(f"module must be an nn.Module, got {type(module).__name__}")
        if not isinstance(prefix, str):
            raise TypeError(f"prefix must be a str, got {type(prefix).__name__}")
        self.missing_keys, self.unexpected_keys = _apply(
            Path(self.path), module, self.tensors, prefix, strict, allow_cast
        )
        return self


# ---------------------------------------------------------------------------------------- saving
def _tensor_bytes(t: Tensor) -> ctypes.Array:
    """A zero-copy buffer over a contiguous CPU tensor's bytes (keep ``t`` alive meanwhile)."""
    n = t.numel() * t.element_size()
    return (ctypes.c_ubyte * n).from_address(t.data_ptr()) if n else (ctypes.c_ubyte * 0)()


def _collect(tensors_or_module: Mapping[str, Tensor] | nn.Module) -> dict[str, Tensor]:
    if isinstance(tensors_or_module, nn.Module):
        return dict(tensors_or_module.state_dict())
    if not isinstance(tensors_or_module, Mapping):
        raise TypeError(
            "tensors_or_module must be a dict of tensors or an nn.Module, got "
            f"{type(tensors_or_module).__name__}"
        )
    out: dict[str, Tensor] = {}
    for name, t in tensors_or_module.items():
        if not isinstance(name, str):
            raise TypeError(f"tensor names must be str, got {type(name).__name__} {name!r}")
        if not isinstance(t, Tensor):
            raise TypeError(f"tensor {name!r} must be a torch.Tensor, got {type(t).__name__}")
        out[name] = t
    return out


def _check_metadata(metadata: Mapping[str, str] | None) -> dict[str, str]:
    if metadata is None:
        return {}
    if not isinstance(metadata, Mapping):
        raise TypeError(f"metadata must be a dict of str to str, got {type(metadata).__name__}")
    for k, v in metadata.items():
        if not isinstance(k, str) or not isinstance(v, str):
            raise TypeError(
                f"metadata must map str to str, got {type(k).__name__} {k!r} -> {type(v).__name__}"
            )
        if k.startswith(_RESERVED):
            raise ValueError(f"metadata keys starting with {_RESERVED!r} are reserved, got {k!r}")
    return dict(metadata)


def _identity(t: Tensor) -> tuple | None:
    """Tensors with equal identity are the same view of the same memory (a tie)."""
    if t.numel() == 0:
        return None
    return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)


def _prepare(named: dict[str, Tensor]) -> tuple[dict[str, Tensor], dict[str, str]]:
    """Contiguous CPU copies of the distinct tensors, and ``{alias: stored name}`` for ties."""
    stored: dict[str, Tensor] = {}
    ties: dict[str, str] = {}
    seen: dict[tuple, str] = {}
    for name, t in named.items():  # the first name of a tie (state_dict order) is stored
        if name == "__metadata__" or not name:
            raise ValueError(
                f"tensor name must be a non-empty str other than '__metadata__', got {name!r}"
            )
        try:
            name.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError(f"tensor name must be valid Unicode text, got {name!r}") from None
        if t.dtype not in _NAMES:
            raise TypeError(
                f"tensor {name!r} has dtype {t.dtype}, which safetensors cannot store "
                f"(supported: {sorted(str(d) for d in _NAMES)})"
            )
        if t.layout != torch.strided or t.device.type == "meta":
            raise TypeError(
                f"tensor {name!r} must be a dense tensor with data, got {t.layout} on {t.device}"
            )
        key = _identity(t)
        if key is not None and key in seen:
            ties[name] = seen[key]
            continue
        if key is not None:
            seen[key] = name
        stored[name] = t.detach().to("cpu").resolve_neg().contiguous()
    return stored, ties


def _serialize(stored: dict[str, Tensor], ties: dict[str, str], user: dict[str, str]):
    """``(prefix + header bytes, [(name, tensor)] in file order)``."""
    # Widest items first keeps every tensor naturally aligned (as safetensors itself does).
    order = sorted(stored, key=lambda n: (-stored[n].element_size(), n))
    header: dict[str, Any] = {}
    offset = 0
    digests: dict[str, str] = {}
    for name in order:
        t = stored[name]
        n = t.numel() * t.element_size()
        header[name] = {
            "dtype": _NAMES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + n],
        }
        digests[name] = hashlib.sha256(_tensor_bytes(t)).hexdigest()
        offset += n
    meta = dict(user)
    meta["attnlab.format_version"] = FORMAT_VERSION
    meta["attnlab.sha256"] = json.dumps(digests, sort_keys=True)
    meta["attnlab.ties"] = json.dumps(ties, sort_keys=True)
    meta[_HEADER_KEY] = _ZERO_DIGEST
    text = json.dumps({"__metadata__": meta, **header}, separators=(",", ":"), ensure_ascii=False)
    raw = text.encode("utf-8")
    raw += b" " * (-len(raw) % 8)  # pad so the data region starts 8-byte aligned
    head = struct.pack("<Q", len(raw)) + raw
    digest = hashlib.sha256(head).hexdigest().encode()
    head = _HEADER_DIGEST_RE.sub(lambda m: m.group(0).replace(_ZERO_DIGEST.encode(), digest), head)
    return head, [(name, stored[name]) for name in order]


def _atomic_write(path: Path, chunks) -> None:
    """Writes ``chunks`` to a temp file beside ``path``, fsyncs, then renames it over ``path``."""
    directory = path.parent if str(path.parent) else Path(".")
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            for chunk in chunks:
                f.write(chunk)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    try:  # make the rename itself durable (POSIX); harmless where directories cannot be opened
        dfd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(dfd)
    except OSError:
        pass
    finally:
        os.close(dfd)


def save_checkpoint(
    path: str | os.PathLike,
    tensors_or_module: Mapping[str, Tensor] | nn.Module,
    metadata: Mapping[str, str] | None = None,
) -> None:
    """Saves tensors (or a module's state_dict) as a verified safetensors file, atomically.

    Tied tensors (the same view of the same memory, e.g. a tied LM head) are stored once and
    restored as one tensor; non-contiguous tensors are stored contiguously. Every tensor's sha256
    and the header's sha256 go into the header's metadata.

    Args:
        path: target file (conventionally ``*.safetensors``); pickle suffixes are refused.
        tensors_or_module: ``{name: tensor}`` or an ``nn.Module`` (its ``state_dict()``).
        metadata: extra ``{str: str}`` stored in the header (keys must not start "attnlab.").

    Raises:
        TypeError: non-tensor values, non-str names or metadata, unsupported dtypes.
        ValueError: a pickle suffix, a reserved metadata key or tensor name.
    """
    path = Path(os.fspath(path))
    if path.suffix.lower() in PICKLE_SUFFIXES:
        raise ValueError(
            f"path must not use a pickle suffix {PICKLE_SUFFIXES}, got {str(path)!r}: attnlab "
            "writes safetensors (use '.safetensors')"
        )
    if sys.byteorder != "little":  # pragma: no cover - every supported platform is little-endian
        raise RuntimeError("safetensors files are little-endian; this machine is big-endian")
    user = _check_metadata(metadata)
    stored, ties = _prepare(_collect(tensors_or_module))
    head, ordered = _serialize(stored, ties, user)
    _atomic_write(path, [head, *(_tensor_bytes(t) for _, t in ordered)])


def save_json(path: str | os.PathLike, data: Any) -> None:
    """Writes ``{"sha256": …, "data": data}`` atomically; `load_json` verifies the digest."""
    body = json.dumps(data, sort_keys=True, indent=2)
    digest = hashlib.sha256(body.encode("utf-8")).hexdigest()
    text = json.dumps({"sha256": digest, "data": data}, sort_keys=True, indent=2) + "\n"
    _atomic_write(Path(os.fspath(path)), [text.encode("utf-8")])


def load_json(path: str | os.PathLike) -> Any:
    """Reads a file written by `save_json`; raises `CheckpointError` if it was altered."""
    raw = _read(Path(os.fspath(path)))
    try:
        doc = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise CheckpointError(path, f"not valid UTF-8 JSON ({e})") from None
    if not isinstance(doc, dict) or set(doc) != {"sha256", "data"}:
        raise CheckpointError(path, "expected a JSON object with exactly 'sha256' and 'data'")
    body = json.dumps(doc["data"], sort_keys=True, indent=2)
    if hashlib.sha256(body.encode("utf-8")).hexdigest() != doc["sha256"]:
        raise CheckpointError(path, "sha256 mismatch: the JSON was altered or corrupted")
    return doc["data"]


# --------------------------------------------------------------------------------------- loading
def _read(path: Path) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except FileNotFoundError:
        raise FileNotFoundError(errno.ENOENT, f"checkpoint not found: {path}", str(path)) from None


def _refuse_pickle(path: Path) -> None:
    """Refuses pickle-based checkpoints by suffix or magic bytes, without unpickling anything."""
    if path.suffix.lower() in PICKLE_SUFFIXES:
        raise CheckpointError(
            path,
            f"refusing {path.suffix!r}: pickle-based checkpoints can run arbitrary code when "
            "loaded; convert it to safetensors in a trusted environment",
        )


def _sniff_pickle(path: Path, raw: bytes) -> None:
    """Names zip/pickle content, unless the bytes are a plausible safetensors file.

    A safetensors prefix is a little-endian length, so a valid file can start with the same two
    bytes as a pickle (a 896-byte header starts ``80 03``): only content whose prefix cannot be
    safetensors is judged by its magic bytes.
    """
    if len(raw) >= 9:
        (n,) = struct.unpack("<Q", raw[:8])
        if n <= MAX_HEADER_BYTES and 8 + n <= len(raw) and raw[8:9] == b"{":
            return
    if raw[:4] == b"PK\x03\x04":
        raise CheckpointError(path, "refusing a zip archive (torch.save format, pickle inside)")
    if len(raw) >= 2 and raw[0] == 0x80 and 2 <= raw[1] <= 5:
        raise CheckpointError(path, f"refusing a pickle stream (protocol {raw[1]})")


def _reject_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    keys = [k for k, _ in pairs]
    dupes = sorted({k for k in keys if keys.count(k) > 1})
    if dupes:
        raise ValueError(f"duplicate keys {dupes}")
    return dict(pairs)


def _no_constants(name: str) -> Any:
    raise ValueError(f"non-standard JSON constant {name}")


@dataclass
class _Entry:
    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


def _parse(path: Path, raw: bytes) -> tuple[dict[str, str], list[_Entry], int]:
    """Validates the safetensors structure; returns ``(metadata, entries, data start)``."""
    size = len(raw)
    if size < 8:
        raise CheckpointError(
            path, f"file too small: {size} bytes, a safetensors file needs at least 8 (truncated?)"
        )
    (n,) = struct.unpack("<Q", raw[:8])
    if n > MAX_HEADER_BYTES:
        raise CheckpointError(
            path, f"header length {n} exceeds the {MAX_HEADER_BYTES}-byte limit (corrupted?)"
        )
    if 8 + n > size:
        raise CheckpointError(
            path, f"truncated: the header claims {n} bytes but only {size - 8} follow the prefix"
        )
    try:
        text = raw[8 : 8 + n].decode("utf-8")
    except UnicodeDecodeError as e:
        raise CheckpointError(path, f"header is not valid UTF-8 ({e})") from None
    try:
        header = json.loads(
            text, object_pairs_hook=_reject_duplicates, parse_constant=_no_constants
        )
    except (ValueError, RecursionError) as e:
        raise CheckpointError(path, f"header is not valid JSON ({e})") from None
    if not isinstance(header, dict):
        raise CheckpointError(path, f"header must be a JSON object, got {type(header).__name__}")
    meta = header.pop("__metadata__", {})
    if not isinstance(meta, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in meta.items()
    ):
        raise CheckpointError(path, "__metadata__ must be an object of string values")
    data_len = size - 8 - n
    entries: list[_Entry] = []
    for name, info in header.items():
        if not isinstance(info, dict) or set(info) != {"dtype", "shape", "data_offsets"}:
            raise CheckpointError(
                path, f"tensor {name!r}: expected exactly dtype, shape, data_offsets, got {info!r}"
            )
        dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
        if dtype not in _DTYPES:
            raise CheckpointError(
                path, f"tensor {name!r}: unknown dtype {dtype!r} (known: {sorted(_DTYPES)})"
            )

        def is_int(x: object) -> bool:
            return isinstance(x, int) and not isinstance(x, bool) and x >= 0

        if not isinstance(shape, list) or not all(is_int(d) for d in shape):
            raise CheckpointError(
                path, f"tensor {name!r}: shape must be a list of non-negative ints, got {shape!r}"
            )
        if not isinstance(offsets, list) or len(offsets) != 2 or not all(map(is_int, offsets)):
            raise CheckpointError(
                path, f"tensor {name!r}: data_offsets must be [begin, end], got {offsets!r}"
            )
        nbytes = math.prod(shape) * _ITEMSIZE[dtype]
        if nbytes >= 2**63:
            raise CheckpointError(
                path, f"tensor {name!r}: shape {shape} × {dtype} overflows ({nbytes} bytes)"
            )
        begin, end = offsets
        if end < begin or end - begin != nbytes:
            raise CheckpointError(
                path,
                f"tensor {name!r}: data_offsets {offsets} span {end - begin} bytes but shape "
                f"{shape} × {dtype} needs {nbytes}",
            )
        entries.append(_Entry(name, dtype, tuple(shape), begin, end))
    entries.sort(key=lambda e: (e.begin, e.end))
    position, previous = 0, None
    for e in entries:
        if e.begin < position:
            raise CheckpointError(
                path,
                f"overlapping data_offsets: {e.name!r} [{e.begin}, {e.end}) overlaps "
                f"{previous.name!r} [{previous.begin}, {previous.end})",  # type: ignore[union-attr]
            )
        if e.begin > position:
            raise CheckpointError(
                path, f"gap in the data region: bytes [{position}, {e.begin}) belong to no tensor"
            )
        position, previous = e.end, e
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
    return meta, entries, 8 + n


def _verify(path: Path, raw: bytes, meta: dict[str, str], entries: list[_Entry], start: int):
    """Checks the format version and every sha256; returns ``(user metadata, ties)``."""
    version = meta.get("attnlab.format_version")
    if version is None:
        raise CheckpointError(
            path, "not an attnlab checkpoint (no attnlab.format_version in __metadata__)"
        )
    if version != FORMAT_VERSION:
        raise CheckpointError(
            path,
            f"unknown checkpoint format version {version!r} (this attnlab reads version "
            f"{FORMAT_VERSION!r})",
        )
    found = _HEADER_DIGEST_RE.findall(raw[8:start])
    if len(found) != 1 or meta.get(_HEADER_KEY) != found[0].decode():
        raise CheckpointError(path, "header checksum missing or malformed (corrupted header)")
    blank = _HEADER_DIGEST_RE.sub(
        lambda m: m.group(0).replace(found[0], _ZERO_DIGEST.encode()), raw[:start]
    )
    if hashlib.sha256(blank).hexdigest() != found[0].decode():
        raise CheckpointError(path, "header sha256 mismatch: the header is corrupted")
    try:
        digests = json.loads(meta["attnlab.sha256"])
        ties = json.loads(meta["attnlab.ties"])
    except (KeyError, ValueError) as e:
        raise CheckpointError(path, f"attnlab metadata is incomplete or invalid ({e})") from None
    names = {e.name for e in entries}
    if not isinstance(digests, dict) or set(digests) != names:
        raise CheckpointError(path, "the sha256 table does not list exactly the stored tensors")
    bad = [
        e.name
        for e in entries
        if hashlib.sha256(memoryview(raw)[start + e.begin : start + e.end]).hexdigest()
        != digests[e.name]
    ]
    if bad:
        raise CheckpointError(
            path, f"sha256 mismatch for tensor(s) {sorted(bad)}: the data is corrupted"
        )
    if not isinstance(ties, dict) or any(
        alias in names or target not in names for alias, target in ties.items()
    ):
        raise CheckpointError(path, f"invalid attnlab.ties {ties!r}")
    user = {k: v for k, v in meta.items() if not k.startswith(_RESERVED)}
    return user, ties


def _decode(path: Path, raw: bytes, entries: list[_Entry]) -> dict[str, Tensor]:
    """Hands the verified bytes to safetensors and cross-checks what it returns."""
    from safetensors.torch import load

    try:
        tensors = load(raw)
    except Exception as e:  # safetensors raises its own SafetensorError
        raise CheckpointError(path, f"safetensors could not decode the file ({e})") from None
    for e in entries:
        t = tensors.get(e.name)
        if t is None or t.dtype != _DTYPES[e.dtype] or tuple(t.shape) != e.shape:
            raise CheckpointError(path, f"safetensors disagrees with the header on {e.name!r}")
    return tensors


def _apply(
    path: Path,
    module: nn.Module,
    tensors: dict[str, Tensor],
    prefix: str,
    strict: bool,
    allow_cast: bool,
) -> tuple[list[str], list[str]]:
    """Copies file tensors into the module's parameters and buffers; checks everything first."""
    targets = module.state_dict(keep_vars=True)
    mine = {k[len(prefix) :]: v for k, v in tensors.items() if k.startswith(prefix)}
    missing = sorted(set(targets) - set(mine))
    unexpected = sorted(set(mine) - set(targets))
    if strict and (missing or unexpected):
        raise CheckpointError(
            path,
            f"state mismatch (strict=True): missing keys {missing}, unexpected keys {unexpected}",
        )
    problems = []
    plan: list[tuple[Tensor, Tensor]] = []
    by_target: dict[tuple, tuple[str, Tensor]] = {}
    for key in [k for k in targets if k in mine]:  # state_dict order: first name of a tie wins
        dst, src = targets[key], mine[key]
        if tuple(src.shape) != tuple(dst.shape):
            problems.append(
                f"{prefix}{key}: shape mismatch, the module expects {tuple(dst.shape)} and the "
                f"file has {tuple(src.shape)}"
            )
            continue
        if src.dtype != dst.dtype:
            if not allow_cast:
                problems.append(
                    f"{prefix}{key}: dtype mismatch, the module expects {dst.dtype} and the file "
                    f"has {src.dtype} (pass allow_cast=True to convert)"
                )
                continue
            src = src.to(dst.dtype)
        ident = _identity(dst)
        if ident is not None and ident in by_target:
            other, other_src = by_target[ident]
            if not torch.equal(other_src, src):
                problems.append(
                    f"{prefix}{key}: the module ties it to {prefix}{other} but the file holds "
                    "different values for the two"
                )
            continue
        if ident is not None:
            by_target[ident] = (key, src)
        plan.append((dst, src))
    if problems:
        raise CheckpointError(path, "; ".join(problems))
    with torch.no_grad():
        for dst, src in plan:
            dst.copy_(src)
    return missing, unexpected


def read_safetensors(path: str | os.PathLike) -> tuple[dict[str, Tensor], dict[str, str]]:
    """Reads any safetensors file (e.g. a downloaded model) with full structural validation.

    Checks what `load_checkpoint` checks about the structure (sizes, UTF-8, JSON, dtypes,
    shapes, offsets, trailing bytes, pickle refusal) but not checksums, which foreign files lack.

    Returns:
        ``(tensors, metadata)``.
    """
    path = Path(os.fspath(path))
    _refuse_pickle(path)
    raw = _read(path)
    _sniff_pickle(path, raw)
    meta, entries, _ = _parse(path, raw)
    return _decode(path, raw, entries), meta


def load_checkpoint(
    path: str | os.PathLike,
    module: nn.Module | None = None,
    strict: bool = True,
    allow_cast: bool = False,
    *,
    prefix: str = "",
) -> Checkpoint:
    """Loads and verifies a checkpoint written by `save_checkpoint`; optionally into a module.

    Args:
        path: the ``.safetensors`` file.
        module: if given, its parameters and buffers are overwritten in place (ties kept) —
            only after every check has passed, so a failed load leaves the module untouched.
        strict: missing or unexpected keys raise, listing all of them (default True).
        allow_cast: convert tensors whose dtype differs from the module's instead of raising.
        prefix: match only file keys starting with it (stripped) to the module, e.g. "model.".

    Returns:
        A `Checkpoint` with every tensor (ties restored) and the user metadata.

    Raises:
        FileNotFoundError: no such file (the message names the path).
        CheckpointError: pickle formats, truncation, trailing bytes, a bad header, a checksum
            mismatch, an unknown format version, or a module mismatch (key, shapes, dtypes).
    """
    path = Path(os.fspath(path))
    if module is not None and not isinstance(module, nn.Module):
        raise TypeError(f"module must be an nn.Module or None, got {type(module).__name__}")
    _refuse_pickle(path)
    raw = _read(path)
    _sniff_pickle(path, raw)
    meta, entries, start = _parse(path, raw)
    user, ties = _verify(path, raw, meta, entries, start)
    tensors = _decode(path, raw, entries)
    for alias, target in ties.items():
        tensors[alias] = tensors[target]
    result = Checkpoint(str(path), dict(sorted(tensors.items())), user)
    if module is not None:
        result.load_into(module, strict, allow_cast, prefix=prefix)
    return result


__all__ = [
    "FORMAT_VERSION",
    "Checkpoint",
    "CheckpointError",
    "load_checkpoint",
    "load_json",
    "read_safetensors",
    "save_checkpoint",
    "save_json",
]
