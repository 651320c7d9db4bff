"""Mutations of attnlab for tests/test_textbook_mutations.py: each breaks one fact of the library
(a subject) the way a plausible bug would; applied with pytest's monkeypatch and undone after.

A mutation is ``(subject, apply)``; ``apply(monkeypatch)`` changes the library in this process.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable

import torch

from attnlab.functional import reference, scores
from attnlab.masks import patterns

Apply = Callable[[object], None]


def _module(name: str):
    """A module by dotted name (some are shadowed by a function of the same name)."""
    return importlib.import_module(name)


def scale(mp) -> None:
    """The default logit scale 1/√d → 1/d."""
    mp.setitem(scores.SCORES, "dot", scores.Score("dot", lambda x: x, lambda d: 1.0 / d))


def sinusoid_base(mp) -> None:
    """The sinusoid base 10000 → 5000 (the table, the module and the shift matrix)."""
    sin = _module("attnlab.positional.sinusoidal")
    mp.setattr(sin, "DEFAULT_BASE", 5000.0)
    mp.setattr(sin.sinusoidal, "__defaults__", (5000.0,))
    mp.setattr(sin.sinusoidal_shift, "__defaults__", (5000.0,))
    init = sin.SinusoidalEmbedding.__init__
    mp.setattr(init, "__defaults__", (5000.0, *init.__defaults__[1:]))


def rope_base(mp) -> None:
    """RoPE's base 10000 → 5000."""
    rope = _module("attnlab.positional.rope")
    init = rope.RoPE.__init__
    mp.setattr(init, "__defaults__", (5000.0, *init.__defaults__[1:]))


def causal_alignment(mp) -> None:
    """Causal masks see one key too many: ``j ≤ p`` → ``j ≤ p + 1`` (a shifted diagonal).

    The mask states its geometry once (`Mask.diagonals`): its index function, band, key
    interval, counts and block map all follow."""
    mp.setattr(patterns.CausalMask, "diagonals", lambda self: [(None, 1, 1, 0)])


def softmax_flops(mp) -> None:
    """The FLOP count of a softmax element 5 → 4 (estimate and model_cost)."""
    mp.setattr(_module("attnlab.analysis.estimate"), "SOFTMAX_FLOPS_PER_ELEMENT", 4)
    mp.setattr(_module("attnlab.analysis.costs"), "SOFTMAX_FLOPS", 4)


def feature_map(mp) -> None:
    """Linear attention's φ = elu + 1 → elu + 1.5."""
    shifted = lambda x: torch.nn.functional.elu(x) + 1.5  # noqa: E731
    mp.setattr(reference, "elu_feature_map", shifted)
    mp.setitem(reference.LINEAR_FEATURE_MAPS, "elu", shifted)


def entropy_base(mp) -> None:
    """Attention entropy in bits instead of nats."""
    weights = _module("attnlab.analysis.weights")
    nats = weights.entropy
    mp.setattr(weights, "entropy", lambda w, *a, **k: nats(w, *a, **k) / math.log(2))
    mp.setattr(_module("attnlab.analysis"), "entropy", weights.entropy)


def _drop_kwargs(mp, *names: str) -> None:
    """``attnlab.attention`` silently ignores the keyword arguments ``names``."""
    import attnlab

    original = attnlab.attention

    def attention(*args, **kwargs):
        return original(*args, **{k: v for k, v in kwargs.items() if k not in names})

    mp.setattr(attnlab, "attention", attention)


def explicit_scale(mp) -> None:
    """``attention(..., scale=s)`` ignores ``s`` (and the temperature): the default is used."""
    _drop_kwargs(mp, "scale", "temperature")


def masking(mp) -> None:
    """``attention(..., mask=m, bias=b)`` ignores the mask and the additive bias."""
    _drop_kwargs(mp, "mask", "bias")


def element_bytes(mp) -> None:
    """Memory counts take float32 for 2 bytes an element (estimate and model_cost)."""
    for name in ("attnlab.analysis.estimate", "attnlab.analysis.costs"):
        mp.setitem(_module(name)._BYTES, "float32", 2)
        mp.setitem(_module(name)._BYTES, "bfloat16", 4)


def mlp_matrices(mp) -> None:
    """model_cost counts three FFN matrices for a GELU MLP (it has two)."""
    mp.setitem(_module("attnlab.analysis.costs").MLPS, "gelu", 3)


def _estimate_rows(
    mp, fractions: dict[str, float], weights: dict[str, float] | None = None
) -> None:
    """``estimate`` drops ``fractions[row]`` of each named FLOP row (and of the total), and
    ``weights[row]`` of each named row outside the total."""
    import attnlab.analysis

    weights = weights or {}

    original = attnlab.analysis.estimate

    def estimate(*args, **kwargs):
        est = original(*args, **kwargs)
        rows, cut = [], {}
        for name, unit, values in est.rows:
            if name in fractions:
                dropped = {k: v * fractions[name] for k, v in values.items()}
                cut = {k: cut.get(k, 0.0) + v for k, v in dropped.items()}
                values = {k: v - dropped[k] for k, v in values.items()}
            if name == "total":
                values = {k: v - cut.get(k, 0.0) for k, v in values.items()}
            if name in weights:
                values = {k: v * (1 - weights[name]) for k, v in values.items()}
            rows.append((name, unit, values))
        est.rows[:] = rows
        return est

    mp.setattr(attnlab.analysis, "estimate", estimate)


def projection_flops(mp) -> None:
    """estimate forgets the output projection (3 of the 4 projections counted): in its FLOPs
    and in its weight count."""
    _estimate_rows(
        mp,
        {"QKV + output projections": 0.25},
        weights={"projection weights": 0.25, "projection weights + biases": 0.25},
    )


def score_flops(mp) -> None:
    """estimate counts one FLOP per multiply-add in QKᵀ and PV (half of the 2 it should)."""
    _estimate_rows(mp, {"scores QKᵀ": 0.5, "weighted sum PV": 0.5})


def sinusoid_frequencies(mp) -> None:
    """The sinusoid frequencies base^(−2i/d) → base^(−i/d) (the pair index read as the dim)."""
    sin = _module("attnlab.positional.sinusoidal")

    def frequencies(dim, base, device=None):
        return base ** (-torch.arange(0, dim // 2, dtype=torch.float64, device=device) / dim)

    mp.setattr(sin, "_frequencies", frequencies)


def additive_energy(mp) -> None:
    """Additive attention scales its score vector v by 2 (e = 2·vᵀ tanh(…))."""
    original = reference.additive_attention

    def additive_attention(*args, w_v, **kwargs):
        return original(*args, w_v=2 * w_v, **kwargs)

    mp.setattr(reference, "additive_attention", additive_attention)


def io_model(mp) -> None:
    """The tiled IO model reads K and V twice."""
    costs = _module("attnlab.analysis.costs")
    original = costs.io_tiled
    mp.setattr(
        costs, "io_tiled", lambda n, d, sram, block=None: original(n, d, sram, block) + 2 * n * d
    )


def output_bias(mp) -> None:
    """MultiHeadAttention forgets the output projection's bias."""
    from attnlab import MultiHeadAttention

    original = MultiHeadAttention.forward

    def forward(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        b = self.out_proj.bias
        if b is None:
            return out
        return (out[0] - b, *out[1:]) if isinstance(out, tuple) else out - b

    mp.setattr(MultiHeadAttention, "forward", forward)


def weights_axis(mp) -> None:
    """``attention(..., return_weights=True)`` returns weights normalised over the queries."""
    import attnlab

    original = attnlab.attention

    def attention(*args, **kwargs):
        res = original(*args, **kwargs)
        if not kwargs.get("return_weights") or not isinstance(res, tuple):
            return res
        w = res[1]
        return (res[0], w / w.sum(-2, keepdim=True).clamp_min(1e-300), *res[2:])

    mp.setattr(attnlab, "attention", attention)


def dot_prepare(mp) -> None:
    """The dot score normalises q and k (it becomes the cosine score, still scaled by 1/√d)."""
    dot = scores.SCORES["dot"]
    mp.setitem(scores.SCORES, "dot", scores.Score("dot", scores._unit, dot.default_scale))


def sin_cos_order(mp) -> None:
    """The sinusoidal table puts cos in the even dims and sin in the odd ones."""
    import attnlab
    import attnlab.positional

    original = attnlab.positional.sinusoidal

    def sinusoidal(*args, **kwargs):
        t = original(*args, **kwargs)
        return t.unflatten(-1, (-1, 2)).flip(-1).flatten(-2)

    mp.setattr(attnlab.positional, "sinusoidal", sinusoidal)
    emb = attnlab.positional.SinusoidalEmbedding
    forward = emb.forward
    mp.setattr(
        emb,
        "forward",
        lambda self, *a, **k: forward(self, *a, **k).unflatten(-1, (-1, 2)).flip(-1).flatten(-2),
    )


def head_order(mp) -> None:
    """MultiHeadAttention.project returns the query heads in reverse order."""
    from attnlab import MultiHeadAttention

    original = MultiHeadAttention.project

    def project(self, *args, **kwargs):
        q, *rest = original(self, *args, **kwargs)
        return (q.flip(-3), *rest)

    mp.setattr(MultiHeadAttention, "project", project)


def cache_values(mp) -> None:
    """The KV cache stores the keys in place of the values."""
    from attnlab.modules.kv_cache import KVCache

    original = KVCache.update
    mp.setattr(
        KVCache, "update", lambda self, k, v, positions=None: original(self, k, k, positions)
    )


def minilm_heads(mp) -> None:
    """MiniLM.attentions returns each layer's heads in reverse order."""
    from attnlab.models import MiniLM

    original = MiniLM.attentions

    def attentions(self, text):
        tokens, w = original(self, text)
        return tokens, w.flip(1)

    mp.setattr(MiniLM, "attentions", attentions)


def fourier_axes(mp) -> None:
    """FNet's mixing transforms the sequence axis only (the hidden-axis FFT forgotten)."""
    fnet = _module("attnlab.functional.fnet")
    mp.setattr(fnet, "fnet_mixing", lambda x: torch.fft.fft(x, dim=-2).real.to(x.dtype))


MUTATIONS: dict[str, Apply] = {
    "scale": scale,
    "sinusoid": sinusoid_base,
    "rope": rope_base,
    "causal": causal_alignment,
    "flops": softmax_flops,
    "linear": feature_map,
    "entropy": entropy_base,
    "explicit-scale": explicit_scale,
    "masking": masking,
    "bytes": element_bytes,
    "mlp": mlp_matrices,
    "projections": projection_flops,
    "additive": additive_energy,
    "io": io_model,
    "mha": output_bias,
    "score-flops": score_flops,
    "frequencies": sinusoid_frequencies,
    "weights": weights_axis,
    "dot": dot_prepare,
    "sin-cos": sin_cos_order,
    "heads": head_order,
    "kv-cache": cache_values,
    "minilm": minilm_heads,
    "fnet": fourier_axes,
}
