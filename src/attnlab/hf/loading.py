"""Loading a transformers model onto attnlab with every check done at load time.

transformers only checks that ``attn_implementation="attnlab"`` is registered; which features a
model's attention layers pass (a position bias, sparse key selection, …) shows only when they run.
`from_pretrained` loads with attnlab's rules (safetensors only, no remote code), after checking
the folder (`attnlab.hf.folder.check_folder`: every file inside the folder, the config against
the safetensors headers — layer counts, names and shapes — before any weight is read), then
refuses what transformers' own loading report lists (`attnlab.hf.folder.check_loading_info`:
missing, unexpected or mismatched tensors) and calls `check_model`, which runs one 2-token
forward without gradient: every attention layer calls `attention_forward` once, whose argument
checks refuse what attnlab does not compute (`UnsupportedAttentionError`, naming the feature
and the layer class) — so a half-loaded or unsupported model is refused before it is returned,
never with a silently different answer later.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .bridge import NAME, register
from .folder import check_folder, check_loading_info, local_folder

#: Keyword arguments `from_pretrained` sets itself: attnlab's attention, safetensors weights, no
#: code from the checkpoint folder.
FIXED = {"attn_implementation": NAME, "use_safetensors": True, "trust_remote_code": False}
#: Keyword arguments that would load weights from elsewhere than the checked safetensors files.
REFUSED = ("gguf_file", "state_dict", "from_tf", "from_flax")


def check_model(model: nn.Module) -> None:
    """Runs a 2-token forward of ``model`` (no gradient, eval mode restored) to find, in every
    attention layer, a feature attnlab does not support.

    Args:
        model: a transformers ``PreTrainedModel`` loaded with ``attn_implementation="attnlab"``.

    Raises:
        TypeError: not a transformers model.
        ValueError: the model does not use attnlab's attention.
        UnsupportedAttentionError: an attention layer needs something attnlab does not compute.
    """
    config = getattr(model, "config", None)
    if not isinstance(model, nn.Module) or config is None:
        raise TypeError(f"model must be a transformers PreTrainedModel, got {type(model).__name__}")
    used = getattr(config, "_attn_implementation", None)
    if used != NAME:
        raise ValueError(
            f"model must be loaded with attn_implementation={NAME!r}, got {used!r} (use "
            "attnlab.hf.from_pretrained, or pass attn_implementation='attnlab')"
        )
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    ids = torch.zeros(1, 2, dtype=torch.long, device=device)
    inputs: dict[str, Any] = {"input_ids": ids}
    if getattr(config, "is_encoder_decoder", False):
        inputs["decoder_input_ids"] = ids
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            model(**inputs)
    finally:
        model.train(was_training)


def from_pretrained(model_class: Any, path: Any, **kwargs: Any) -> Any:
    """``model_class.from_pretrained(path, **kwargs)`` on attnlab, checked at load time.

    Sets ``attn_implementation="attnlab"``, ``use_safetensors=True`` and
    ``trust_remote_code=False`` (a conflicting value in ``kwargs`` is a ValueError), registers
    attnlab with transformers, checks the folder before any weight is read
    (`attnlab.hf.folder.check_folder`: files inside the folder, config against the safetensors
    headers), loads, refuses any tensor transformers reports missing, unexpected or of another
    shape (`attnlab.hf.folder.check_loading_info`), and runs `check_model`.

    Args:
        model_class: a transformers model class, e.g. ``AutoModelForCausalLM``.
        path: a local checkpoint folder, or a hub id (its cached snapshot is checked like a
            folder; downloaded first unless ``local_files_only=True``).
        **kwargs: passed on (e.g. ``torch_dtype``, ``local_files_only=True``, ``config``,
            ``variant``, ``subfolder``); ``output_loading_info=True`` returns ``(model,
            info)`` as in transformers.

    Returns:
        The loaded model (and transformers' loading info with ``output_loading_info``).

    Raises:
        UnsupportedAttentionError: the model needs something attnlab does not compute.
        CheckpointError: (a ValueError) a file outside the folder, a config the safetensors
            weights do not match, or tensors transformers could not load exactly (named).
        FileNotFoundError: no config.json or no safetensors weights (pickle files refused).
        ValueError: a keyword that contradicts attnlab's loading rules.
    """
    for key, value in FIXED.items():
        if key in kwargs and kwargs[key] != value:
            raise ValueError(
                f"{key} must be {value!r} for attnlab.hf.from_pretrained, got {kwargs[key]!r}"
            )
    for key in REFUSED:
        if kwargs.get(key):
            raise ValueError(
                f"attnlab.hf.from_pretrained reads checked safetensors files only: drop {key}="
            )
    want_info = kwargs.pop("output_loading_info", False)
    register()
    folder = local_folder(path, **kwargs)
    checked = check_folder(
        folder,
        model_class,
        config=kwargs.get("config"),
        variant=kwargs.get("variant"),
        subfolder=kwargs.get("subfolder") or "",
    )
    model, info = model_class.from_pretrained(
        folder, **{**kwargs, **FIXED, "output_loading_info": True}
    )
    check_loading_info(checked.folder, info, type(model).__name__)
    check_model(model)
    return (model, info) if want_info else model


__all__ = ["FIXED", "REFUSED", "check_model", "from_pretrained"]
