"""A model's attention over a text: tokens and weights ``(layers, heads, T, T)``.

This is what ``attnlab visualize`` draws, from a model already loaded (loading a checkpoint or a
transformers folder, checked, is the app layer's: `attnlab.apps.attentions`). This module
imports only torch:

- `minilm_attentions`: the pretrained all-MiniLM-L6-v2 of `attnlab.models.minilm` (loaded once
  per process), WordPiece tokens including [CLS] and [SEP].
- `gpt_attentions`: a character-level `attnlab.models.GPT`; tokens are characters. Weights are
  collected by `attnlab.analysis.capture.module_attentions`, which re-calls every attnlab
  `MultiHeadAttention` with ``need_weights=True`` during one ordinary forward pass.
- `hf_model_attentions`: a transformers model (encoder, decoder or encoder–decoder) run with
  ``attn_implementation="attnlab"`` (exact weights); past 64 tokens each row's exact top-k
  weights (`LongAttentions`), without the L×S matrix.

Example:
    >>> run = minilm_attentions("The animal didn't cross the street because it was too tired")
    >>> tuple(run.weights.shape[:2])  # (layers, heads) of all-MiniLM-L6-v2
    (6, 12)
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from .capture import module_attentions


@dataclass
class Attentions:
    """What a model attended to: tokens, weights ``(layers, heads, T, T)`` and a description.

    Attributes:
        tokens: T token strings (row/column order of the weights).
        weights: ``(layers, heads, T, T)`` float32/64 on CPU; row i = query token i.
        model: a short name of the model, shown on the page.
        notes: remarks about the run (e.g. truncation), shown on the page and printed.
        key_tokens: S key tokens for cross-attention (weights ``(layers, heads, T, S)``), None
            for self-attention.
        part: which attention of the model ("encoder self-attention", "decoder
            cross-attention", ...); empty for single-attention models.
        sinks: the model has attention sinks (GPT-OSS): each row's weights sum to
            ``1 − p_sink`` (`attnlab.analysis.sink_share`).
    """

    tokens: list[str]
    weights: Tensor
    model: str
    notes: list[str] = field(default_factory=list)
    key_tokens: list[str] | None = None
    part: str = ""
    sinks: bool = False


# ------------------------------------------------------------------------------------ adapters
@functools.lru_cache(maxsize=1)
def _load_minilm() -> Any:
    from ..models.minilm import minilm

    return minilm()


def minilm_attentions(text: str, *, device: torch.device | str = "cpu") -> Attentions:
    """all-MiniLM-L6-v2's attention over ``text`` (the model is loaded once per process and run
    on ``device``; the weights come back on the host for drawing)."""
    model = _load_minilm().to(device)
    tokens, weights = model.attentions(text)  # (layers, heads, T, T)
    notes = []
    if len(tokens) >= model.max_seq_length and model.tokenizer.encode(text).overflowing:
        notes.append(f"The text was truncated to the model's {model.max_seq_length} tokens.")
    return Attentions(list(tokens), weights.detach().float().cpu(), "all-MiniLM-L6-v2", notes)


def gpt_attentions(model: nn.Module, vocab: list[str], text: str) -> Attentions:
    """A character-level `attnlab.models.GPT`'s causal attention over ``text``.

    Characters are the tokens. The text is cut to the model's ``max_seq_len`` (with a note).
    The model runs on its own device; the weights are copied to the host (``.cpu()``) because
    they are drawn or printed.

    Raises:
        ValueError: empty text, or characters outside ``vocab`` (listed).
    """
    if not text:
        raise ValueError("text must not be empty")
    index = {c: i for i, c in enumerate(vocab)}
    unknown = sorted(set(text) - set(index))
    if unknown:
        raise ValueError(
            f"text has characters {unknown} that are not in the checkpoint's vocabulary of "
            f"{len(vocab)} characters"
        )
    notes = []
    limit = model.config.max_seq_len
    if len(text) > limit:
        notes.append(f"The text was cut to the model's max_seq_len = {limit} characters.")
        text = text[:limit]
    device = next(model.parameters()).device
    idx = torch.tensor([[index[c] for c in text]], dtype=torch.long, device=device)  # (1, T)
    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode():
            weights = module_attentions(model, lambda: model(idx))  # (layers, H, T, T)
    finally:
        model.train(was_training)
    return Attentions(list(text), weights.float().cpu(), "character-level GPT", notes)


# ------------------------------------------------------------------- transformers models
HF_MAX_TOKENS = 2048  # tokens kept from the text (the page stores layers × heads × T × top-k)
LONG_CHUNK_ELEMENTS = 1 << 22  # weights formed at once by the long-input path (a chunk of rows)


def _tokens(tokenizer: Any, ids: Tensor) -> list[str]:
    return [str(t) for t in tokenizer.convert_ids_to_tokens(ids.tolist())]


def _is_cross(name: str) -> bool:
    """A decoder's cross-attention module, by transformers' names (BART/Marian/Whisper
    ``encoder_attn``, BERT-style ``crossattention``, T5 ``EncDecAttention``)."""
    last = name.rsplit(".", 1)[-1].lower()
    return last in ("encoder_attn", "crossattention", "encdecattention", "cross_attn")


def hf_model_attentions(
    model: nn.Module,
    tokenizer: Any,
    text: str,
    *,
    name: str,
    long_from: int = 64,
    topk: int = 8,
    thumb_size: int = 64,
) -> list[Attentions | LongAttentions]:
    """A loaded transformers model's attention over ``text``: one `Attentions` per part.

    The model (in eval mode, with ``attn_implementation="attnlab"``: attnlab's exact weights)
    runs once on its own device with ``output_attentions=True``. Encoder and decoder models give
    their self-attention; an encoder–decoder gives the encoder's self-attention and the decoder's
    cross-attention (queries: the decoder tokens, keys: the encoder tokens; the decoder reads the
    text shifted right after its start token, teacher forcing). The text is cut to
    `HF_MAX_TOKENS` tokens (with a note). Inputs longer than ``long_from`` tokens give
    `LongAttentions` instead: every row's exact top-``topk`` weights, entropies and
    ``thumb_size`` thumbnails, computed call by call from the log-sum-exp a chunk of rows at a
    time — no L×S weights are formed or returned. Loading a folder, checked, is
    `attnlab.apps.attentions.hf_attentions`.

    Args:
        model: a transformers model; its ``config`` describes it.
        tokenizer: the model's tokenizer.
        text: the input. name: how the model is called on the page.
        long_from, topk, thumb_size: the long-input path (see above).

    Raises:
        ValueError: empty text; an encoder–decoder config without ``decoder_start_token_id``.
    """
    if not text:
        raise ValueError("text must not be empty")
    config = model.config
    limit = min(HF_MAX_TOKENS, getattr(config, "max_position_embeddings", None) or HF_MAX_TOKENS)
    enc = tokenizer(text, return_tensors="pt", truncation=True, max_length=limit)
    ids = enc["input_ids"][:, :limit]
    notes = []
    if len(tokenizer(text)["input_ids"]) > ids.shape[1]:
        notes.append(f"The text was truncated to {ids.shape[1]} tokens.")
    device = next(model.parameters()).device
    kwargs: dict[str, Any] = {"input_ids": ids.to(device), "output_attentions": True}
    if "attention_mask" in enc:
        kwargs["attention_mask"] = enc["attention_mask"][:, :limit].to(device)
    encoder_decoder = bool(getattr(config, "is_encoder_decoder", False))
    if encoder_decoder:
        start = getattr(config, "decoder_start_token_id", None)
        if start is None:
            raise ValueError(f"{name}: an encoder–decoder config without decoder_start_token_id")
        dec = torch.cat([torch.tensor([[int(start)]]), ids[:, :-1]], dim=1)
        kwargs["decoder_input_ids"] = dec.to(device)
    tokens = _tokens(tokenizer, ids[0])
    dec_tokens = _tokens(tokenizer, dec[0]) if encoder_decoder else tokens
    if max(len(tokens), len(dec_tokens)) > long_from:
        del kwargs["output_attentions"]
        record = _long_forward(model, kwargs, topk, thumb_size)
        encoder = model.get_encoder() if encoder_decoder else None
        inside = {
            n
            for n, m in model.named_modules()
            if encoder is not None and any(m is e for e in encoder.modules())
        }

        def part(names: list[str], q_tokens: list[str], keys: list[str] | None, what: str):
            calls = [c for n in names for c in record[n]]
            v, i, e, t = (torch.stack([c[x] for c in calls]).float() for x in range(4))
            return LongAttentions(
                q_tokens,
                v,
                i.long(),
                e,
                t,
                len(keys or q_tokens),
                name,
                list(notes),
                keys,
                what,
            )

        if not encoder_decoder:
            return [part(list(record), tokens, None, "")]
        enc_names = [n for n in record if n in inside]
        cross = [n for n in record if n not in inside and _is_cross(n)]
        return [
            part(enc_names, tokens, None, "encoder self-attention"),
            part(cross, dec_tokens, tokens, "decoder cross-attention"),
        ]
    with torch.inference_mode():
        out = model(**kwargs)

    def stack(weights: Any) -> Tensor:
        return torch.stack([w[0] for w in weights]).float().cpu()  # (layers, heads, T, S)

    if not encoder_decoder:
        weights = stack(out.attentions)  # (layers, heads, T, T)
        sinks = _has_sinks(model)
        if sinks:
            from .weights import head_sink_share

            means = head_sink_share(weights).mean(-1)  # (layers,)
            notes.append(
                "attention sinks: each row's weights sum to 1 − the sink's share; mean share "
                f"per layer {', '.join(f'{float(m):.3f}' for m in means)}"
            )
        return [Attentions(tokens, weights, name, notes, sinks=sinks)]
    return [
        Attentions(
            tokens, stack(out.encoder_attentions), name, notes, None, "encoder self-attention"
        ),
        Attentions(
            dec_tokens,
            stack(out.cross_attentions),
            name,
            list(notes),
            tokens,
            "decoder cross-attention",
        ),
    ]


def _has_sinks(model: torch.nn.Module) -> bool:
    """A module of ``model`` holds per-head attention-sink logits (GPT-OSS's ``sinks``)."""
    return any(isinstance(getattr(m, "sinks", None), torch.Tensor) for m in model.modules())


# --------------------------------------------------------- long inputs: top-k rows, no L×S
@dataclass
class LongAttentions:
    """A long input's attention without L×S weights: what the viewer's top-k mode shows.

    Attributes:
        tokens, key_tokens, model, notes, part: as in `Attentions`.
        top_val, top_idx: each query row's ``k`` largest exact weights (largest first, ties by
            lower key index) and their key indices, ``(layers, heads, T, k)``.
        row_entropy: ``(layers, heads, T)`` entropy in nats from `attnlab.attention_stats`
            (NaN for rows that attend no key).
        thumbs: ``(layers, heads, r, c)`` max-pooled weights (``r = min(T, size)``, ``c =
            min(S, size)``), pooled per row chunk over keys, then over rows (max is separable).
        S: the number of keys.
    """

    tokens: list[str]
    top_val: Tensor
    top_idx: Tensor
    row_entropy: Tensor
    thumbs: Tensor
    S: int
    model: str
    notes: list[str] = field(default_factory=list)
    key_tokens: list[str] | None = None
    part: str = ""

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """``(layers, heads, T, S)``, the shape the dense weights would have."""
        Ly, H, T, _ = self.top_val.shape
        return (Ly, H, T, self.S)


def _top_rows(
    query: Tensor, key: Tensor, mask: Any, scaling: float | None, k: int, size: int
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Batch item 0's top-k weights, row entropy and thumbnail of one attention call.

    The exact weights of a chunk of rows at a time (`attnlab.attention_weights` from the lse of
    `attnlab.attention_stats`), so at most `LONG_CHUNK_ELEMENTS` weights exist at once.
    """
    import torch.nn.functional as F

    from ..functional.api import attention_stats, attention_weights
    from .weights import top_weights

    q, kk = query[:1], key[:1]
    if isinstance(mask, Tensor) and mask.shape[0] > 1:
        mask = mask[:1]
    st = attention_stats(q, kk, kk, mask=mask, scale=scaling)
    H, L, S = q.shape[1], q.shape[2], kk.shape[2]
    rows = max(1, LONG_CHUNK_ELEMENTS // max(1, H * S))
    vals, idxs, pooled = [], [], []
    cols = min(S, size)
    for r0 in range(0, L, rows):
        r1 = min(L, r0 + rows)
        w = attention_weights(q, kk, st.lse, rows=slice(r0, r1), mask=mask, scale=scaling)[0]
        v, i = top_weights(w.double(), min(k, S))  # (H, r, k)
        vals.append(v)
        idxs.append(i)
        pooled.append(F.adaptive_max_pool1d(w.double().reshape(H * (r1 - r0), 1, S), cols))
    by_key = torch.cat([p.reshape(H, -1, cols) for p in pooled], dim=1)  # (H, L, c)
    r = min(L, size)
    thumbs = F.adaptive_max_pool1d(by_key.transpose(1, 2).reshape(H * cols, 1, L), r)
    thumbs = thumbs.reshape(H, cols, r).transpose(1, 2)  # (H, r, c)
    ent = torch.where(torch.isneginf(st.lse[0]), torch.nan, st.entropy[0].double())  # (H, L)
    return torch.cat(vals, 1), torch.cat(idxs, 1), ent, thumbs


def _long_forward(model: nn.Module, kwargs: dict[str, Any], k: int, size: int) -> dict[str, list]:
    """Runs the model once, recording `_top_rows` of every attention call by module name."""
    from ..hf.bridge import attention_forward
    from ..hf.masking import HFMask
    from ..hf.stats import _swapped

    names = {id(m): name for name, m in model.named_modules()}
    record: dict[str, list] = {}

    def recording(module, query, key, value, attention_mask, **kw):  # type: ignore[no-untyped-def]
        out = attention_forward(module, query, key, value, attention_mask, **kw)
        if kw.get("softcap") is not None:  # the weights from the lse would lack the cap
            raise ValueError(
                f"{type(module).__name__} uses logit soft-capping, which the long-input viewer "
                "path (top-k rows from the lse) does not compute: use at most 64 tokens"
            )
        mask = attention_mask.mask if isinstance(attention_mask, HFMask) else attention_mask
        with torch.no_grad():
            got = _top_rows(query, key, mask, kw.get("scaling"), k, size)
        record.setdefault(names.get(id(module), ""), []).append(got)
        return out

    with _swapped(recording), torch.inference_mode():
        model(**kwargs)
    return record


__all__ = [
    "HF_MAX_TOKENS",
    "LONG_CHUNK_ELEMENTS",
    "Attentions",
    "LongAttentions",
    "gpt_attentions",
    "hf_model_attentions",
    "minilm_attentions",
]
