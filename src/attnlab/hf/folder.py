"""One check of a transformers checkpoint folder against its config, before any weight is read.

`check_folder` runs before `attnlab.hf.from_pretrained` and ``attnlab visualize --model FOLDER``
(`attnlab.apps.attentions.check_hf_folder`) load anything:

1. Files stay inside the folder: ``config.json``, the weights file transformers would open
   (``model.safetensors``, else the shards of ``model.safetensors.index.json``, or the file a
   config's ``transformers_weights`` names) and every shard are resolved (``..``, absolute
   paths, symlinks) and refused outside the folder (`attnlab._fit.file_in_folder`; a
   Hugging Face cache snapshot may link into its repository's ``blobs``). Pickle weights are
   refused.
2. Only the safetensors headers are read (`attnlab.checkpoint.read_header`: bounded, regular
   files, offsets covering the data); an index must map every tensor to a shard holding it.
3. Layer counts first: a config field counting layers (``num_hidden_layers``,
   ``encoder_layers``, …) above the largest layer list in the tensor names is a problem
   found from the names alone.
4. The model is built on the ``meta`` device from the config, stopping once it registers far
   more parameters and buffers than the files hold (`attnlab._fit.tensor_budget`), so a
   config claiming 20,000 layers is refused in well under a second; its names and shapes must
   then equal the files' (tied parameters may be stored once; non-persistent buffers and
   names the model declares ignorable may be present). Models whose checkpoints transformers
   converts on load (fused MoE experts) are compared by their layer counts only here.

After loading, `check_loading_info` refuses what transformers itself reports missing,
unexpected or mismatched (``output_loading_info=True``), so a model is never returned with a
randomly initialised weight.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .._files import one_line, read_config_json
from .._fit import TensorBudgetError, file_in_folder, tensor_budget, tensor_limit
from ..checkpoint import PICKLE_SUFFIXES, CheckpointError, read_header

#: Config fields (top level or one level down, e.g. ``text_config``) that count layers.
LAYER_FIELDS = (
    "num_hidden_layers",
    "num_layers",
    "n_layer",
    "n_layers",
    "encoder_layers",
    "decoder_layers",
    "num_encoder_layers",
    "num_decoder_layers",
)
_LIST = re.compile(r"(.+?)\.(\d+)\.")  # the outermost numbered list of a tensor name
_SHOWN = 3  # names listed in a message before "and N more"


@dataclass(frozen=True)
class CheckedFolder:
    """What `check_folder` found.

    Attributes:
        folder: the folder checked (``subfolder`` included).
        config: the transformers config (read with ``trust_remote_code=False``).
        model_class: the class the folder was saved from (``config.architectures``), else the
            caller's class, else an Auto class.
        files: the safetensors files transformers will read, inside ``folder``.
        tensors: ``{name: shape}`` of every tensor in them.
    """

    folder: Path
    config: Any
    model_class: Any
    files: tuple[Path, ...]
    tensors: dict[str, tuple[int, ...]]


def _names(keys: list[str]) -> str:
    shown = ", ".join(keys[:_SHOWN])
    return shown + (f", and {len(keys) - _SHOWN} more" if len(keys) > _SHOWN else "")


def _variant(name: str, variant: str | None) -> str:
    """transformers' file name of a weights variant: ``model.fp16.safetensors``."""
    if not variant:
        return name
    stem, suffix = name.rsplit(".", 1)
    return f"{stem}.{variant}.{suffix}"


def _shards(folder: Path, index: Path) -> tuple[list[Path], dict[str, str]]:
    doc = read_config_json(index)  # a regular file inside the folder, read bounded
    weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(weight_map, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
    ):
        raise CheckpointError(index, "expected a weight_map of tensor name → shard file")
    names = sorted(set(weight_map.values()))
    return [file_in_folder(folder, name, named_by=index) for name in names], weight_map


@dataclass(frozen=True)
class WeightFiles:
    """The safetensors files transformers reads from a folder (`weight_files`).

    Attributes:
        files: the files, each inside the folder.
        index: the shard index they come from, or None.
        weight_map: the index's ``{tensor name: shard file name}`` (empty without one).
    """

    files: list[Path]
    index: Path | None = None
    weight_map: dict[str, str] | None = None


def weight_files(
    folder: str | os.PathLike, config: Any = None, *, variant: str | None = None
) -> WeightFiles:
    """The safetensors files transformers reads from ``folder``, each checked to be inside it.

    In transformers' order: the file or index a config's ``transformers_weights`` names, else
    ``model.safetensors``, else ``model.safetensors.index.json`` and its shards (with
    ``variant``, ``model.<variant>.safetensors`` …).

    Raises:
        FileNotFoundError: no safetensors weights (the message names any pickle files, which
            are refused: they can run code when loaded).
        CheckpointError: a file outside the folder, a malformed index.
    """
    folder = Path(os.fspath(folder))
    explicit = getattr(config, "transformers_weights", None) if config is not None else None
    if explicit is not None:
        target = file_in_folder(folder, explicit, named_by=folder / "config.json")
        if explicit.endswith(".safetensors.index.json"):
            files, weight_map = _shards(folder, target)
            return WeightFiles(files, target, weight_map)
        if not explicit.endswith(".safetensors"):
            raise CheckpointError(
                folder / "config.json",
                f"transformers_weights names {explicit!r}, not a .safetensors file or index",
            )
        return WeightFiles([target])
    single = folder / _variant("model.safetensors", variant)
    if single.is_file():
        return WeightFiles([file_in_folder(folder, single.name)])
    index = folder / _variant("model.safetensors.index.json", variant)
    if index.is_file():
        index = file_in_folder(folder, index.name)
        files, weight_map = _shards(folder, index)
        return WeightFiles(files, index, weight_map)
    pickles = sorted(p.name for p in folder.iterdir() if p.suffix.lower() in PICKLE_SUFFIXES)
    if pickles:
        raise FileNotFoundError(
            f"{folder} has no safetensors weights: refusing its pickle files "
            f"({', '.join(pickles[:3])}), which can run arbitrary code when loaded; convert "
            "them to safetensors in a trusted environment"
        )
    raise FileNotFoundError(f"{folder} holds no .safetensors weights ({single.name})")


def read_shapes(weights: WeightFiles) -> dict[str, tuple[Path, tuple[int, ...]]]:
    """``{tensor name: (file, shape)}`` from the safetensors headers alone (no tensor data).

    Raises:
        CheckpointError: a malformed header, a tensor in two files, an index entry whose shard
            does not hold it.
    """
    found: dict[str, tuple[Path, tuple[int, ...]]] = {}
    for f in weights.files:
        for name, (_, shape) in read_header(f).tensors.items():
            if name in found:
                raise CheckpointError(f, f"holds {name!r}, which {found[name][0].name} holds too")
            found[name] = (f, tuple(shape))
    if weights.index is not None and weights.weight_map is not None:
        folder = weights.index.parent
        wrong = sorted(
            k for k, v in weights.weight_map.items() if k not in found or found[k][0] != folder / v
        )
        if wrong:
            raise CheckpointError(
                weights.index,
                f"maps {len(wrong)} tensor(s) to a shard that does not hold them ({_names(wrong)})",
            )
    return found


def layer_lists(names: list[str] | dict[str, Any]) -> dict[str, int]:
    """``{list name: number of distinct indices}`` of the outermost numbered lists in tensor
    names (``model.layers.3.mlp…`` -> ``model.layers``)."""
    lists: dict[str, set[int]] = {}
    for name in names:
        m = _LIST.match(name)
        if m:
            lists.setdefault(m.group(1), set()).add(int(m.group(2)))
    return {stem: len(ids) for stem, ids in lists.items()}


def _layer_fields(config: Any) -> list[tuple[str, object]]:
    doc = config.to_dict()
    fields = [(k, doc[k]) for k in LAYER_FIELDS if k in doc]
    for key, sub in doc.items():
        if isinstance(sub, dict):
            fields += [(f"{key}.{k}", sub[k]) for k in LAYER_FIELDS if k in sub]
    return fields


def model_class_of(config: Any, fallback: Any = None) -> Any:
    """The transformers class named by ``config.architectures``, else ``fallback``, else an
    Auto class (for a sequence-to-sequence config, ``AutoModelForSeq2SeqLM``)."""
    import transformers

    for name in getattr(config, "architectures", None) or ():
        cls = getattr(transformers, str(name), None)
        if isinstance(cls, type) and issubclass(cls, transformers.PreTrainedModel):
            return cls
    if fallback is not None:
        return fallback
    if getattr(config, "is_encoder_decoder", False):
        return transformers.AutoModelForSeq2SeqLM
    return transformers.AutoModel


def _read_config(folder: Path, config: Any) -> Any:
    """The folder's config (its ``config.json`` read bounded first), or ``config`` if given."""
    import transformers

    if isinstance(config, transformers.PretrainedConfig):
        return config
    if config is None:
        if not (folder / "config.json").is_file():
            raise FileNotFoundError(
                f"{folder} has no config.json: not a transformers checkpoint folder"
            )
        path = file_in_folder(folder, "config.json")
    else:
        source = Path(os.fspath(config))
        path = source / "config.json" if source.is_dir() else source
    read_config_json(path)  # a regular file, bounded, plain JSON: before transformers reads it
    try:
        return transformers.AutoConfig.from_pretrained(
            path if config is not None else folder, trust_remote_code=False, local_files_only=True
        )
    except Exception as e:  # OSError, KeyError, ValueError, huggingface_hub's validation errors
        raise CheckpointError(path, f"cannot read the config ({one_line(e)})") from None


def _converted(model: Any) -> bool:
    """Whether transformers converts this model's checkpoints on load (renamed or fused
    tensors, e.g. MoE experts), so the files' names need not be the model's."""
    try:
        from transformers.conversion_mapping import extract_weight_conversions_for_model
        from transformers.modeling_utils import PreTrainedModel
    except ImportError:
        return False
    return any(
        extract_weight_conversions_for_model(m)
        for m in model.modules()
        if isinstance(m, PreTrainedModel)
    )


def check_folder(
    path: str | os.PathLike,
    model_class: Any = None,
    *,
    config: Any = None,
    variant: str | None = None,
    subfolder: str = "",
) -> CheckedFolder:
    """Checks a local transformers folder before any weight is read (see the module docstring).

    Args:
        path: the folder.
        model_class: the class the caller will load (used when the config names none).
        config: a config to use instead of the folder's ``config.json`` (a
            ``PretrainedConfig``, or a path to one).
        variant, subfolder: as in transformers' ``from_pretrained``.

    Returns:
        A `CheckedFolder`.

    Raises:
        FileNotFoundError: not a folder, no config.json, no safetensors weights (pickle files
            are named and refused).
        CheckpointError: (a ValueError) a file outside the folder, a malformed header or
            index or config, a layer count or a missing / extra / differently shaped tensor
            that the config does not match (each named), a config that builds no model.
        MissingExtraError: transformers is not installed.
    """
    from ..utils.extras import require

    require("transformers", "hf", "checking a transformers folder")
    root = Path(os.fspath(path))
    folder = file_in_folder(root, subfolder) if subfolder else root
    if not folder.is_dir():
        raise FileNotFoundError(f"not a transformers checkpoint folder: {folder}")
    config = _read_config(folder, config)
    weights = weight_files(folder, config, variant=variant)
    located = read_shapes(weights)
    found = {name: shape for name, (_, shape) in located.items()}
    cls = model_class_of(config, model_class)

    # Layer counts from the names alone: a field above the largest numbered list explains a
    # refusal (models that share one layer's weights, like ALBERT, pass the exact comparison).
    layers = []
    lists = layer_lists(found)
    most = max(lists.values(), default=0)
    biggest = max(lists, key=lists.__getitem__) if lists else "no numbered list"
    for field, value in _layer_fields(config):
        if value is None:
            continue
        if type(value) is not int or value < 0:
            raise CheckpointError(
                folder / "config.json", f"{field} must be an int >= 0, got {value!r:.40}"
            )
        if value > most:
            layers.append(
                f"config.json says {field} = {value} but the safetensors hold at most {most} "
                f"layer(s) ({biggest}.<i>.*)"
            )

    def refuse(parts: list[str], tail: str) -> CheckpointError:
        return CheckpointError(
            folder,
            f"config.json does not match the safetensors weights ({cls.__name__}): "
            + "; ".join(parts)
            + f" — {tail}",
        )

    limit = tensor_limit(len(found))
    try:
        with torch.device("meta"), tensor_budget(limit):
            model = cls.from_config(config) if hasattr(cls, "from_config") else cls(config)
    except TensorBudgetError:
        parts = layers or [
            f"it builds more than {limit} parameters and buffers but the safetensors hold "
            f"{len(found)} tensors"
        ]
        raise refuse(parts, "refusing before building the model") from None
    except Exception as e:  # transformers raises many kinds for a config it cannot build
        raise CheckpointError(
            folder / "config.json", f"describes no buildable {cls.__name__} ({one_line(e)})"
        ) from None
    # Files transformers converts on load (fused MoE experts) are named otherwise than the
    # model: their layer counts are checked here, the rest by `check_loading_info`.
    differences = (
        layers if _converted(model) else _compare(model, cls, located, len(weights.files) > 1)
    )
    if differences:
        parts = [*layers, *(d for d in differences if d not in layers)]
        raise refuse(parts, "refusing to load (missing weights would be randomly initialised)")
    return CheckedFolder(folder, config, cls, tuple(weights.files), found)


def _patterns(patterns: Any) -> Any:
    """``name -> bool``: whether a name matches one of transformers' key patterns."""
    compiled = [re.compile(p) for p in patterns or ()]
    return lambda name: any(r.search(name) for r in compiled)


def _compare(model: Any, cls: Any, located: dict[str, tuple[Path, tuple]], shards: bool) -> list:
    """The differences between a meta model's state and the files' tensors, in words."""
    found = {name: shape for name, (_, shape) in located.items()}
    expected = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    groups: dict[int, list[str]] = {}  # tied parameters: one tensor, several names
    for name, param in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(param), []).append(name)
    present = {n for names in groups.values() if any(m in found for m in names) for n in names}
    # As transformers: weights the model declares it recomputes (Marian's sinusoidal tables)
    # may be absent; tensors it recomputes (non-persistent buffers such as BERT's position_ids
    # or rotary inv_freq, which older checkpoints saved) or declares ignorable may be present.
    absent_ok = _patterns(getattr(model, "_keys_to_ignore_on_load_missing", None))
    missing = sorted(
        n for n in expected if n not in found and n not in present and not absent_ok(n)
    )
    buffers = {name for name, _ in model.named_buffers()}
    recomputed = [
        pattern
        for suffix, pattern in (
            ("rotary_emb.inv_freq", r"rotary_emb\.inv_freq"),
            ("position_ids", r"(^|\.)position_ids$"),
        )
        if any(b.endswith(suffix) for b in buffers)
    ]
    extra_ok = _patterns(
        [*(getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ()), *recomputed]
    )
    extra = sorted(n for n in found if n not in expected and n not in buffers and not extra_ok(n))
    shapes = sorted(n for n in expected if n in found and found[n] != expected[n])
    problems = []
    if missing:
        problems.append(f"{len(missing)} weights missing from the file ({_names(missing)})")
    if extra:
        problems.append(
            f"{len(extra)} tensors in the file that {cls.__name__} does not have ({_names(extra)})"
        )
    for n in shapes[:_SHOWN]:
        where = f" in {located[n][0].name}" if shards else ""
        problems.append(f"{n}: the config gives shape {expected[n]}, the file{where} {found[n]}")
    if len(shapes) > _SHOWN:
        problems.append(f"and {len(shapes) - _SHOWN} more tensors of another shape")
    return problems


def check_loading_info(folder: str | os.PathLike, info: dict[str, Any], class_name: str) -> None:
    """Refuses what transformers' own loading report (``output_loading_info=True``) lists:
    missing weights (randomly initialised), unexpected tensors (dropped), tensors of another
    shape, loading errors.

    Raises:
        CheckpointError: naming a few of each and how many in all.
    """
    missing = sorted(info.get("missing_keys") or ())
    unexpected = sorted(info.get("unexpected_keys") or ())
    mismatched = sorted(info.get("mismatched_keys") or ())
    errors = [" ".join(str(e).split())[:200] for e in info.get("error_msgs") or ()]
    parts = []
    if missing:
        parts.append(f"{len(missing)} missing ({_names(missing)})")
    if unexpected:
        parts.append(f"{len(unexpected)} unexpected ({_names(unexpected)})")
    if mismatched:
        shown = [f"{k}: file {tuple(a)}, model {tuple(b)}" for k, a, b in mismatched]
        parts.append(f"{len(mismatched)} of another shape ({_names(shown)})")
    if errors:
        parts.append(f"errors: {_names(errors)}")
    if parts:
        raise CheckpointError(
            folder,
            f"transformers loaded {class_name} with weights that do not fit: "
            + "; ".join(parts)
            + " — refusing the model (pass the class the folder was saved as, "
            "config.architectures)",
        )


def local_folder(path: str | os.PathLike, **hub: Any) -> Path:
    """``path`` if it is a local folder, else the local snapshot of the Hugging Face model id
    ``path`` (only ``config.json`` and ``*.json`` / ``*.safetensors`` files; downloaded first
    unless ``local_files_only``), so it can be checked like any folder.

    Args:
        path: a folder or a model id.
        **hub: ``revision``, ``cache_dir``, ``token``, ``local_files_only``,
            ``force_download``, as for ``from_pretrained``.

    Raises:
        OSError: neither a folder nor a model id found (offline: not in the cache).
    """
    text = os.fspath(path)
    if os.path.isdir(text):
        return Path(text)
    from huggingface_hub import snapshot_download

    keys = ("revision", "cache_dir", "token", "local_files_only", "force_download")
    try:
        snapshot = snapshot_download(
            str(text),
            allow_patterns=["*.json", "*.safetensors"],
            **{k: hub[k] for k in keys if hub.get(k) is not None},
        )
    except Exception as e:  # not a valid id, offline and not cached, no such repository, ...
        raise OSError(
            f"{text}: not a local folder, and no Hugging Face model of that id could be found "
            f"({one_line(e)})"
        ) from None
    return Path(snapshot)


__all__ = [
    "LAYER_FIELDS",
    "CheckedFolder",
    "WeightFiles",
    "check_folder",
    "check_loading_info",
    "layer_lists",
    "local_folder",
    "model_class_of",
    "read_shapes",
    "weight_files",
]
