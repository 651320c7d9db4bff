"""Checkpoints as safetensors files, verified on load; never pickle.

A checkpoint is a standard safetensors file, written and decoded by the safetensors library, so
any safetensors reader opens it. attnlab adds to the header's ``__metadata__``::

    attnlab.format_version   "1"
    attnlab.sha256           JSON {tensor name: sha256 of its bytes}
    attnlab.ties             JSON {alias: stored name} for tied (identical) tensors
    attnlab.header_sha256    sha256 of the 8-byte prefix and the header, computed with this
                             value set to 64 zeros

and around the library: pickle refused unopened; what safetensors lets through refused
(duplicate names, unknown fields, too many tensors); both sha256s verified (safetensors alone
loads a flipped data byte or a swapped shape silently); ties and non-contiguous tensors
(``save_file`` refuses both); module loading that checks every key, shape and dtype before
copying anything. Files are read and written by `attnlab._files`; the configs a header justifies
are `attnlab._fit`'s. See docs/reliability.md.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor, nn

from ._files import (
    CheckpointError,
    atomic_write,
    loads,
    one_line,
    open_regular,
    read_at_most,
    read_regular_file,
    unique_keys,
)
from .utils.extras import require

FORMAT_VERSION = "1"
MAX_HEADER_BYTES = 100_000_000  # safetensors' own limit (it refuses larger headers)
MAX_TENSORS = 262_144  # per file; far above real single files (a 70B model holds ~700 tensors)
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
_HEADER_DIGEST = re.compile(rb'"attnlab\.header_sha256"\s*:\s*"([0-9a-f]{64})"')
_RESERVED = "attnlab."
_FIELDS = {"dtype", "shape", "data_offsets"}


# --------------------------------------------------------------------------- safetensors headers
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


def _refuse_pickle(path: Path, head: bytes) -> None:
    """Refuses zip or pickle content, judged by the first bytes of a file safetensors refused
    (a valid file may start like a pickle: a 896-byte header gives ``80 03``)."""
    if head[8:].lstrip()[:1] == b"{":  # a safetensors header, refused for another cause
        return
    if head[:4] == b"PK\x03\x04":
        raise CheckpointError(path, "refusing a zip archive (torch.save format, pickle inside)")
    if len(head) >= 2 and head[0] == 0x80 and 2 <= head[1] <= 5:
        raise CheckpointError(path, f"refusing a pickle stream (protocol {head[1]})")


def read_header(path: str | os.PathLike) -> Header:
    """The checked header of a safetensors file, read without its tensor data (8 + N bytes).

    safetensors checks the structure (given the descriptor already checked to be a regular file,
    ``/proc/self/fd``, where it can); then what it lets through is refused: more than
    `MAX_TENSORS` tensors, duplicate names, unknown fields, dtypes not in `DTYPES`. Pickle
    suffixes and content, devices, FIFOs and directories are refused; nothing is unpickled.

    Raises:
        FileNotFoundError: no such file.
        CheckpointError: the file is refused (the cause names what).
    """
    path = Path(os.fspath(path))
    if path.suffix.lower() in PICKLE_SUFFIXES:
        raise CheckpointError(
            path,
            f"refusing {path.suffix!r}: pickle-based checkpoints can run arbitrary code when "
            "loaded; convert it to safetensors in a trusted environment",
        )
    safe_open = require("safetensors", "models", "reading a checkpoint").safe_open
    f, size = open_regular(path)
    with f:
        same = f"/proc/self/fd/{f.fileno()}"
        try:
            with safe_open(same if os.path.exists(same) else str(path), "pt") as st:
                count = len(st.keys())
        except Exception as e:  # SafetensorError
            _refuse_pickle(path, read_at_most(f, 72))
            raise CheckpointError(path, f"not a valid safetensors file ({one_line(e)})") from None
        if count > MAX_TENSORS:
            raise CheckpointError(
                path, f"header lists {count} tensors, more than the {MAX_TENSORS}-tensor limit"
            )
        head = read_at_most(f, 8)
        n = int.from_bytes(head, "little")  # accepted by safetensors (unless the file changed)
        head += read_at_most(f, n) if n <= min(MAX_HEADER_BYTES, size - 8) else b""
    header = loads(path, head[8:], "header", 3, object_pairs_hook=unique_keys)
    if type(header) is not dict:  # (safetensors accepted these bytes: only if they changed)
        raise CheckpointError(path, f"header must be a JSON object, got {type(header).__name__}")
    meta = header.pop("__metadata__", None) or {}
    tensors: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}
    for name, info in header.items():
        if type(info) is not dict or info.keys() != _FIELDS:
            raise CheckpointError(
                path, f"tensor {name!r}: expected exactly dtype, shape, data_offsets, got {info!r}"
            )
        if info["dtype"] not in DTYPES:
            raise CheckpointError(
                path, f"tensor {name!r}: unknown dtype {info['dtype']!r} (known: {sorted(DTYPES)})"
            )
        tensors[name] = (DTYPES[info["dtype"]], tuple(info["shape"]))
    return Header(path, meta, tensors, head)


def read_safetensors(
    path: str | os.PathLike, *, header: Header | None = None
) -> tuple[dict[str, Tensor], dict[str, str]]:
    """``(tensors, metadata)`` of any safetensors file (e.g. a downloaded model): the checks of
    `read_header`, then safetensors decodes the whole file; no checksums (foreign files lack them).

    Args:
        path: the file.
        header: its `read_header`, checked by the caller (default: read now). The file must
            still have exactly this header, so what was checked is what gets decoded.
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
    except Exception as e:  # SafetensorError: the file changed (its data region)
        raise CheckpointError(path, f"not a valid safetensors file ({one_line(e)})") from None


def seal_header_sha256(head: bytes) -> bytes:
    """``head`` (prefix + header) with its `HEADER_KEY` value, 64 zeros, set to its sha256."""
    digest = hashlib.sha256(head).hexdigest().encode()
    return _HEADER_DIGEST.sub(lambda m: m.group(0).replace(b"0" * 64, digest), head)


# ------------------------------------------------------------------------------------- checkpoints
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


def _identity(t: Tensor) -> tuple | None:
    """Tensors with equal identity are the same view of the same memory (a tie)."""
    if t.numel() == 0:
        return None
    return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)


def _prepare(tensors_or_module: Mapping[str, Tensor] | nn.Module):
    """``(stored, ties)``: contiguous CPU tensors that share no memory, ``{alias: stored}``."""
    if isinstance(tensors_or_module, nn.Module):
        tensors_or_module = tensors_or_module.state_dict()
    elif not isinstance(tensors_or_module, Mapping):
        raise TypeError(
            "tensors_or_module must be a dict of tensors or an nn.Module, got "
            f"{type(tensors_or_module).__name__}"
        )
    stored: dict[str, Tensor] = {}
    ties: dict[str, str] = {}
    seen: dict[tuple, str] = {}
    storages: set[int] = set()
    for name, t in tensors_or_module.items():  # the first name of a tie (state_dict order) wins
        if not isinstance(name, str):
            raise TypeError(f"tensor names must be str, got {type(name).__name__} {name!r}")
        if not isinstance(t, Tensor):
            raise TypeError(f"tensor {name!r} must be a torch.Tensor, got {type(t).__name__}")
        if name in ("", "__metadata__") or name.encode("utf-8", "ignore").decode() != name:
            raise ValueError(
                f"tensor name must be a non-empty str of valid Unicode text other than "
                f"'__metadata__', got {name!r}"
            )
        if t.dtype not in DTYPES.values():
            raise TypeError(
                f"tensor {name!r} has dtype {t.dtype}, which attnlab does not store "
                f"(supported: {sorted(str(d) for d in DTYPES.values())})"
            )
        if t.layout != torch.strided or t.device.type == "meta":
            raise TypeError(
                f"tensor {name!r} must be a dense tensor with data, got {t.layout} on {t.device}"
            )
        key = _identity(t)
        if key is not None and seen.setdefault(key, name) != name:
            ties[name] = seen[key]
            continue
        t = t.detach().to("cpu").resolve_neg().resolve_conj().contiguous()
        if t.numel() and t.untyped_storage().data_ptr() in storages:
            t = t.clone()  # overlapping views become copies (safetensors refuses shared memory)
        storages.add(t.untyped_storage().data_ptr())
        stored[name] = t
    return stored, ties


def _sha256(t: Tensor) -> str:
    """The sha256 of a contiguous CPU tensor's bytes, as written to the file."""
    return hashlib.sha256(t.reshape(-1).view(torch.uint8).numpy()).hexdigest()


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


def save_checkpoint(
    path: str | os.PathLike,
    tensors_or_module: Mapping[str, Tensor] | nn.Module,
    metadata: Mapping[str, str] | None = None,
) -> None:
    """Saves tensors (or a module's state_dict) as a verified safetensors file, atomically.

    Tied tensors (the same view of the same memory, e.g. a tied LM head) are stored once;
    non-contiguous tensors contiguously. The sha256s go into the header's metadata.

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
    meta = _check_metadata(metadata)
    stored, ties = _prepare(tensors_or_module)
    save_file = require("safetensors.torch", "models", "save_checkpoint").save_file

    digests = {n: _sha256(t) for n, t in stored.items()}
    meta["attnlab.format_version"] = FORMAT_VERSION
    meta["attnlab.sha256"] = json.dumps(digests, sort_keys=True)
    meta["attnlab.ties"] = json.dumps(ties, sort_keys=True)
    meta[HEADER_KEY] = "0" * 64  # sealed below, once the header's bytes exist

    def fill(tmp: str) -> None:
        save_file(stored, tmp, metadata=meta)  # safetensors streams the tensors to the file
        with open(tmp, "rb+") as f:
            head = f.read(8)
            head += f.read(int.from_bytes(head, "little"))
            f.seek(0)
            f.write(seal_header_sha256(head))

    atomic_write(path, fill)


def _ties(header: Header) -> dict[str, str]:
    """``{alias: stored name}`` from a checkpoint's header (``attnlab.ties``; none if absent)."""
    text = header.metadata.get("attnlab.ties", "{}")
    ties = loads(header.path, text, "attnlab.ties", 1)
    names = header.tensors
    if not isinstance(ties, dict) or any(
        type(t) is not str or a in names or t not in names for a, t in ties.items()
    ):
        raise CheckpointError(header.path, f"invalid attnlab.ties {text[:80]!r}")
    return ties


def _check_header(header: Header) -> dict[str, str]:
    """Checks the format version, the header's sha256 and the ties (returned)."""
    path, meta = header.path, header.metadata
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
    found = _HEADER_DIGEST.findall(header.raw[8:])
    if len(found) != 1 or meta.get(HEADER_KEY) != found[0].decode():
        raise CheckpointError(path, "header checksum missing or malformed (corrupted header)")
    blank = _HEADER_DIGEST.sub(lambda m: m.group(0).replace(found[0], b"0" * 64), header.raw)
    if hashlib.sha256(blank).hexdigest() != found[0].decode():
        raise CheckpointError(path, "header sha256 mismatch: the header is corrupted")
    if "attnlab.sha256" not in meta or "attnlab.ties" not in meta:
        raise CheckpointError(path, "attnlab metadata is incomplete (attnlab.sha256, attnlab.ties)")
    return _ties(header)


def _verify(path: Path, meta: dict[str, str], tensors: dict[str, Tensor]) -> dict[str, str]:
    """Checks every tensor's sha256; returns the user metadata."""
    digests = loads(path, meta["attnlab.sha256"], "attnlab.sha256", 1)
    if not isinstance(digests, dict) or set(digests) != set(tensors):
        raise CheckpointError(path, "the sha256 table does not list exactly the stored tensors")
    bad = [name for name, t in tensors.items() if _sha256(t) != digests[name]]
    if bad:
        raise CheckpointError(
            path, f"sha256 mismatch for tensor(s) {sorted(bad)}: the data is corrupted"
        )
    return {k: v for k, v in meta.items() if not k.startswith(_RESERVED)}


def _bits_equal(a: Tensor, b: Tensor) -> bool:
    """Bit-for-bit equality (NaN payloads included), for tensors of one shape and dtype."""
    return a is b or torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


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
        elif src.dtype != dst.dtype and not allow_cast:
            problems.append(
                f"{prefix}{key}: dtype mismatch, the module expects {dst.dtype} and the file "
                f"has {src.dtype} (pass allow_cast=True to convert)"
            )
        elif (ident := _identity(dst)) is not None and ident in by_target:
            other, other_src = by_target[ident]
            if other_src.dtype != src.dtype or not _bits_equal(other_src, src):
                problems.append(
                    f"{prefix}{key}: the module ties it to {prefix}{other} but the file holds "
                    "different values for the two"
                )
        else:
            if ident is not None:
                by_target[ident] = (key, src)
            plan.append((dst, src))
    if problems:
        raise CheckpointError(path, "; ".join(problems))
    with torch.no_grad():
        for dst, src in plan:
            dst.copy_(src)  # casts when allow_cast
    return missing, unexpected


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
        CheckpointError: not a regular file (a device, FIFO or directory), pickle formats,
            anything safetensors refuses (truncation, trailing bytes, a bad header, quoting
            its message), duplicate names or unknown fields, too many tensors, a checksum
            mismatch, an unknown format version, or a module mismatch (key, shapes, dtypes).
    """
    path = Path(os.fspath(path))
    if module is not None and not isinstance(module, nn.Module):
        raise TypeError(f"module must be an nn.Module or None, got {type(module).__name__}")
    header = read_header(path)
    ties = _check_header(header)
    tensors, meta = read_safetensors(path, header=header)
    user = _verify(path, meta, tensors)
    tensors.update({alias: tensors[target] for alias, target in ties.items()})
    result = Checkpoint(str(path), dict(sorted(tensors.items())), user)
    if module is not None:
        result.load_into(module, strict, allow_cast, prefix=prefix)
    return result


def checkpoint_specs(header: Header) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """``{name: (dtype, shape)}`` of every tensor of an attnlab checkpoint, from its header
    alone (`read_header`): tied aliases (``attnlab.ties``) get their stored tensor's entry."""
    specs = dict(header.tensors)
    specs.update({alias: specs[target] for alias, target in _ties(header).items()})
    return specs


__all__ = [
    "FORMAT_VERSION",
    "MAX_HEADER_BYTES",
    "MAX_TENSORS",
    "PICKLE_SUFFIXES",
    "Checkpoint",
    "CheckpointError",
    "Header",
    "checkpoint_specs",
    "load_checkpoint",
    "read_header",
    "read_safetensors",
    "save_checkpoint",
]
