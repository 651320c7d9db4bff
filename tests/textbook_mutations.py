"""Mutations of attnlab for tests/test_textbook_mutations.py: each breaks one fact of the library
(a subject) the way a plausible bug would; applied with pytest's monkeypatch and undone after.

A mutation is ``(subject, apply)``; ``apply(monkeypatch)`` changes the library in this process.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable

import torch

from attnlab.functional import reference, request
from attnlab.masks import patterns

Apply = Callable[[object], None]


def _module(name: str):
    """A module by dotted name (some are shadowed by a function of the same name)."""
    return importlib.import_module(name)


def scale(mp) -> None:
    """The default logit scale 1/√d → 1/d."""
    mp.setitem(request.SCORES, "dot", request.Score("dot", lambda x: x, lambda d: 1.0 / d))


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
    dot = request.SCORES["dot"]
    mp.setitem(request.SCORES, "dot", request.Score("dot", request._unit, dot.default_scale))


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


def additive_concat(mp) -> None:
    """Additive attention scores each (query, key) pair by projecting their concatenation
    (``W [q_i; k_j]`` on an ``(L, S, Dq + Dk)`` tensor): the same scores at O(L·S·d·h) cost."""

    def additive_attention(query, key, value, *, w_q, w_k, b_k, w_v, **kwargs):
        L, S = query.shape[-2], key.shape[-2]
        pair = torch.cat(
            [
                query.unsqueeze(-2).expand(*query.shape[:-1], S, query.shape[-1]),
                key.unsqueeze(-3).expand(*key.shape[:-2], L, S, key.shape[-1]),
            ],
            -1,
        )
        hidden = pair @ torch.cat([w_q, w_k], -1).T  # (B, L, S, Hd)
        if b_k is not None:
            hidden = hidden + b_k
        logits = torch.tanh(hidden) @ w_v
        bias = kwargs.get("bias")
        if bias is not None:
            logits = logits + bias
        mask = kwargs.get("mask")
        if mask is not None:
            logits = logits.masked_fill(~mask, float("-inf"))
        p = torch.softmax(logits, -1)
        return p @ value, p

    mp.setattr(reference, "additive_attention", additive_attention)


def additive_key_bias(mp) -> None:
    """``AdditiveAttention(..., bias=False)`` still gives its key projection a bias."""
    from attnlab import AdditiveAttention

    init = AdditiveAttention.__init__

    def with_bias(self, *args, **kwargs):
        init(self, *args, **{**kwargs, "bias": True})

    mp.setattr(AdditiveAttention, "__init__", with_bias)


def estimate_causal_half(mp) -> None:
    """estimate's naive rows count the causal half of the score matrix, ``L(L+1)/2`` pairs per
    head, even without a mask (a triangle assumed for every self-attention)."""
    import attnlab.analysis

    original = attnlab.analysis.estimate
    dense_rows = ("attended pairs per head", "scores QKᵀ", "softmax", "weighted sum PV")

    def estimate(*args, **kwargs):
        est = original(*args, **kwargs)
        c = est.config
        if c["mask"] is not None or c["L"] != c["S"]:
            return est
        dense = c["dense_pairs"]
        f = (c["L"] + 1) / (2 * c["L"])
        p_bytes = c["B"] * c["H"] * dense * _module("attnlab.analysis.estimate")._BYTES[c["dtype"]]
        rows, cut = [], 0.0
        for name, unit, values in est.rows:
            values = dict(values)
            if name in dense_rows:
                if name != "attended pairs per head":
                    cut += values["naive"] * (1 - f)
                values["naive"] *= f
            elif name == "total":
                values["naive"] -= cut
            elif name == "score matrix":
                values["naive"] *= f
            elif name == "activations kept for backward":
                values["naive"] -= (1 - f) * p_bytes * c["layers"]
            rows.append((name, unit, values))
        est.rows[:] = rows
        return est

    mp.setattr(attnlab.analysis, "estimate", estimate)


def ffn_width(mp) -> None:
    """The Transformer block's MLP ignores ``d_ff`` and is ``d_model`` wide."""
    import dataclasses

    blocks = _module("attnlab.models.blocks")
    original = blocks.make_mlp

    def make_mlp(config):
        return original(dataclasses.replace(config, d_ff=config.d_model))

    mp.setattr(blocks, "make_mlp", make_mlp)


def kv_history(mp) -> None:
    """The KV cache forgets what it held before each update (it keeps only the new tokens)."""
    from attnlab.modules.kv_cache import KVCache

    original = KVCache.update

    def update(self, k, v, positions=None):
        self.reset()
        return original(self, k, v, positions)

    mp.setattr(KVCache, "update", update)


def sinusoid_periods(mp) -> None:
    """Explicit sinusoid periods T are read as ω = 1/T (the 2π forgotten)."""
    sin = _module("attnlab.positional.sinusoidal")
    original = sin._encode

    def _encode(positions, dim, base, dtype, amplitude=1.0, periods=None):
        if periods is not None:
            periods = tuple(2 * math.pi * t for t in periods)
        return original(positions, dim, base, dtype, amplitude, periods)

    mp.setattr(sin, "_encode", _encode)


def sinusoid_exponent(mp) -> None:
    """The sinusoid exponent 2i/d is computed with integer division: every ω_i = 1."""
    sin = _module("attnlab.positional.sinusoidal")

    def frequencies(dim, base, device=None):
        two_i = torch.arange(0, dim, 2, dtype=torch.float64, device=device)
        return base ** (-(two_i // dim))

    mp.setattr(sin, "_frequencies", frequencies)


def default_causal(mp) -> None:
    """MultiHeadAttention applies a causal mask when no mask is given."""
    from attnlab import MultiHeadAttention, masks

    original = MultiHeadAttention.forward

    def forward(self, *args, **kwargs):
        if kwargs.get("mask") is None and kwargs.get("cache") is None:
            kwargs["mask"] = masks.causal()
        return original(self, *args, **kwargs)

    mp.setattr(MultiHeadAttention, "forward", forward)


def window_width(mp) -> None:
    """A sliding window of w sees w + 1 keys (its band ``−w ≤ j − p`` instead of ``1 − w``)."""

    def diagonals(self):
        reach = self.window
        return [(-reach, 0 if self.causal else reach, 1, 0)]

    mp.setattr(patterns.SlidingWindowMask, "diagonals", diagonals)


def alibi_sign(mp) -> None:
    """ALiBi's penalty has the wrong sign: the bias grows with the distance."""
    from attnlab.positional import ALiBi

    original = ALiBi.matrix
    mp.setattr(ALiBi, "matrix", lambda self, *a, **k: -original(self, *a, **k))


def shaw_offsets(mp) -> None:
    """Shaw attention indexes its relative tables by j − i instead of i − j."""
    import attnlab.positional

    for module in (_module("attnlab.positional.shaw"), attnlab.positional, reference):
        original = module.shaw_attention

        def shaw_attention(q, k, v, rel_k, rel_v, *args, _original=original, **kwargs):
            return _original(q, k, v, rel_k.flip(0), rel_v.flip(0), *args, **kwargs)

        mp.setattr(module, "shaw_attention", shaw_attention)


def learned_range(mp) -> None:
    """LearnedPositionalEmbedding clamps positions beyond max_len to the last row (no error)."""
    from attnlab.positional import LearnedPositionalEmbedding

    original = LearnedPositionalEmbedding.forward

    def forward(self, positions):
        if isinstance(positions, int):
            positions = torch.arange(positions)
        return original(self, positions.clamp(0, self.max_len - 1))

    mp.setattr(LearnedPositionalEmbedding, "forward", forward)


def diversity_self(mp) -> None:
    """head_diversity averages the cosine similarity over all pairs of heads, a head with
    itself included."""
    weights = _module("attnlab.analysis.weights")

    def head_diversity(w):
        a = w.flatten(-2)
        cos = torch.nn.functional.cosine_similarity(a.unsqueeze(-2), a.unsqueeze(-3), dim=-1)
        return 1 - cos.mean((-1, -2))

    mp.setattr(weights, "head_diversity", head_diversity)
    mp.setattr(_module("attnlab.analysis"), "head_diversity", head_diversity)


def output_norm_axis(mp) -> None:
    """output_norm slices W_O by rows (output features) instead of by the heads' columns."""
    importance = _module("attnlab.analysis.importance")

    def output_norm(model):
        rows = []
        for _, m in importance.attention_modules(model):
            H, _ = importance._heads(m)
            w = m.out_proj.weight.detach()
            rows.append(w.unflatten(0, (H, -1)).pow(2).sum(dim=(1, 2)).sqrt())
        return importance._stack(rows)

    mp.setattr(importance, "output_norm", output_norm)
    mp.setattr(_module("attnlab.analysis"), "output_norm", output_norm)


def query_softmax(mp) -> None:
    """``attention`` normalises its weights over the queries (softmax on the wrong axis): the
    output and the returned weights both."""
    import attnlab

    original = attnlab.attention

    def attention(q, k, v, *args, **kwargs):
        want = kwargs.pop("return_weights", False)
        if kwargs.get("return_lse"):
            return original(q, k, v, *args, return_weights=want, **kwargs)
        out, w = original(q, k, v, *args, return_weights=True, **kwargs)
        w = w / w.sum(-2, keepdim=True).clamp_min(1e-300)
        vv = v if v.dim() == w.dim() else v.unsqueeze(-3)
        out = (w.to(vv.dtype) @ vv).reshape(out.shape).to(out.dtype)
        return (out, w) if want else out

    mp.setattr(attnlab, "attention", attention)


def checkpoint_recompute(mp) -> None:
    """Gradient checkpointing runs each block once and keeps its activations (the recompute
    dropped: the flag has no effect)."""
    blocks = _module("attnlab.models.blocks")
    mp.setattr(blocks, "checkpoint", lambda fn, *a, use_reentrant=False, **k: fn(*a, **k))


def noam_scale(mp) -> None:
    """The noam schedule forgets its ``d_model^-0.5`` factor."""
    settings = _module("attnlab.apps.gpt_settings")
    original = settings.lr_at

    def lr_at(step, s):
        lr = original(step, s)
        return lr * s.d_model**0.5 if s.schedule == "noam" else lr

    mp.setattr(settings, "lr_at", lr_at)
    mp.setattr(_module("attnlab.apps.gpt"), "lr_at", lr_at)


def span_ramp(mp) -> None:
    """AdaptiveSpan's span forgets the ramp: ``⌈max z⌉`` instead of ``⌈max z + R⌉``."""
    from attnlab.modules.adaptive_span import AdaptiveSpan

    original = AdaptiveSpan.refresh_span

    def refresh_span(self):
        original(self)
        self.span = max(1, math.ceil(float(self.z.detach().max())))
        return self.span

    mp.setattr(AdaptiveSpan, "refresh_span", refresh_span)


def rope_layout(mp) -> None:
    """RoPE ignores ``interleaved=True`` (always the rotate-half layout)."""
    rope = _module("attnlab.positional.rope")
    init = rope.RoPE.__init__

    def rotate_half(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.interleaved = False

    mp.setattr(rope.RoPE, "__init__", rotate_half)


def rope_factor(mp) -> None:
    """RoPE scaling ignores its ``factor`` (every scaled RoPE is the plain one)."""
    import attnlab.positional

    scaling = _module("attnlab.positional.rope_scaling")
    original = scaling.compute_rope_parameters

    def compute_rope_parameters(config, dim, base, **kwargs):
        if config is not None and "factor" in config:
            config = {**config, "factor": 1.0}
        return original(config, dim, base, **kwargs)

    for module in (scaling, _module("attnlab.positional.rope"), attnlab.positional):
        mp.setattr(module, "compute_rope_parameters", compute_rope_parameters)


def projection_init(mp) -> None:
    """MultiHeadAttention initialises its projections N(0, 0.02²) whatever the width (the
    variance of q grows with d_model)."""
    from attnlab import MultiHeadAttention

    init = MultiHeadAttention.__init__

    def fixed_std(self, *args, **kwargs):
        init(self, *args, **kwargs)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if name.endswith("weight"):
                    p.normal_(0.0, 0.02)

    mp.setattr(MultiHeadAttention, "__init__", fixed_std)


def cosine_unnormalised(mp) -> None:
    """The cosine score forgets to normalise q and k (it becomes the dot product)."""
    cos = request.SCORES["cosine"]
    mp.setitem(request.SCORES, "cosine", request.Score("cosine", lambda x: x, cos.default_scale))


def stats_axis(mp) -> None:
    """The experiments' softmax statistics normalise over the samples instead of the keys."""
    experiments = _module("attnlab.analysis.experiments")
    original = experiments._softmax_stats
    mp.setattr(experiments, "_softmax_stats", lambda logits: original(logits.T))


def stats_temperature(mp) -> None:
    """``attention_stats`` ignores its temperature and scale."""
    import attnlab

    original = attnlab.attention_stats

    def attention_stats(*args, temperature=None, scale=None, **kwargs):
        return original(*args, **kwargs)

    mp.setattr(attnlab, "attention_stats", attention_stats)


def merge_weights(mp) -> None:
    """merge_partials averages the parts' outputs with equal weights (their log-sum-exps unused
    for the output)."""
    import attnlab

    original = attnlab.merge_partials

    def merge_partials(outs, lses):
        _, lse = original(outs, lses)
        return sum(outs) / len(outs), lse

    mp.setattr(attnlab, "merge_partials", merge_partials)


def _estimate_edit(mp, edit) -> None:
    """``estimate`` with ``edit(name, values, config)`` applied to each row's values (a copy);
    the total FLOPs re-summed from the edited rows."""
    import attnlab.analysis

    original = attnlab.analysis.estimate
    flops = ("QKV + output projections", "scores QKᵀ", "softmax", "weighted sum PV")

    def estimate(*args, **kwargs):
        est = original(*args, **kwargs)
        rows = [(n, u, edit(n, dict(v), est.config)) for n, u, v in est.rows]
        by_name = {n: v for n, _, v in rows}
        if all(n in by_name for n in flops):
            total = {i: sum(by_name[n][i] for n in flops) for i in by_name["total"]}
            rows = [(n, u, total if n == "total" else v) for n, u, v in rows]
        est.rows[:] = rows
        return est

    mp.setattr(attnlab.analysis, "estimate", estimate)


def linear_state(mp) -> None:
    """estimate counts linear attention's D×D state as a D-vector (its FLOPs linear in D)."""

    def edit(name, values, c):
        if name in ("scores QKᵀ", "weighted sum PV"):
            values["linear"] /= c["D"]
        return values

    _estimate_edit(mp, edit)


def flash_kept(mp) -> None:
    """estimate has the tiled (flash) form keep the probabilities for backward, like naive."""

    def edit(name, values, c):
        if name == "activations kept for backward":
            nb = _module("attnlab.analysis.estimate")._BYTES[c["dtype"]]
            values["flash"] += c["layers"] * c["B"] * c["H"] * c["dense_pairs"] * nb
        return values

    _estimate_edit(mp, edit)


def kept_layers(mp) -> None:
    """estimate's activations kept for backward are one layer's, whatever the depth."""

    def edit(name, values, c):
        if name == "activations kept for backward":
            values = {i: v / c["layers"] for i, v in values.items()}
        return values

    _estimate_edit(mp, edit)


def score_width(mp) -> None:
    """estimate's score FLOPs use d_model for the head width (QKᵀ and PV ×H)."""

    def edit(name, values, c):
        if name in ("scores QKᵀ", "weighted sum PV"):
            values["naive"] *= c["H"]
            values["flash"] *= c["H"]
        return values

    _estimate_edit(mp, edit)


def projection_count(mp) -> None:
    """estimate counts the projection weights of one head (``4·E·D``, not ``4·E²``)."""

    def edit(name, values, c):
        if name in ("projection weights", "projection weights + biases"):
            values = {i: v / c["H"] for i, v in values.items()}
        return values

    _estimate_edit(mp, edit)


def rope_range(mp) -> None:
    """RoPE clamps positions to a cached table of 512 (positions beyond share its last angle)."""
    rope = _module("attnlab.positional.rope")
    original = rope.RoPE.forward

    def forward(self, x, positions=None, **kwargs):
        if isinstance(positions, torch.Tensor):
            positions = positions.clamp(max=511)
        return original(self, x, positions, **kwargs)

    mp.setattr(rope.RoPE, "forward", forward)


def window_tiles(mp) -> None:
    """A sliding window's block map skips no tile (every empty tile computed as partial)."""
    original = patterns.SlidingWindowMask.block_map

    def block_map(self, *args, **kwargs):
        codes = original(self, *args, **kwargs)
        return torch.where(codes == 0, torch.ones_like(codes), codes)

    mp.setattr(patterns.SlidingWindowMask, "block_map", block_map)


def concat_order(mp) -> None:
    """ConcatPositionalEncoding puts the positions first: ``[p; x]``."""
    from attnlab.positional import ConcatPositionalEncoding

    original = ConcatPositionalEncoding.forward

    def forward(self, x, positions=None):
        out = original(self, x, positions)
        return torch.cat([out[..., x.shape[-1] :], out[..., : x.shape[-1]]], -1)

    mp.setattr(ConcatPositionalEncoding, "forward", forward)


def full_width_heads(mp) -> None:
    """MultiHeadAttention does not split d_model: every head is d_model wide (head_dim = E,
    projections E → H·E)."""
    from attnlab import MultiHeadAttention

    init = MultiHeadAttention.__init__

    def full_width(self, *args, **kwargs):
        init(self, *args, **kwargs)
        E, H, H_kv = self.embed_dim, self.num_heads, self.num_kv_heads
        linear, bias = type(self.out_proj), self.out_proj.bias is not None
        self.head_dim = E
        if self.qkv_proj is not None:
            self.qkv_proj = linear(E, (H + 2 * H_kv) * E, bias=bias)
        else:
            self.q_proj = linear(E, H * E, bias=bias)
            self.k_proj = linear(self.kdim, H_kv * E, bias=bias)
            self.v_proj = linear(self.vdim, H_kv * E, bias=bias)
        self.out_proj = linear(H * E, E, bias=bias)

    mp.setattr(MultiHeadAttention, "__init__", full_width)


def attention_causal(mp) -> None:
    """``attention`` applies a causal mask when none is given."""
    import attnlab

    original = attnlab.attention

    def attention(*args, **kwargs):
        if kwargs.get("mask") is None:
            kwargs["mask"] = attnlab.masks.causal()
        return original(*args, **kwargs)

    mp.setattr(attnlab, "attention", attention)


def minilm_transposed(mp) -> None:
    """MiniLM.attentions returns each map transposed (keys × queries)."""
    from attnlab.models import MiniLM

    original = MiniLM.attentions

    def attentions(self, text):
        tokens, w = original(self, text)
        return tokens, w.transpose(-1, -2)

    mp.setattr(MiniLM, "attentions", attentions)


def _scaling_experiment(mp, scale, spread) -> None:
    """``scaling_experiment`` with the scaled logits ``raw · scale(d)`` and the variance columns
    ``spread(logits)``."""
    import attnlab.analysis

    experiments = _module("attnlab.analysis.experiments")

    def scaling_experiment(d_ks=(4, 16, 64, 256, 1024), samples=4096, keys=64, seed=0, device=None):
        g = torch.Generator().manual_seed(seed)
        rows = []
        for d in d_ks:
            q = torch.randn(samples, 1, d, generator=g, dtype=torch.float64).to(device)
            k = torch.randn(samples, keys, d, generator=g, dtype=torch.float64).to(device)
            raw = (q @ k.transpose(-1, -2)).squeeze(1)
            scaled = raw * scale(d)
            e_raw, j_raw = experiments._softmax_stats(raw)
            e_sc, j_sc = experiments._softmax_stats(scaled)
            rows.append([d, spread(raw), spread(scaled), e_raw, e_sc, j_raw, j_sc])
        names = ["d_k", "var q·k", "var q·k/√d_k", "entropy", "entropy scaled", "grad norm"]
        return experiments.ExperimentResult("Scaling", [*names, "grad norm scaled"], rows)

    mp.setattr(experiments, "scaling_experiment", scaling_experiment)
    mp.setattr(attnlab.analysis, "scaling_experiment", scaling_experiment)


def experiment_std(mp) -> None:
    """scaling_experiment's variance columns hold standard deviations."""
    _scaling_experiment(mp, lambda d: d**-0.5, lambda x: float(x.std()))


def experiment_scale(mp) -> None:
    """scaling_experiment scales its logits by 1/d_k instead of 1/√d_k."""
    _scaling_experiment(mp, lambda d: 1.0 / d, lambda x: float(x.var()))


def strided_far(mp) -> None:
    """A strided mask's far piece forgets its stride: every key beyond the local block."""

    def diagonals(self):
        s = self.stride
        pieces = [(-(s - 1), 0 if self.causal else s - 1, 1, 0), (None, -s, 1, 0)]
        return pieces if self.causal else [*pieces, (s, None, 1, 0)]

    mp.setattr(patterns.StridedMask, "diagonals", diagonals)


def complexity_path(mp) -> None:
    """complexity_table gives self-attention the recurrent layer's path length n."""
    costs = _module("attnlab.analysis.costs")
    original = costs.complexity_table

    def complexity_table(n, d, **kwargs):
        rows = original(n, d, **kwargs)
        return [{**r, "path": n} if r["layer"] == "self-attention" else r for r in rows]

    mp.setattr(costs, "complexity_table", complexity_table)


def dot_feature_map(mp) -> None:
    """The dot score prepares q and k with linear attention's feature map elu + 1."""
    dot = request.SCORES["dot"]
    elu1 = lambda x: torch.nn.functional.elu(x) + 1  # noqa: E731
    mp.setitem(request.SCORES, "dot", request.Score("dot", elu1, dot.default_scale))


def weights_head_axis(mp) -> None:
    """For 3-D inputs ``attention`` returns the weights with their head axis kept."""
    import attnlab

    original = attnlab.attention

    def attention(q, *args, **kwargs):
        res = original(q, *args, **kwargs)
        if q.dim() == 3 and kwargs.get("return_weights") and isinstance(res, tuple):
            return (res[0], res[1].unsqueeze(1), *res[2:])
        return res

    mp.setattr(attnlab, "attention", attention)


def query_key_widths(mp) -> None:
    """``attention`` accepts queries and keys of different widths (it zero-pads the narrower)."""
    import attnlab

    original = attnlab.attention

    def attention(q, k, *args, **kwargs):
        d = max(q.shape[-1], k.shape[-1])
        q = torch.nn.functional.pad(q, (0, d - q.shape[-1]))
        k = torch.nn.functional.pad(k, (0, d - k.shape[-1]))
        return original(q, k, *args, **kwargs)

    mp.setattr(attnlab, "attention", attention)


def naive_as_linear(mp) -> None:
    """estimate's naive score rows hold the linear-attention counts (implementations mixed up)."""

    def edit(name, values, c):
        if name in ("scores QKᵀ", "softmax", "weighted sum PV"):
            values["naive"] = values["linear"]
        return values

    _estimate_edit(mp, edit)


def softmax_width(mp) -> None:
    """estimate counts the softmax like the matmuls, per element and per head dimension."""

    def edit(name, values, c):
        if name == "softmax":
            values = {i: v * c["D"] for i, v in values.items()}
        return values

    _estimate_edit(mp, edit)


def sinusoid_rows(mp) -> None:
    """The sinusoidal table repeats its first row (positions indexed with a 0-d tensor that
    broadcasts): every position gets ``PE[0]``."""
    import attnlab.positional

    original = attnlab.positional.sinusoidal

    def sinusoidal(*args, **kwargs):
        t = original(*args, **kwargs)
        return t[..., :1, :].expand_as(t).clone()

    mp.setattr(attnlab.positional, "sinusoidal", sinusoidal)


def sinusoid_width(mp) -> None:
    """The sinusoidal module keeps only its table's first column (a slice ``[..., :1]`` for
    ``[..., :dim]``), so its output broadcasts against embeddings of any width."""
    emb = _module("attnlab.positional").SinusoidalEmbedding
    forward = emb.forward
    mp.setattr(emb, "forward", lambda self, *a, **k: forward(self, *a, **k)[..., :1])


def default_window(mp) -> None:
    """`attention` without a mask reads it as a local window (``|i − j| ≤ 1``): a default left
    over from a convolution-style layer."""
    import attnlab
    from attnlab import masks

    original = attnlab.attention

    def attention(*args, **kwargs):
        if kwargs.get("mask") is None:
            kwargs["mask"] = masks.sliding_window(2, causal=False)
        return original(*args, **kwargs)

    mp.setattr(attnlab, "attention", attention)


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
    "additive-cost": additive_concat,
    "additive-bias": additive_key_bias,
    "estimate-pairs": estimate_causal_half,
    "ffn": ffn_width,
    "kv-history": kv_history,
    "periods": sinusoid_periods,
    "exponent": sinusoid_exponent,
    "default-causal": default_causal,
    "window": window_width,
    "alibi": alibi_sign,
    "shaw": shaw_offsets,
    "learned": learned_range,
    "diversity": diversity_self,
    "output-norm": output_norm_axis,
    "query-softmax": query_softmax,
    "checkpointing": checkpoint_recompute,
    "noam": noam_scale,
    "span": span_ramp,
    "rope-layout": rope_layout,
    "rope-factor": rope_factor,
    "init": projection_init,
    "cosine": cosine_unnormalised,
    "stats-axis": stats_axis,
    "temperature": stats_temperature,
    "merge": merge_weights,
    "linear-state": linear_state,
    "flash-kept": flash_kept,
    "kept-layers": kept_layers,
    "score-width": score_width,
    "projection-count": projection_count,
    "rope-range": rope_range,
    "window-tiles": window_tiles,
    "concat": concat_order,
    "full-width": full_width_heads,
    "attention-causal": attention_causal,
    "minilm-transposed": minilm_transposed,
    "experiment-std": experiment_std,
    "experiment-scale": experiment_scale,
    "strided": strided_far,
    "complexity-path": complexity_path,
    "dot-feature-map": dot_feature_map,
    "weights-3d": weights_head_axis,
    "widths": query_key_widths,
    "naive-as-linear": naive_as_linear,
    "softmax-width": softmax_width,
    "sinusoid-rows": sinusoid_rows,
    "sinusoid-width": sinusoid_width,
    "default-window": default_window,
}
