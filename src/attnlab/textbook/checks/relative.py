"""Checks of learned and relative positions: learned embeddings, Shaw, T5, ALiBi, RoPE and its
long-context scalings (subjects ``learned``, ``shaw``, ``alibi``, ``rope``, ``rope-layout``,
``rope-range``, ``rope-factor``, ``concat``)."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ..core import Finding, check, fmt, judged, tiny
from ._shared import F64, _err, _found, _heads_seq, _qkv, _randn


@check("001-6.3-a")
def _fixed_vs_learned() -> Finding:
    from ... import LearnedPositionalEmbedding, SinusoidalEmbedding

    fixed = SinusoidalEmbedding(64)
    learned = LearnedPositionalEmbedding(512, 64)
    n_fixed = sum(p.numel() for p in fixed.parameters())
    n_learned = sum(p.numel() for p in learned.parameters())
    far = fixed(torch.tensor([600]))
    try:
        learned(torch.tensor([600]))
        refused = ""
    except ValueError as e:
        refused = str(e)
    ok = (
        n_fixed == 0 and n_learned == 512 * 64 and bool(torch.isfinite(far).all()) and bool(refused)
    )
    return Finding(
        computed=f"parameters: sinusoidal {n_fixed}, learned {n_learned:,}; position 600: "
        f"sinusoidal gives a code, learned raises ValueError ({refused[:60]}…)",
        call="SinusoidalEmbedding(64)(600); LearnedPositionalEmbedding(512, 64)(600)",
        **judged(ok, "the parameter counts or the extrapolation behaviour differ"),
    )


@check("002-8.2.3-a")
def _learned() -> Finding:
    from ...positional import LearnedPositionalEmbedding

    emb = LearnedPositionalEmbedding(512, 64)
    n = sum(p.numel() for p in emb.parameters())
    try:
        emb(torch.tensor([512]))
        refused = "no error"
    except ValueError as e:
        refused = f"ValueError: {e}"
    ok = n == 512 * 64 and refused.startswith("ValueError")
    return _found(
        f"{n:,} parameters (= 512·64); position 512 → {refused}",
        "LearnedPositionalEmbedding(512, 64); emb(torch.tensor([512]))",
        ok,
        "the learned table's size or its length limit differ",
    )


@check("002-8.2.4-a")
def _shaw_key_term() -> Finding:
    from ...functional.reference import shaw_attention as shaw_reference
    from ...positional import shaw_attention

    q, k, v = _qkv(H=1, D=4)
    n = 8
    r = _randn(2 * n - 1, 4, seed=9)  # r_{i−j}, offsets −(n−1) … n−1
    off = torch.arange(n)[:, None] - torch.arange(n)[None, :] + n - 1
    e = q @ k.transpose(-1, -2) + torch.einsum("bhid,ijd->bhij", q, r[off])  # the text's e_ij
    rel_v = torch.zeros(2 * n - 1, 4, dtype=F64)
    out = shaw_attention(q, k, v, r.flip(0), rel_v, scale=1.0)
    ref, _ = shaw_reference(q, k, v, r.flip(0), rel_v, scale=1.0)
    err = float((out - torch.softmax(e, -1) @ v).abs().max())
    err_ref = float((ref - torch.softmax(e, -1) @ v).abs().max())
    return _found(
        "max |shaw_attention(q, k, v, a^K = r flipped, a^V = 0, scale=1) − "
        f"softmax(q_i·k_j + q_i·r_(i−j))V| = {_err(err)} (reference: {_err(err_ref)})",
        "shaw_attention(q, k, v, r.flip(0), zeros, scale=1.0)",
        err < 1e-12 and err_ref < 1e-12,
        "the relative-key score is not reproduced",
    )


@check("002-8.2.4-c")
def _relative_advantages() -> Finding:
    from ...positional import ALiBi, T5RelativeBias

    alibi = ALiBi(4)
    a = alibi.matrix(32).to(F64)
    row = a[:, -1, :]  # last query: keys at distance 31 … 0
    decreasing = bool((row[:, 1:] > row[:, :-1]).all())
    shift = float((a[:, 1:, 1:] - a[:, :-1, :-1]).abs().max())
    torch.manual_seed(0)
    t5 = T5RelativeBias(2).double()
    small, large = t5.matrix(16).detach(), t5.matrix(1024).detach()
    same = float((large[:, :16, :16] - small).abs().max())
    ok = decreasing and shift == 0 and same == 0
    return _found(
        f"ALiBi: bias strictly increasing toward the query ({decreasing}), shift-invariant "
        f"(max diagonal change {_err(shift)}); T5: one {tuple(t5.weight.shape)} table serves "
        f"n=16 and n=1024 (max difference on the shared block {_err(same)})",
        "ALiBi(4).matrix(32); T5RelativeBias(2).matrix(16), .matrix(1024)",
        ok,
        "the relative biases lack one of the three properties",
    )


@check("002-8.2.4-d")
def _rope_relative() -> Finding:
    from ...positional import RoPE

    rope = RoPE(16)
    q, k = _randn(1, 1, 1, 16, seed=1), _randn(1, 1, 1, 16, seed=2)

    def score(i: int, j: int) -> float:
        return float((rope(q, torch.tensor([i])) * rope(k, torch.tensor([j]))).sum())

    ref = float((q * rope(k, torch.tensor([7]))).sum())  # qᵀ R_7 k (R_0 = I)
    got = [score(3, 10), score(50, 57), score(1000, 1007)]
    err = max(abs(g - ref) for g in got)
    return _found(
        f"scores at (3,10), (50,57), (1000,1007): {', '.join(fmt(g, 10) for g in got)}; "
        f"qᵀR_7k = {fmt(ref, 10)}",
        "rope = RoPE(16); (rope(q, [i]) * rope(k, [j])).sum()",
        err < 1e-9,
        "the RoPE score depends on the absolute positions",
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


@check("002-ex8.5-a")
def _ex85() -> Finding:
    from ...positional import RoPE

    rope = RoPE(32, interleaved=True)
    w = rope.inv_freq.to(F64)
    want = 10000.0 ** (-torch.arange(0, 32, 2, dtype=F64) / 32)
    freq_err = float((w - want).abs().max())

    def rot(a: float) -> Tensor:
        c, s = math.cos(a), math.sin(a)
        return torch.tensor([[c, -s], [s, c]], dtype=F64)

    om = float(w[3])
    group = float((rot(11 * om).T @ rot(4 * om) - rot(-7 * om)).abs().max())
    q, k = _randn(1, 1, 1, 32, seed=1), _randn(1, 1, 1, 32, seed=2)
    s1 = float((rope(q, torch.tensor([11])) * rope(k, torch.tensor([4]))).sum())
    s2 = float((rope(q, torch.tensor([111])) * rope(k, torch.tensor([104]))).sum())
    return _found(
        f"max |ω_i − 10000^(−2i/d)| = {_err(freq_err)}; max |R_mᵀR_n − R_(n−m)| = {_err(group)}; "
        f"scores at (11, 4) and (111, 104): {fmt(s1, 10)}, {fmt(s2, 10)}",
        "RoPE(32, interleaved=True).inv_freq; rope(q, [m]) · rope(k, [n])",
        freq_err < 1e-15 and group < 1e-12 and abs(s1 - s2) < 1e-9,
        "the rotation algebra or the frequencies differ",
    )


@check("002-ex8.5-b")
def _ex85_planes() -> Finding:
    from ...positional import RoPE

    rope = RoPE(16, interleaved=True)
    x = _randn(1, 1, 1, 16, seed=3)
    got = rope(x, torch.tensor([5]))[0, 0, 0]
    blocks = []
    for i, w in enumerate(rope.inv_freq.to(F64).tolist()):
        a = 5 * w
        r = torch.tensor([[math.cos(a), -math.sin(a)], [math.sin(a), math.cos(a)]], dtype=F64)
        blocks.append(r @ x[0, 0, 0, 2 * i : 2 * i + 2])
    err = float((got - torch.cat(blocks)).abs().max())
    return _found(
        f"8 planes, frequencies {fmt(rope.inv_freq[0].item())} … {fmt(rope.inv_freq[-1].item())}; "
        f"max |RoPE(x, 5) − blockdiag(R_(5ω_i)) x| = {_err(err)}",
        "RoPE(16, interleaved=True)(x, torch.tensor([5]))",
        err < 1e-12,
        "RoPE is not a rotation per plane",
    )


@check("003-3.2-c")
def _concat_positions() -> Finding:
    from ... import SinusoidalEmbedding, attention
    from ...positional import ConcatPositionalEncoding

    x = _heads_seq(32, 16, seed=4)[0]  # (1, 32, 16)
    cat = ConcatPositionalEncoding(SinusoidalEmbedding(64, dtype=torch.float64))
    xp = cat(x)  # (1, 32, 80)
    p = xp[0, :, 16:]
    logits = xp[0] @ xp[0].T
    split = float((logits - (x[0] @ x[0].T + p @ p.T)).abs().max())
    pp = p @ p.T  # (32, 32), a function of i − j
    row = pp[16]
    local = bool(row.argmax() == 16) and bool((row[16:20].diff() < 0).all())
    _, w = attention(xp, xp, xp, scale=1.0, return_weights=True)
    ok = split < 1e-12 and local and tuple(w.shape) == (1, 32, 32)
    return Finding(
        computed=f"[x; p]·[x; p] − (x·x + p·p) = {tiny(split)}; p_16·p_j = "
        + ", ".join(f"{float(v):.2f}" for v in row[16:20])
        + " for j = 16…19 (largest at j = i, falling with the offset)",
        call="ConcatPositionalEncoding(SinusoidalEmbedding(64))(x); p @ p.T",
        **judged(ok, "the concatenated positions do not add a local term"),
    )
