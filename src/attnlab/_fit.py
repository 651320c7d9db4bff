"""Configs justified by a file's tensors, before anything is allocated.

The rule for every loader (attnlab checkpoints, transformers folders, BERT files): a stored
config is checked against the tensors a file holds (their count, names, shapes and dtypes,
from its header only) — field by field (`justify_config`, one `ConfigRule` per field), then by
building the model on the ``meta`` device within a budget of registrations (`tensor_budget`,
`build_checked`) and comparing it name by name (`check_fit`) — so a config's limits follow
from the file rather than from fixed caps, and no config makes a loader build for long. Files a
folder names are confined to it (`file_in_folder`). Errors are `CheckpointError`s naming the
file, the field or tensor, the expected and the found value.
"""

from __future__ import annotations

import math
import os
import re
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path, PurePosixPath, PureWindowsPath

import torch
from torch import Tensor, nn
from torch.nn.modules.module import (
    register_module_buffer_registration_hook,
    register_module_parameter_registration_hook,
)
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map

from ._files import CheckpointError, one_line

TensorSpecs = Mapping[str, tuple[torch.dtype, tuple[int, ...]]]


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

    # torch's registration-hook signature: (module, name, tensor), called positionally
    def hook(_module: nn.Module, _name: str, tensor: Tensor | None) -> None:
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
