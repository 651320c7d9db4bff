"""attnlab inside Hugging Face transformers models: ``attn_implementation="attnlab"``.

`register` adds attnlab to transformers' ``AttentionInterface`` (the attention function,
`attention_forward`) **and** ``AttentionMaskInterface`` (the mask function, `hf_mask`); after it,
any model loaded with ``attn_implementation="attnlab"`` runs every attention through
`attnlab.attention` with attnlab masks — causal, padding, sliding windows per layer, packed
sequences (documents) — grouped-query k/v without copies, the model's scaling, dropout in
training, logit soft-capping, and exact weights for ``output_attentions=True``. Query and key
positions come from transformers' own cache offsets (dynamic and static caches). A model that
needs something attnlab does not compute (a separate position bias, sparse key selection) raises
`UnsupportedAttentionError` naming it: at load time with `from_pretrained` (or `check_model` on
a model loaded otherwise), else at its first forward call. `attention_stats` gives every
attention call's per-head statistics (entropy, sink mass, mean distance) without L×S tensors.

transformers (>= 5.4, the ``hf`` extra) is imported by `register`, not by ``import attnlab.hf``;
without it `register` raises a one-line ``MissingExtraError`` naming ``attnlab[hf]``.

Example (a tiny random Llama, saved and loaded from a folder, no network):
    >>> import tempfile, torch, transformers, attnlab.hf
    >>> attnlab.hf.register()
    >>> config = transformers.LlamaConfig(
    ...     vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
    ...     num_attention_heads=4, num_key_value_heads=2)
    >>> folder = tempfile.mkdtemp()
    >>> transformers.LlamaForCausalLM(config).save_pretrained(folder)
    >>> model = transformers.AutoModelForCausalLM.from_pretrained(
    ...     folder, attn_implementation="attnlab")
    >>> ids = torch.tensor([[0, 0, 5, 6, 7], [1, 2, 3, 4, 5]])  # the first row is left-padded
    >>> mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    >>> model(input_ids=ids, attention_mask=mask).logits.shape
    torch.Size([2, 5, 100])
"""

from .bridge import MIN_TRANSFORMERS, NAME, attention_forward, register
from .errors import UnsupportedAttentionError
from .loading import check_model, from_pretrained
from .masking import HFMask, hf_mask
from .stats import STATISTICS, CallStats, ModelStats, attention_stats

__all__ = [
    "MIN_TRANSFORMERS",
    "NAME",
    "STATISTICS",
    "CallStats",
    "HFMask",
    "ModelStats",
    "UnsupportedAttentionError",
    "attention_forward",
    "attention_stats",
    "check_model",
    "from_pretrained",
    "hf_mask",
    "register",
]
