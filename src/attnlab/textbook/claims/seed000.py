"""Seed 000 — 13.2 自注意力机制的数学推导 (the mathematics of self-attention)."""

from __future__ import annotations

import torch

from ..core import AGREES, TEXT_ERROR, Finding, claim, fmt


@claim(
    "000-scale-a",
    section="为什么需要缩放因子",
    quote="Var[q · k] = Var[Σᵢ qᵢkᵢ] = Σᵢ Var[qᵢkᵢ] = dₖ × Var[q₁]Var[k₁] = dₖ",
    paraphrase="For q, k with i.i.d. zero-mean unit-variance entries, Var[q·k] = d_k; dividing "
    "by √d_k brings it back to 1.",
    api="attnlab.functional.scores.get_score('dot') (the score and its default scale)",
    expected=AGREES,
    assumptions="q, k ~ N(0, 1) i.i.d., 20,000 pairs per d_k, float64, seed 0; agreement "
    "within 5 % (the standard error of a sample variance is about √(2/n) = 1 %)",
)
def _variance() -> Finding:
    from ...functional.scores import get_score

    dot = get_score("dot")
    g = torch.Generator().manual_seed(0)
    parts, ok = [], True
    for d in (64, 512):
        q = torch.randn(20_000, d, generator=g, dtype=torch.float64)
        k = torch.randn(20_000, d, generator=g, dtype=torch.float64)
        raw = (dot.prepare(q) * dot.prepare(k)).sum(-1)  # q·k, one per pair
        scaled = raw * dot.default_scale(d)  # q·k / √d_k
        vr, vs = float(raw.var()), float(scaled.var())
        ok &= abs(vr / d - 1) < 0.05 and abs(vs - 1) < 0.05
        parts.append(f"d_k={d}: Var[q·k]={fmt(vr)}, Var[q·k/√d_k]={fmt(vs)}")
    return Finding(
        computed="; ".join(parts),
        call="s = get_score('dot'); raw = (s.prepare(q) * s.prepare(k)).sum(-1); "
        "(raw * s.default_scale(d)).var()",
        verdict=AGREES if ok else TEXT_ERROR,
        explanation="" if ok else "the sample variances do not match d_k and 1",
    )


@claim(
    "000-scale-b",
    section="为什么需要缩放因子",
    quote="softmax([0.1, 0.2, 10.0]) ≈ [0.0000, 0.0000, 1.0000]",
    paraphrase="A large logit saturates softmax: [0.1, 0.2, 10.0] gives about [0, 0, 1] "
    "(printed with four decimals).",
    api="attnlab.attention (its weights), torch.softmax",
    expected=TEXT_ERROR,
    assumptions="float64; rounding to four decimals as printed",
)
def _saturation() -> Finding:
    p = torch.softmax(torch.tensor([0.1, 0.2, 10.0], dtype=torch.float64), dim=0)
    shown = [f"{x:.4f}" for x in p.tolist()]
    exact = [f"{x:.3e}" for x in p.tolist()]
    agrees = shown == ["0.0000", "0.0000", "1.0000"]
    return Finding(
        computed=f"softmax = [{', '.join(exact)}], to four decimals [{', '.join(shown)}]",
        call="torch.softmax(torch.tensor([0.1, 0.2, 10.0], dtype=torch.float64), 0)",
        verdict=AGREES if agrees else TEXT_ERROR,
        explanation=""
        if agrees
        else "the small weights are 5.0e-5 and 5.5e-5, which round to 0.0001 and the largest to "
        "0.9999 at four decimals; the saturation point itself stands",
    )


@claim(
    "000-space-a",
    section="空间复杂度分析",
    quote="| 128 | 128×128 | 64 KB | … | 16384 | 16384×16384 | 1 GB |",
    paraphrase="The float32 attention matrix of one head takes 64 KB at n=128, 1 MB at 512, "
    "4 MB at 1024, 64 MB at 4096 and 1 GB at 16384 (binary units).",
    api="attnlab.analysis.estimate (row 'score matrix')",
    expected=AGREES,
    assumptions="one head, batch 1, float32, KB/MB/GB read as KiB/MiB/GiB",
)
def _matrix_memory() -> Finding:
    from ...analysis import estimate

    table = {128: 64 * 2**10, 512: 2**20, 1024: 4 * 2**20, 4096: 64 * 2**20, 16384: 2**30}
    got, ok = [], True
    for n, want in table.items():
        nbytes = estimate(n, 64, 1, dtype="float32").value("score matrix", "naive")
        ok &= nbytes == want
        got.append(f"n={n}: {int(nbytes):,} B")
    return Finding(
        computed="; ".join(got),
        call="estimate(n, 64, 1, dtype='float32').value('score matrix', 'naive')",
        verdict=AGREES if ok else TEXT_ERROR,
        explanation="" if ok else "the byte counts differ from the table",
    )
