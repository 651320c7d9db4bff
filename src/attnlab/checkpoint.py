"""Checkpoints as safetensors files, verified on load; never pickle.

A checkpoint is a standard safetensors file, written and decoded by the safetensors library, so
any safetensors reader opens it. attnlab adds to the header's ``__metadata__``:

    attnlab.format_version   "1"
    attnlab.sha256           JSON {tensor name: sha256 of its bytes}
    attnlab.ties             JSON {alias: stored name} for tied (identical) tensors
    attnlab.header_sha256    sha256 of the 8-byte prefix and the header, computed with this
                             value set to 64 zeros

and around the library: both sha256s verified on load (safetensors alone loads a flipped data
byte or a swapped shape silently); ties and non-contiguous tensors (``save_file`` refuses
both); module loading that checks every key, shape and dtype before copying anything; configs
justified by a file's header before anything is allocated (`justify_config`, `build_checked`,
`tensor_budget`); files confined to a folder (`file_in_folder`). `attnlab._files` holds the
file level: atomic writes, regular files only, pickle refused unopened, what safetensors lets
through (duplicate names, unknown fields, too many tensors) refused. See docs/reliability.md.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath, PureWindowsPath

import torch
from torch import Tensor, nn
from torch.nn.modules.module import (
    register_module_buffer_registration_hook,
    register_module_parameter_registration_hook,
)
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map

from ._files import (
    DTYPES,
    HEADER_KEY,
    MAX_CONFIG_BYTES,
    MAX_HEADER_BYTES,
    MAX_TENSORS,
    PICKLE_SUFFIXES,
    CheckpointError,
    Header,
    atomic_write,
    check_header_sha256,
    load_json,
    loads,
    one_line,
    read_config_json,
    read_header,
    read_safetensors,
    save_json,
    seal_header_sha256,
)
from .utils.extras import require

FORMAT_VERSION = "1"
_RESERVED = "attnlab."


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
        if key is not None and key in seen:
            ties[name] = seen[key]
            continue
        if key is not None:
            seen[key] = name
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


# --------------------------------------------------------------------------------------- loading
def _check_header(header: Header) -> None:
    """Checks the format version and the header's sha256, before any tensor is decoded."""
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
    check_header_sha256(path, header.raw, meta)


def _verify(path: Path, meta: dict[str, str], tensors: dict[str, Tensor]):
    """Checks every tensor's sha256 and the ties; returns ``(user metadata, ties)``."""
    if "attnlab.sha256" not in meta or "attnlab.ties" not in meta:
        raise CheckpointError(path, "attnlab metadata is incomplete (attnlab.sha256, attnlab.ties)")
    digests = loads(path, meta["attnlab.sha256"], "attnlab.sha256", 1)
    ties = loads(path, meta["attnlab.ties"], "attnlab.ties", 1)
    if not isinstance(digests, dict) or set(digests) != set(tensors):
        raise CheckpointError(path, "the sha256 table does not list exactly the stored tensors")
    bad = [name for name, t in tensors.items() if _sha256(t) != digests[name]]
    if bad:
        raise CheckpointError(
            path, f"sha256 mismatch for tensor(s) {sorted(bad)}: the data is corrupted"
        )
    if not isinstance(ties, dict) or any(a in tensors or t not in tensors for a, t in ties.items()):
        raise CheckpointError(path, f"invalid attnlab.ties {ties!r}")
    return {k: v for k, v in meta.items() if not k.startswith(_RESERVED)}, ties


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
    _check_header(header)
    tensors, meta = read_safetensors(path, header=header)
    user, ties = _verify(path, meta, tensors)
    tensors.update({alias: tensors[target] for alias, target in ties.items()})
    result = Checkpoint(str(path), dict(sorted(tensors.items())), user)
    if module is not None:
        result.load_into(module, strict, allow_cast, prefix=prefix)
    return result


# ------------------------------------------------------------------ configs justified by the file
TensorSpecs = Mapping[str, tuple[torch.dtype, tuple[int, ...]]]


def checkpoint_specs(header: Header) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """``{name: (dtype, shape)}`` of every tensor of an attnlab checkpoint, from its header
    alone (`read_header`): tied aliases (``attnlab.ties``) get their stored tensor's entry."""
    specs = dict(header.tensors)
    text = header.metadata.get("attnlab.ties", "{}")
    ties = loads(header.path, text, "attnlab.ties", 1)
    if not isinstance(ties, dict) or any(
        not isinstance(a, str) or a in specs or t not in specs for a, t in ties.items()
    ):
        raise CheckpointError(header.path, "invalid attnlab.ties")
    specs.update({alias: specs[target] for alias, target in ties.items()})
    return specs


def _names(keys: list[str], limit: int = 5) -> str:
    """The first ``limit`` names of ``keys`` and, if there are more, how many in all."""
    shown = ", ".join(repr(k) for k in keys[:limit])
    return shown + (f", … ({len(keys)} in all)" if len(keys) > limit else "")


def check_fit(
    path: str | os.PathLike,
    module: nn.Module,
    specs: TensorSpecs,
    *,
    prefix: str = "",
    what: str = "the config",
) -> None:
    """Checks that the tensors in a file are exactly the module's, before any data is read.

    ``module`` is typically built on the ``meta`` device (no memory): its ``state_dict`` names,
    shapes and dtypes must equal ``specs`` (from the file's header) under ``prefix``. Every
    missing, unexpected and mismatched name is counted and the first few are listed in one
    `CheckpointError`.
    """
    targets = module.state_dict(keep_vars=True)
    mine = {k[len(prefix) :]: v for k, v in specs.items() if k.startswith(prefix)}
    missing = [prefix + k for k in targets if k not in mine]
    unexpected = [prefix + k for k in mine if k not in targets]
    mismatched = [
        f"{prefix}{k} (needs {tuple(t.shape)} {t.dtype}, the file has {mine[k][1]} {mine[k][0]})"
        for k, t in targets.items()
        if k in mine and (tuple(t.shape), t.dtype) != (mine[k][1], mine[k][0])
    ]
    parts = [
        f"{len(keys)} {kind} tensor(s) {_names(keys)}"
        for kind, keys in (("missing", missing), ("unexpected", unexpected))
        if keys
    ]
    if mismatched:
        shown = "; ".join(mismatched[:5])
        more = f"; … ({len(mismatched)} in all)" if len(mismatched) > 5 else ""
        parts.append(f"{len(mismatched)} tensor(s) of another shape or dtype: {shown}{more}")
    if parts:
        raise CheckpointError(path, f"the file's tensors do not justify {what}: {'; '.join(parts)}")


_ARANGE = torch.arange  # the function a mode receives (even if a caller wraps torch.arange)
_SMALL = 1024  # meta inputs of at most this many elements in all are computed on CPU stand-ins
# Functions whose output can be far larger than their inputs: always left to the meta kernels.
_GROWING = frozenset(
    {"repeat", "tile", "repeat_interleave", "kron", "einsum", "cartesian_prod", "meshgrid"}
)


class _MetaWithoutCompiler(TorchFunctionMode):
    """Model building on ``meta`` without torch's Python meta kernels where they are not needed.

    torch implements many meta kernels (``normal_``, ``arange``, ``div``, ``pow``, …) in Python
    behind ``torch._dynamo.disable``, whose first use imports the compiler (seconds). On
    ``meta`` there are no values, so: random fills are skipped; ``arange`` becomes an empty
    meta tensor of its length and dtype; and an op on meta tensors of at most `_SMALL`
    elements in all (e.g. RoPE's ``1 / base ** (i / d)``) runs on zero-filled CPU stand-ins and
    its result goes back to ``meta``, except the functions in `_GROWING`. Anything larger
    uses torch's meta kernels (correct, allocation-free, only slower the first time).
    """

    _FILLS = frozenset(
        {
            Tensor.normal_,
            nn.init.normal_,
            nn.init.trunc_normal_,
            nn.init.xavier_normal_,
            nn.init.kaiming_normal_,
        }
    )

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in self._FILLS:
            target = args[0] if args else kwargs.get("tensor", kwargs.get("self"))
            if isinstance(target, Tensor) and target.is_meta:
                return target
            return func(*args, **kwargs)
        if (
            func is _ARANGE
            and torch.device(kwargs.get("device") or "meta").type == "meta"
            and 1 <= len(args) <= 3
            and all(isinstance(b, (int, float)) for b in args)
        ):
            start, end, step = (0, args[0], 1) if len(args) == 1 else (*args, 1)[:3]
            exact = all(isinstance(b, int) for b in (start, end, step))
            dtype = kwargs.get("dtype") or (torch.int64 if exact else torch.get_default_dtype())
            n = max(0, math.ceil((end - start) / step))
            return torch.empty(n, dtype=dtype, device="meta")
        flat, _ = tree_flatten((args, kwargs))
        tensors = [t for t in flat if isinstance(t, Tensor)]
        if (
            tensors
            and all(t.is_meta and not isinstance(t, nn.Parameter) for t in tensors)
            and sum(t.numel() for t in tensors) <= _SMALL
            and getattr(func, "__name__", "") not in _GROWING
            and "device" not in kwargs
        ):

            def stand_in(x):  # (no nested torch.device context: it would upset the mode stack)
                return (
                    torch.zeros(x.shape, dtype=x.dtype, device="cpu")
                    if isinstance(x, Tensor)
                    else x
                )

            def back(x):
                return torch.empty_like(x, device="meta") if isinstance(x, Tensor) else x

            return tree_map(back, func(*tree_map(stand_in, args), **tree_map(stand_in, kwargs)))
        return func(*args, **kwargs)


class TensorBudgetError(RuntimeError):
    """A model being built registered more parameters and buffers than `tensor_budget` allows.

    Attributes:
        limit: the budget.
    """

    def __init__(self, limit: int) -> None:
        super().__init__(f"the model registers more than {limit} parameters and buffers")
        self.limit = limit


def tensor_limit(count: int) -> int:
    """The budget of a model built to be compared with a file of ``count`` tensors: 4·count + 64.

    A model that matches the file registers about ``count`` parameters and buffers (tied
    parameters are registered twice, non-persistent buffers are not in the file), far below
    this; one that registers more cannot match, so its build may stop there.
    """
    return 4 * count + 64


@contextmanager
def tensor_budget(limit: int | None) -> Iterator[None]:
    """Inside, the calling thread's modules may register at most ``limit`` parameters and
    buffers in all; one more raises `TensorBudgetError` (None: no limit).

    A loader builds a model (on ``meta``) only to compare it with a file's tensors, so a
    config claiming 10**9 layers can be stopped after ``limit`` registrations instead of
    building for minutes. Counted by torch's global module registration hooks, which are
    removed on exit; registrations by other threads are not counted.
    """
    if limit is None:
        yield
        return
    owner = threading.get_ident()
    count = 0

    def hook(module: nn.Module, name: str, tensor: Tensor | None) -> None:
        nonlocal count
        if tensor is not None and threading.get_ident() == owner:
            count += 1
            if count > limit:
                raise TensorBudgetError(limit)

    on_parameter = register_module_parameter_registration_hook(hook)
    on_buffer = register_module_buffer_registration_hook(hook)
    try:
        yield
    finally:
        on_parameter.remove()
        on_buffer.remove()


def build_on_meta(build: Callable[[], nn.Module], *, limit: int | None = None) -> nn.Module:
    """``build()`` under ``torch.device("meta")``: parameters and buffers get shapes and
    dtypes but no memory (random initialisation is skipped; there is nothing to fill).

    Args:
        build: makes the module.
        limit: at most this many parameters and buffers may be registered (`tensor_budget`);
            more raise `TensorBudgetError`. None: no limit.
    """
    with torch.device("meta"), _MetaWithoutCompiler(), tensor_budget(limit):
        return build()


def build_checked(
    path: str | os.PathLike,
    build: Callable[[], nn.Module],
    specs: TensorSpecs,
    *,
    prefix: str = "",
    layers: tuple[str, int] | None = None,
    what: str = "the config",
) -> nn.Module:
    """``build()`` on the ``meta`` device, accepted only if the file's tensors justify it.

    The rule for every loader: a config is checked against the tensors in the file (their
    count, names, shapes and dtypes, from the header only) before anything is allocated, so
    the limits on a config follow from the file rather than from fixed caps.

    1. ``layers=(name, n)``: the file must hold tensors of exactly ``n`` layers
       ``{prefix}{name}.{i}.…`` (counted from the names, so a config claiming a million layers
       is refused before a million modules are built, even on ``meta``).
    2. ``build()`` runs under ``torch.device("meta")`` (no memory; a size that cannot exist
       is refused with `CheckpointError` too), registering at most `tensor_limit` of the
       file's tensor count parameters and buffers (a config the table of layers missed still
       stops at once).
    3. `check_fit`: names, shapes and dtypes must be exactly the file's.

    Returns:
        The module on ``meta``; the caller then allocates it (building it for real, or
        ``load_state_dict(..., assign=True)`` from the loaded tensors).

    Raises:
        CheckpointError: the file's tensors do not justify the config (naming what differs).
    """
    if layers is not None:
        name, n = layers
        found = layer_indices(specs, prefix + name)
        if len(found) != n:
            raise CheckpointError(
                path,
                f"the file's tensors do not justify {what}: it says {n} layer(s) but the file "
                f"holds tensors of {len(found)} ({prefix}{name}.<i>.*)",
            )
    limit = tensor_limit(len(specs))
    try:
        module = build_on_meta(build, limit=limit)
    except TensorBudgetError:
        raise CheckpointError(
            path,
            f"the file's tensors do not justify {what}: it builds a model of more than {limit} "
            f"parameters and buffers but the file holds {len(specs)} tensors (stopped building)",
        ) from None
    except (RuntimeError, ValueError, TypeError, OverflowError, MemoryError) as e:
        raise CheckpointError(
            path, f"{what} describes no buildable model ({one_line(e)})"
        ) from None
    check_fit(path, module, specs, prefix=prefix, what=what)
    return module


# ------------------------------------------------------- stored configs, field by field
@dataclass(frozen=True)
class ConfigRule:
    """How the tensors of a file justify one integer field of a stored config.

    Every field named by a rule must be an int (not a bool, float or str) of at least
    ``low``; then, if ``layers`` is set, the file must hold exactly that many layers; else, if
    one of ``tensor`` is in the file, the field must equal its size along ``dim``; else the
    field must equal ``absent`` (if set) and be at most ``limit`` (if set). A field missing
    from the config (the config class's default applies) is not checked here.

    Attributes:
        field: the field, dotted into nested dicts (``"encoder.n_layers"``).
        low: the smallest valid value.
        layers: the field counts layers: tensors ``{prefix}{layers}.<i>.…`` with that many
            distinct i.
        tensor: the tensor(s) (without the loader's prefix) whose size the field is; the first
            one the file holds is used.
        dim: the dimension of ``tensor`` (negative counts from the end).
        absent: the value the field must have when the file holds none of ``tensor`` (0: "no
            such table").
        limit: the largest value when the file holds none of ``tensor``: for a size no tensor
            gives (a sequence length under RoPE).
        optional: None is accepted (the model derives the value).
    """

    field: str
    low: int = 0
    layers: str | None = None
    tensor: str | tuple[str, ...] = ()
    dim: int = 0
    absent: int | None = None
    limit: int | None = None
    optional: bool = False


_NOT_SET = object()


def _lookup(config: Mapping, dotted: str) -> object:
    value: object = config
    for part in dotted.split("."):
        if not isinstance(value, Mapping) or part not in value:
            return _NOT_SET
        value = value[part]
    return value


def layer_indices(names: Sequence[str] | Mapping[str, object], stem: str) -> set[int]:
    """The distinct i of the names ``{stem}.<i>.…`` (a layer list's entries in the file)."""
    pattern = re.compile(rf"{re.escape(stem)}\.(\d+)\.")
    return {int(m.group(1)) for k in names if (m := pattern.match(k))}


def _excerpt(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:39] + "…"


def justify_config(
    path: str | os.PathLike,
    config: Mapping,
    specs: TensorSpecs,
    rules: Sequence[ConfigRule],
    *,
    prefix: str = "",
    what: str = "the stored config",
) -> None:
    """Checks a stored config's integer fields against the tensors of its file, by ``rules``.

    Runs on the header alone (``specs`` from `checkpoint_specs`) before anything is built, in
    time linear in the number of tensors, so a field of 10**9 or 2**62 (layers, a vocabulary,
    a sequence length) is refused at once. Every problem is listed in one `CheckpointError`
    naming the field, the stored value and what the tensors say.

    Args:
        path: the file (for messages).
        config: the stored config (a JSON object).
        specs: ``{name: (dtype, shape)}`` of the file's tensors.
        rules: one `ConfigRule` per field.
        prefix: prepended to every tensor and layer name of the rules (e.g. "model.").
        what: how messages call the config.

    Raises:
        CheckpointError: a field of the wrong type or below its minimum ("{what} is
            invalid: …"), or one the tensors do not justify ("the file's tensors do not
            justify {what}: …").
    """
    invalid: list[str] = []
    unjustified: list[str] = []
    for rule in rules:
        value = _lookup(config, rule.field)
        if value is _NOT_SET or (value is None and rule.optional):
            continue
        if type(value) is not int:
            invalid.append(
                f"{rule.field} must be an int, got {type(value).__name__} {_excerpt(value)}"
            )
            continue
        if value < rule.low:
            invalid.append(f"{rule.field} must be >= {rule.low}, got {value}")
            continue
        if rule.layers is not None:
            found = len(layer_indices(specs, prefix + rule.layers))
            if value != found:
                unjustified.append(
                    f"{rule.field}: it says {value} layer(s) but the file holds tensors of "
                    f"{found} ({prefix}{rule.layers}.<i>.*)"
                )
            continue
        names = [
            prefix + t for t in ((rule.tensor,) if isinstance(rule.tensor, str) else rule.tensor)
        ]
        name = next((n for n in names if n in specs), None)
        if name is not None:
            shape = tuple(specs[name][1])
            size = shape[rule.dim] if -len(shape) <= rule.dim < len(shape) else None
            if value != size:
                unjustified.append(
                    f"{rule.field} = {value} but {name} has shape {shape} (size {size} along "
                    f"dim {rule.dim})"
                )
        elif rule.absent is not None and value != rule.absent:
            unjustified.append(
                f"{rule.field} = {value} but the file holds no {' or '.join(names)}, so it "
                f"must be {rule.absent}"
            )
        elif rule.limit is not None and value > rule.limit:
            sized = f"the file holds no {' or '.join(names)}" if names else "no tensor sizes it"
            unjustified.append(
                f"{rule.field} = {value} is above {rule.limit}, the most accepted when "
                f"{sized} to justify it"
            )
    if invalid:
        raise CheckpointError(path, f"{what} is invalid: {'; '.join(invalid)}")
    if unjustified:
        raise CheckpointError(
            path, f"the file's tensors do not justify {what}: {'; '.join(unjustified)}"
        )


# ------------------------------------------------------------------------ files in a folder
def folder_roots(folder: str | os.PathLike) -> tuple[Path, ...]:
    """Where the files of ``folder`` may really be: the folder itself (symlinks resolved) and,
    for a snapshot of the Hugging Face cache (``…/models--org--name/snapshots/<revision>``,
    whose files are links into ``…/blobs``), that repository's ``blobs`` directory."""
    real = Path(os.fspath(folder)).resolve()
    roots = [real]
    blobs = real.parent.parent / "blobs"
    if real.parent.name == "snapshots" and blobs.is_dir():
        roots.append(blobs.resolve())
    return tuple(roots)


def file_in_folder(
    folder: str | os.PathLike, name: object, *, named_by: str | os.PathLike | None = None
) -> Path:
    """``folder / name``, refused unless that file stays inside ``folder``.

    ``name`` must be a non-empty relative path without ``..`` components (POSIX or Windows
    spelling), and the file it names, every symlink resolved, must lie inside the folder (or,
    for a Hugging Face cache snapshot, inside its repository's blobs: `folder_roots`).

    Args:
        folder: the folder the caller was given.
        name: the file name, as read from a config or a shard index.
        named_by: the file that names it (an index), for messages; default the folder.

    Returns:
        ``folder / name`` (not resolved: reads follow the checked links).

    Raises:
        CheckpointError: a name that is not a relative path inside the folder, or a link out.
    """
    folder = Path(os.fspath(folder))
    source = Path(os.fspath(named_by)) if named_by is not None else folder
    if not isinstance(name, str) or not name or "\x00" in name:
        raise CheckpointError(source, f"names the file {_excerpt(name)}: not a file name")
    posix, windows = PurePosixPath(name), PureWindowsPath(name)
    if posix.is_absolute() or windows.is_absolute() or windows.drive:
        raise CheckpointError(
            source,
            f"names the file {name!r}, an absolute path: only files inside {folder} are read",
        )
    if ".." in posix.parts or ".." in windows.parts:
        raise CheckpointError(
            source, f"names the file {name!r}, which leaves {folder} ('..'): refused"
        )
    target = folder / name
    real = target.resolve()
    if not any(real == root or real.is_relative_to(root) for root in folder_roots(folder)):
        raise CheckpointError(
            source,
            f"names the file {name!r}, a link to {real}, outside {folder}: only files inside "
            "the folder are read",
        )
    return target


__all__ = [
    "FORMAT_VERSION",
    "MAX_CONFIG_BYTES",
    "MAX_HEADER_BYTES",
    "MAX_TENSORS",
    "PICKLE_SUFFIXES",
    "Checkpoint",
    "CheckpointError",
    "ConfigRule",
    "Header",
    "TensorBudgetError",
    "build_checked",
    "build_on_meta",
    "check_fit",
    "checkpoint_specs",
    "file_in_folder",
    "folder_roots",
    "justify_config",
    "layer_indices",
    "load_checkpoint",
    "load_json",
    "one_line",
    "read_config_json",
    "read_header",
    "read_safetensors",
    "save_checkpoint",
    "save_json",
    "tensor_budget",
    "tensor_limit",
]
