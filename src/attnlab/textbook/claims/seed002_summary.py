"""Seed 002, §8.5–8.7: history, long contexts and the summary.

The checks of claims whose metadata is in ``claims/seed002.toml``.
"""

from __future__ import annotations

import math

import torch

from ..core import (
    AGREES,
    NOT_CHECKABLE,
    Finding,
    check,
    fmt,
)
from .seed002 import F64, _err, _found, _mha, _mha_parts, _qkv, _randn, _softmax_ref
from .seed002_costs import _est
from .seed002_positions import _sinusoidal_extrapolates


# ------------------------------------------------------------------------------ 8.5 – 8.7
@check("002-8.5-a")
def _history() -> Finding:
    return Finding(
        "nothing computed",
        "—",
        NOT_CHECKABLE,
        "a historical fact (authors, year, page count of the paper)",
    )


@check("002-8.6-a")
def _flash_blocks() -> Finding:
    from ... import attention, attention_weights

    q, k, v = _qkv(L=200, D=16)
    _, lse = attention(q, k, v, backend="flash", return_lse=True)
    w = attention_weights(q, k, lse, rows=[0, 199])
    p = torch.softmax(q @ k.transpose(-1, -2) / 4, -1)[:, :, [0, 199]]
    err = float((w - p).abs().max())
    naive = _est(8192).value("score matrix", "naive")
    tile = _est(8192).value("score matrix", "flash")
    return _found(
        f"weights of rows 0 and 199 from the lse match P to {_err(err)}; scores held at n=8192: "
        f"{fmt(naive / 2**20)} MiB naive vs {fmt(tile / 2**20)} MiB in 128×128 tiles",
        "attention(q, k, v, backend='flash', return_lse=True); attention_weights(q, k, lse, "
        "rows=[0, 199]); estimate(8192, 768, 12)",
        err < 1e-12 and tile * 100 < naive,
        "the tiled form needs the full matrices",
    )


@check("002-8.6-b")
def _gpu_numbers() -> Finding:
    return Finding(
        "nothing computed",
        "—",
        NOT_CHECKABLE,
        "a GPU (A100 memory sizes and bandwidths, and a GPU speed-up measurement)",
    )


@check("002-8.6-c")
def _flash_variants() -> Finding:
    from ... import attention, masks

    q = _randn(1, 8, 150, 16, seed=1)
    k, v = _randn(1, 2, 150, 16, seed=2), _randn(1, 2, 150, 16, seed=3)
    out = attention(q, k, v, mask=masks.causal(), backend="flash")
    kk, vv = k.repeat_interleave(4, 1), v.repeat_interleave(4, 1)
    s = q @ kk.transpose(-1, -2) / 4
    s = s.masked_fill(~torch.ones(150, 150, dtype=torch.bool).tril(), float("-inf"))
    err = float((out - torch.softmax(s, -1) @ vv).abs().max())
    return _found(
        f"causal GQA (8 query / 2 KV heads) on the flash backend: max |Δ| vs dense = {_err(err)}",
        "attention(q, k, v, mask=masks.causal(), backend='flash') with k, v of 2 heads",
        err < 1e-12,
        "the tiled backend does not support causal GQA exactly",
    )


@check("002-8.6-d")
def _rope_linear() -> Finding:
    from ...positional import RoPE

    base, scaled = RoPE(64), RoPE(64, scaling={"rope_type": "linear", "factor": 16.0})
    x = _randn(1, 1, 1, 64, seed=1)
    err = max(
        float((scaled(x, torch.tensor([16 * p])) - base(x, torch.tensor([p]))).abs().max())
        for p in (1, 100, 2047)
    )
    return _found(
        f"rotation at position 16·p (scaled) vs p (original), p ∈ {{1, 100, 2047}}: max |Δ| = "
        f"{_err(err)}; position 32,767 maps inside the original 2K range",
        "RoPE(64, scaling={'rope_type': 'linear', 'factor': 16.0})(x, [16 * p]) vs RoPE(64)(x, "
        "[p])",
        err < 1e-9,
        "linear scaling does not map 32K positions onto the 2K range",
    )


@check("002-8.6-e")
def _rope_ntk_yarn() -> Finding:
    from ...positional import compute_rope_parameters

    plain, _ = compute_rope_parameters(None, 64, 10000.0)
    ntk, _ = compute_rope_parameters({"rope_type": "ntk", "factor": 16.0}, 64, 10000.0)
    yarn, _ = compute_rope_parameters(
        {"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 2048},
        64,
        10000.0,
    )
    ntk_hi, ntk_lo = float(ntk[0] / plain[0]), float(plain[-1] / ntk[-1])
    y_hi, y_lo = float(yarn[0] / plain[0]), float(plain[-1] / yarn[-1])
    ok = abs(ntk_hi - 1) < 1e-12 and abs(ntk_lo - 16) < 1e-9 and abs(y_hi - 1) < 1e-12
    ok = ok and abs(y_lo - 16) < 1e-9
    return _found(
        f"NTK: highest frequency ×{fmt(ntk_hi)}, lowest ÷{fmt(ntk_lo)} (a new base); YaRN: "
        f"highest ×{fmt(y_hi)} (extrapolated), lowest ÷{fmt(y_lo)} (interpolated)",
        "compute_rope_parameters({'rope_type': 'ntk' / 'yarn', 'factor': 16.0, …}, 64, 10000.0)",
        ok,
        "the scalings do not treat high and low frequencies as described",
    )


@check("002-8.6-f")
def _sliding_window() -> Finding:
    from ... import masks

    a = masks.sliding_window(4).to_dense(64, 64)[0, 0].to(F64)
    reach, r = [], torch.eye(64, dtype=F64)
    for _ in range(4):
        r = ((r @ a) > 0).to(F64)
        reach.append(int(r[-1].sum()))
    pairs = {
        n: _est(n, 4096, 32, mask=masks.sliding_window(4096)).value(
            "attended pairs per head", "flash"
        )
        for n in (16384, 32768)
    }
    ratio = pairs[32768] / pairs[16384]
    ok = reach == [4, 7, 10, 13] and 2 <= ratio < 2.2
    return _found(
        f"last token's reach after 1–4 layers: {reach} tokens (= L·(W−1)+1); attended pairs "
        f"×{fmt(ratio, 4)} from n=16K to 32K",
        "masks.sliding_window(4).to_dense(64, 64); "
        "estimate(n, 4096, 32, mask=masks.sliding_window(4096))",
        ok,
        "the window's reach or cost do not behave as described",
    )


@check("002-8.6-g")
def _ring() -> Finding:
    from ... import attention, merge_partials

    q, k, v = _qkv(L=64)
    parts = [
        attention(q, k[:, :, s : s + 16], v[:, :, s : s + 16], return_lse=True)
        for s in range(0, 64, 16)
    ]
    out, _ = merge_partials([p[0] for p in parts], [p[1] for p in parts])
    err = float((out - _softmax_ref(q, k, v)).abs().max())
    return _found(
        f"merge of 4 KV-block partials vs full attention: max |Δ| = {_err(err)}",
        "merge_partials([attention(q, k_b, v_b, return_lse=True)…])",
        err < 1e-12,
        "merging the ring's partial results is not exact",
    )


@check("002-8.6-h")
def _streaming() -> Finding:
    from ... import KVCache, masks

    mha = _mha(16, 4)
    x = _randn(1, 10, 16, seed=2)
    cache = KVCache()
    outs = [mha(x[:, :6], mask=masks.causal(), cache=cache)]
    outs += [mha(x[:, t : t + 1], mask=masks.causal(), cache=cache) for t in range(6, 10)]
    err = float((torch.cat(outs, 1) - mha(x, mask=masks.causal())).abs().max())
    return _found(
        f"prefill + 4 cached steps vs one full call: max |Δ| = {_err(err)}; cache holds "
        f"{len(cache)} tokens",
        "mha(x_t, mask=masks.causal(), cache=KVCache())",
        err < 1e-12 and len(cache) == 10,
        "cached incremental decoding differs from the full computation",
    )


@check("002-8.7-b")
def _summary_cost() -> Finding:
    t = {n: _est(n).value("total", "naive") for n in (1024, 4096)}
    t_ok = all(v == 8 * n * 768**2 + 4 * n * n * 768 + 60 * n * n for n, v in t.items())
    m1 = _est(4096).value("activations kept for backward", "naive")
    m12 = _est(4096, layers=12).value("activations kept for backward", "naive")
    share = 12 * 4096**2 * 4 / m1
    return _found(
        f"FLOPs {fmt(t[1024])} at n=1024, {fmt(t[4096])} at 4096 (8nd² + 4n²d + 5hn²); kept "
        f"activations ×{fmt(m12 / m1)} for 12 layers, {fmt(100 * share, 3)} % of it n²·h",
        "estimate(n, 768, 12, layers=L).value('total' / 'activations kept for backward', 'naive')",
        t_ok and m12 == 12 * m1 and share > 0.9,
        "the totals do not follow O(n²d + nd²) and O(n²hL)",
    )


@check("002-8.7-c")
def _typical_heads() -> Finding:
    from ...modules import MultiHeadAttention

    dims = {h: MultiHeadAttention(1024, h).head_dim for h in (4, 8, 16, 32)}
    cfg = {h: _est(128, 1024, h).config["D"] for h in (4, 8, 16, 32)}
    return _found(
        "d_k = " + ", ".join(f"{d} (h={h})" for h, d in dims.items()),
        "MultiHeadAttention(1024, h).head_dim; estimate(128, 1024, h).config['D']",
        all(d == 1024 // h == cfg[h] for h, d in dims.items()),
        "d_k is not d_model/h",
    )


@check("002-8.7-d")
def _params_heads() -> Finding:
    base = _est(128, 768, 12, bias=False).value("projection weights", "naive")
    best = min(
        range(13, 30),
        key=lambda h: abs(
            _est(128, 64 * h, h, bias=False).value("projection weights", "naive") / base - 2
        ),
    )
    ratio = _est(128, 64 * best, best, bias=False).value("projection weights", "naive") / base
    return _found(
        f"h=12 → h={best}: parameters ×{fmt(ratio, 4)}, heads ×{fmt(best / 12, 3)} "
        f"(exactly √2 = {fmt(math.sqrt(2), 4)} in the continuum)",
        "estimate(128, 64 * h, h, bias=False).value('projection weights', 'naive')",
        abs(best / 12 - 1.4) < 0.05 and abs(ratio - 2) < 0.1,
        "doubling the parameters does not mean ~1.4× the heads",
    )


# ------------------------------------------------------------------------ more of 8.2–8.7
@check("002-8.2.2-g")
def _pe_scales() -> Finding:
    from ...positional import sinusoidal

    pe = sinusoidal(4096, 64, dtype=F64)
    hi, lo = pe[:, 0:2], pe[:, 62:64]
    # High frequency: positions 44 apart (≈ 7 periods of 2π) look alike; neighbours differ.
    alias = float((hi[44:] - hi[:-44]).norm(dim=-1).max())
    near = float((hi[1:] - hi[:-1]).norm(dim=-1).min())
    # Low frequency: the angle grows monotonically over the whole range (a global coordinate).
    angle = torch.atan2(lo[:, 0], lo[:, 1])
    mono = bool((angle[1:] > angle[:-1]).all())
    ok = alias < 0.05 and near > 0.9 and mono
    return _found(
        f"dims 0–1: positions p and p+44 differ by at most {fmt(alias)}, neighbours by at least "
        f"{fmt(near)}; dims 62–63: angle strictly increasing over 0–4095: {mono}",
        "pe = sinusoidal(4096, 64); norms of pe[p + 44, :2] − pe[p, :2]; atan2 of pe[:, 62:64]",
        ok,
        "the frequency bands do not split into local and global position information",
    )


@check("002-8.3.1-c")
def _param_shapes() -> Finding:
    mha = _mha(512, 8)
    wq, wk, wv, wo = _mha_parts(mha)
    per_head = [tuple(w[:64].T.shape) for w in (wq, wk, wv)]
    ok = per_head == [(512, 64)] * 3 and tuple(wo.T.shape) == (512, 512) and mha.head_dim == 64
    return _found(
        f"W_i^Q, W_i^K, W_i^V (transposed head slices): {per_head}; W^O (transposed): "
        f"{tuple(wo.T.shape)} = (h·d_v, d_model)",
        "MultiHeadAttention(512, 8): qkv_proj.weight split per head, out_proj.weight",
        ok,
        "the projection shapes differ",
    )


@check("002-8.3.4-e")
def _pruning() -> Finding:
    from ...analysis import head_importance

    mha = _mha(16, 4)
    x, target = _randn(2, 6, 16, seed=1), _randn(2, 6, 16, seed=2)

    def loss_fn(m, batch):
        return ((m(batch[0]) - batch[1]) ** 2).sum()

    imp = head_importance(mha, (x, target), loss_fn, ablation=True)["ablation"][0]
    base = float(loss_fn(mha, (x, target)))
    pruned = []
    for h in range(4):
        m = _mha(16, 4)
        m.prune_heads([h])
        with torch.no_grad():
            pruned.append(float(loss_fn(m, (x, target))) - base)
    err = max(abs(float(a) - b) for a, b in zip(imp, pruned, strict=True))
    order = [int(i) for i in imp.argsort(descending=True)]
    return _found(
        "loss increase per pruned head: "
        + ", ".join(fmt(b) for b in pruned)
        + f"; head_importance ablation matches to {_err(err, 1e-9)}; ranking {order}",
        "head_importance(mha, (x, t), loss_fn, ablation=True); mha.prune_heads([h])",
        err < 1e-9,
        "the gated ablation does not equal pruning the head",
    )


@check("002-8.4.2-e")
def _checkpointing() -> Finding:
    from ...models import GPT, TransformerConfig

    idx = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    grads, calls = {}, {}
    for ckpt in (False, True):
        torch.manual_seed(0)
        cfg = TransformerConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, max_seq_len=16)
        model = GPT(cfg).double().train()
        model.gradient_checkpointing = ckpt
        count = [0]
        for blk in model.blocks:
            blk.register_forward_pre_hook(lambda *_, c=count: c.__setitem__(0, c[0] + 1))
        model(idx).sum().backward()
        grads[ckpt] = torch.cat([p.grad.flatten() for p in model.parameters()])
        calls[ckpt] = count[0]
    err = float((grads[True] - grads[False]).abs().max())
    return _found(
        f"block forwards: {calls[False]} without, {calls[True]} with checkpointing "
        f"(recomputed in backward); max |Δ grad| = {_err(err)}",
        "GPT(cfg).gradient_checkpointing = True; forward pre-hooks on model.blocks",
        err < 1e-12 and calls[True] == 2 * calls[False],
        "checkpointing does not recompute or changes the gradients",
    )


@check("002-8.7-g")
def _summary_sinusoidal() -> Finding:
    a, b = _sinusoidal_extrapolates(), _pe_scales()
    both = a.verdict == AGREES and b.verdict == AGREES
    return _found(
        f"{a.computed}; {b.computed}",
        f"{a.call}; {b.call}",
        both,
        "the encoding fails beyond the training length or lacks the scales",
    )
