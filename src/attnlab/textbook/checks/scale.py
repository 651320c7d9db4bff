"""Checks of the scaled dot-product formula and its 1/√d_k: the variance of q·k, saturation, the
worked examples and code samples that compute softmax(QKᵀ/√d_k)V (subjects ``scale``,
``experiment-std``, ``experiment-scale``, ``stats-axis``, ``init``)."""

from __future__ import annotations

import math

import torch

from .. import derivations as ind
from ..core import Derivation, Finding, check, fmt, judged, tiny
from ._shared import (
    _DKS,
    _SCALING_CALL,
    F64,
    _close,
    _err,
    _found,
    _gen,
    _heads_seq,
    _mha,
    _mha_eval,
    _mha_parts,
    _qkv,
    _qkv_nm,
    _randn,
    _randn_from,
    _scaling,
    _seq,
    _softmax_ref,
    _verdict,
)


@check("000-scale-a")
def _variance() -> Finding:
    from ...functional.request import get_score

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
        **judged(ok, "the sample variances do not match d_k and 1"),
    )


@check("000-scale-b")
def _saturation() -> Finding:
    from ... import attention

    logits = [0.1, 0.2, 10.0]
    q = torch.tensor([2.0, 0, 0, 0], dtype=torch.float64).view(1, 1, 1, 4)
    k = torch.zeros(1, 1, 3, 4, dtype=torch.float64)
    k[0, 0, :, 0] = torch.tensor(logits, dtype=torch.float64)  # q·k/√4 = the logits
    _, w = attention(q, k, k, return_weights=True)
    p = w[0, 0, 0].tolist()
    shown = [f"{x:.4f}" for x in p]
    exact = [f"{x:.3e}" for x in p]
    agrees = shown == ["0.0000", "0.0000", "1.0000"]
    closed = ind.softmax(logits)
    return Finding(
        computed=f"softmax = [{', '.join(exact)}], to four decimals [{', '.join(shown)}]",
        call="attention(q, k, v, return_weights=True) with q·k/√4 = [0.1, 0.2, 10.0]",
        **judged(
            agrees,
            f"the small weights are {p[0]:.1e} and {p[1]:.1e}, which round to "
            f"{p[0]:.4f} and {p[1]:.4f} and the largest to {p[2]:.4f} at four decimals; the "
            "saturation point itself stands",
            Derivation(
                ind.close(p, closed),
                "closed form e^x / Σe^x of [0.1, 0.2, 10.0] = ["
                + ", ".join(f"{x:.3e}" for x in closed)
                + "]",
            ),
        ),
    )


@check("000-def-a")
def _definition() -> Finding:
    from ... import attention

    q, k, v = _qkv_nm(5, 7, 4, 3)
    out = attention(q, k, v)
    formula = torch.softmax(q @ k.transpose(-1, -2) / 4**0.5, dim=-1) @ v
    err = float((out - formula).abs().max())
    ok = tuple(out.shape[-2:]) == (5, 3) and err < 1e-12
    return Finding(
        computed=f"output shape {tuple(out.shape[-2:])}; max |attention − formula| = {tiny(err)}",
        call="attention(q, k, v) vs torch.softmax(q @ k.mT / √d_k, -1) @ v",
        **judged(ok, "attnlab's attention differs from the formula"),
    )


@check("000-scale-c")
def _ranges() -> Finding:
    from ...functional.request import get_score

    dot = get_score("dot")
    g = torch.Generator().manual_seed(2)
    parts, ok = [], True
    for d, raw_text, scaled_text in ((64, 25.0, 3.1), (512, 72.0, 3.2)):
        q = torch.randn(20_000, d, generator=g, dtype=torch.float64)
        k = torch.randn(20_000, d, generator=g, dtype=torch.float64)
        raw = (dot.prepare(q) * dot.prepare(k)).sum(-1)
        scaled = raw * dot.default_scale(d)
        r, s = (float(x.abs().quantile(0.998)) for x in (raw, scaled))
        ok &= abs(r / raw_text - 1) < 0.05 and abs(s / scaled_text - 1) < 0.05
        parts.append(f"d_k={d}: 99.8 % of |q·k| ≤ {fmt(r, 3)}, of |q·k/√d_k| ≤ {fmt(s, 3)}")
    return Finding(
        computed="; ".join(parts),
        call="(s.prepare(q) * s.prepare(k)).sum(-1).abs().quantile(0.998)",
        **judged(ok, "the observed ranges differ from the text's by more than 5 %"),
    )


@check("001-1.2-a")
def _self_attention() -> Finding:
    mha = _mha_eval(6, 1, seed=0)
    x = _seq(4, 6, seed=0)
    (wq, bq), (wk, bk), (wv, bv) = mha.projection_weights()
    q, k, v = x @ wq.T + bq, x @ wk.T + bk, x @ wv.T + bv  # (1, 4, 6) each
    a = torch.softmax(q @ k.mT / 6**0.5, dim=-1)  # (1, 4, 4)
    want = mha.out_proj(a @ v)
    with torch.no_grad():
        got = mha(x)
        err = float((got - want).abs().max())
    ok = err < 1e-12 and tuple(a.shape[-2:]) == (4, 4) and tuple(got.shape[-2:]) == (4, 6)
    return Finding(
        computed=f"S and A are {tuple(a.shape[-2:])}, the output {tuple(got.shape[-2:])}; "
        f"max |module − formula| = {tiny(err)}",
        call="MultiHeadAttention(6, 1)(x) vs W_O(softmax(XW_Q (XW_K)ᵀ/√6) XW_V)",
        **judged(ok, "the module differs from the formula"),
    )


@check("002-8.1.3-b")
def _sdpa_formula() -> Finding:
    from ... import attention

    q, k, v = _qkv()
    ref = _softmax_ref(q, k, v)
    errs = {
        b: float((attention(q, k, v, backend=b) - ref).abs().max())
        for b in ("reference", "sdpa", "flash")
    }
    return _found(
        "max |attention − softmax(QKᵀ/√d_k)V|: "
        + ", ".join(f"{b} {_err(e)}" for b, e in errs.items()),
        "attention(q, k, v, backend=b) vs torch.softmax(q @ k.mT / d**0.5, -1) @ v",
        max(errs.values()) < 1e-12,
        "attention differs from softmax(QKᵀ/√d_k)V",
    )


@check("002-8.1.3-c", "002-8.7-f")
def _scaled_var() -> Finding:
    from ...analysis import scaling_experiment
    from ...functional.request import get_score

    r = scaling_experiment(d_ks=(16, 128, 512), samples=512, keys=16, seed=0)
    var, ent = r.column("var q·k/√d_k"), r.column("entropy scaled")
    raw_ent = r.column("entropy")
    default = get_score("dot").default_scale(256)
    ok = (
        all(abs(v - 1) < 0.06 for v in var)
        and max(ent) - min(ent) < 0.05
        and raw_ent[-1] < 0.5 * ent[-1]
        and abs(default - 1 / 16) < 1e-15
    )
    return _found(
        "scaled Var = "
        + ", ".join(fmt(v) for v in var)
        + "; softmax entropy scaled "
        + ", ".join(fmt(e) for e in ent)
        + " vs unscaled "
        + ", ".join(fmt(e) for e in raw_ent)
        + f" nats (d_k = 16, 128, 512); attnlab's default scale at d_k=256 = {fmt(default)}",
        "scaling_experiment(d_ks=(16, 128, 512), samples=512, keys=16); "
        "get_score('dot').default_scale(256)",
        ok,
        "the scaled logits do not keep unit variance or the softmax still saturates",
    )


@check("002-8.1.3-d")
def _saturation_grad() -> Finding:
    from ...analysis import scaling_experiment

    r = scaling_experiment(d_ks=(4, 64, 512), samples=512, keys=16, seed=0)
    raw, sc = r.column("grad norm"), r.column("grad norm scaled")
    ok = raw[0] > raw[1] > raw[2] and raw[2] < 0.5 * sc[2]
    return _found(
        "‖J‖_F unscaled "
        + ", ".join(fmt(x) for x in raw)
        + " vs scaled "
        + ", ".join(fmt(x) for x in sc)
        + " at d_k = 4, 64, 512",
        "scaling_experiment(d_ks=(4, 64, 512), samples=512, keys=16).column('grad norm')",
        ok,
        "the softmax gradient does not shrink as the unscaled logit variance grows",
    )


@check("002-8.1.3-e")
def _pipeline() -> Finding:
    mha = _mha(8, 1, bias=False)
    x = _randn(1, 6, 8, seed=1)
    wq, wk, wv, wo = _mha_parts(mha)
    q, k, v = x @ wq.T, x @ wk.T, x @ wv.T
    a = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(8), -1)
    y = (a @ v) @ wo.T
    err = float((mha(x) - y).abs().max())
    return _found(
        f"max |MultiHeadAttention(x) − (softmax(QKᵀ/√d_k)V)W_o| = {_err(err)}",
        "MultiHeadAttention(8, 1, bias=False)(x) vs the step-by-step pipeline",
        err < 1e-12,
        "the module's forward differs from the pipeline",
    )


@check("002-8.9-c")
def _scale_snippet() -> Finding:
    from ... import attention

    q, k, v = _qkv()
    _, w = attention(q, k, v, return_weights=True)
    snippet = torch.softmax(torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(8), -1)
    _, w1 = attention(q, k, v, scale=1.0, return_weights=True)
    err = float((w - snippet).abs().max())
    unscaled = float((w1 - snippet).abs().max())
    return _found(
        f"max |attnlab weights − snippet| = {_err(err)}; without the division they differ by "
        f"{fmt(unscaled)}",
        "attention(q, k, v, return_weights=True)[1] vs softmax(Q Kᵀ / sqrt(d_k))",
        err < 1e-12,
        "attnlab's default does not divide by √d_k",
    )


@check("002-ex8.3-a")
def _ex83_shapes() -> Finding:
    from ... import attention

    d, n = 8, 5
    X = _randn(d, n, seed=1)
    WQ, WK, WV = (_randn(d, d, seed=s) for s in (2, 3, 4))
    Q, K, V = WQ @ X, WK @ X, WV @ X  # (d_k, n): tokens are columns
    qk = tuple((Q @ K.T).shape)
    # The right column form: Attention(X) = V softmax_cols(KᵀQ/√d_k), and it is P-equivariant.
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(0))
    out = attention(Q.T[None], K.T[None], V.T[None])[0].T  # (d_v, n)
    out_p = attention(Q.T[perm][None], K.T[perm][None], V.T[perm][None])[0].T
    err = float((out_p - out[:, perm]).abs().max())
    qn, kn, vn = Q.numpy().T, K.numpy().T, V.numpy().T
    witness = ind.close(out.numpy(), ind.sdpa(qn, kn, vn).T)
    return _found(
        f"with X ∈ R^(d×n): QKᵀ has shape {qk} (features × features), not (n, n); the token "
        f"form V·softmax(KᵀQ/√d_k) gives Attention(XP) = Attention(X)P to {_err(err)}",
        "Q, K = W_q @ X, W_k @ X; (Q @ K.T).shape; attention(Q.T, K.T, V.T) permuted",
        qk == (n, n),
        "with tokens as columns QKᵀ is d_k×d_k, so the derivation permutes features; it must "
        "use KᵀQ (n×n): (KP)ᵀ(QP) = Pᵀ(KᵀQ)P, and softmax commutes with the permutation",
        Derivation(witness, "V·softmax(KᵀQ/√d_k) in numpy equals attnlab's token-form output"),
    )


#: §5's code sample, verbatim (whitespace-only lines emptied).
SNIPPET = "\n".join(
    [
        "import torch",
        "import torch.nn as nn",
        "import torch.nn.functional as F",
        "",
        "class SelfAttention(nn.Module):",
        "    def __init__(self, d_model, n_heads, dropout=0.1):",
        "        super(SelfAttention, self).__init__()",
        "        self.d_model = d_model",
        "        self.n_heads = n_heads",
        "        self.d_k = d_model // n_heads",
        "",
        "        self.q_linear = nn.Linear(d_model, d_model)",
        "        self.k_linear = nn.Linear(d_model, d_model)",
        "        self.v_linear = nn.Linear(d_model, d_model)",
        "        self.dropout = nn.Dropout(dropout)",
        "        self.out = nn.Linear(d_model, d_model)",
        "",
        "    def forward(self, x):",
        "        batch_size = x.size(0)",
        "",
        "        # 将输入x映射到查询、键、值向量",
        "        q = self.q_linear(x).view(batch_size, -1, self.n_heads, self"
        ".d_k).permute(0, 2, 1, 3)",
        "        k = self.k_linear(x).view(batch_size, -1, self.n_heads, self"
        ".d_k).permute(0, 2, 1, 3)",
        "        v = self.v_linear(x).view(batch_size, -1, self.n_heads, self"
        ".d_k).permute(0, 2, 1, 3)",
        "",
        "        # 计算注意力权重",
        "        scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(self.d_k)",
        "        attn = F.softmax(scores, dim=-1)",
        "        attn = self.dropout(attn)",
        "",
        "        # 计算加权求和得到输出",
        "        output = torch.matmul(attn, v).transpose(1, 2).contiguous()"
        ".view(batch_size, -1, self.d_model)",
        "        output = self.out(output)",
        "",
        "        return output",
    ]
)


@check("003-5-a")
def _code_sample() -> Finding:
    from ... import MultiHeadAttention

    x = _heads_seq(5, 32, seed=3)[0]  # (1, 5, 32)
    as_printed: dict = {}
    exec(compile(SNIPPET, "<seed 003 §5>", "exec"), as_printed)  # the text's own code
    try:
        as_printed["SelfAttention"](32, 4).eval()(x.float())
        error = ""
    except NameError as e:
        error = str(e)
    fixed: dict = {}
    exec(compile("import math\n" + SNIPPET, "<seed 003 §5, fixed>", "exec"), fixed)
    torch.manual_seed(3)
    theirs = fixed["SelfAttention"](32, 4).double().eval()
    ours = MultiHeadAttention(32, 4).double().eval()
    parts = (theirs.q_linear, theirs.k_linear, theirs.v_linear)
    with torch.no_grad():
        ours.qkv_proj.weight.copy_(torch.cat([lin.weight for lin in parts]))
        ours.qkv_proj.bias.copy_(torch.cat([lin.bias for lin in parts]))
        ours.out_proj.weight.copy_(theirs.out.weight)
        ours.out_proj.bias.copy_(theirs.out.bias)
        err = float((ours(x) - theirs(x)).abs().max())
        mine = ours(x)[0].numpy()
    weights = (ours.qkv_proj.weight, ours.qkv_proj.bias, ours.out_proj.weight, ours.out_proj.bias)
    by_hand = ind.mha(x[0].numpy(), *(t.detach().numpy() for t in weights), heads=4)
    wrong = bool(error) and err < 1e-12
    return Finding(
        computed=f"as printed: NameError ({error}); with `import math`: equals "
        f"attnlab.MultiHeadAttention to {tiny(err)}",
        call="exec(snippet); SelfAttention(32, 4)(x) vs MultiHeadAttention(32, 4) with the "
        "same weights",
        **judged(
            not wrong,
            "the code calls math.sqrt without `import math`; with it added, the module "
            "computes standard multi-head self-attention",
            Derivation(
                ind.close(mine, by_hand),
                "multi-head attention in numpy from the copied weights equals "
                "attnlab.MultiHeadAttention",
            ),
        ),
    )


@check("004-1-a")
def _formula() -> Finding:
    from ... import attention

    g = _gen(0)
    q, k, v = _randn_from(g, 2, 3, 5, 4), _randn_from(g, 2, 3, 7, 4), _randn_from(g, 2, 3, 7, 3)
    out = attention(q, k, v)
    ref = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(4), dim=-1) @ v
    ok = _close(out, ref)
    return Finding(
        computed=f"attnlab.attention equals softmax(QKᵀ/√d_k)V: {ok} (max |diff| < 1e-12), "
        f"out shape {tuple(out.shape)}",
        call="attention(q, k, v) vs torch.softmax(q @ k.mT / math.sqrt(4), -1) @ v",
        **_verdict(ok, "attnlab's attention differs from softmax(QKᵀ/√d_k)V"),
    )


@check("004-1-c")
def _scaling_step() -> Finding:
    from ... import attention
    from ...functional.request import get_score

    g = _gen(2)
    ok, parts = True, []
    for d in (1, 4, 64, 100):
        q, k, v = _randn_from(g, 1, 1, 3, d), _randn_from(g, 1, 1, 6, d), _randn_from(g, 1, 1, 6, 2)
        scale = get_score("dot").default_scale(d)
        same = _close(attention(q, k, v), attention(q, k, v, scale=1 / math.sqrt(d)), 0.0)
        ok &= abs(scale - 1 / math.sqrt(d)) < 1e-15 and same
        parts.append(f"d_k={d}: default scale {fmt(scale)}")
    return Finding(
        computed="; ".join(parts) + f"; attention(q, k, v) == attention(..., scale=1/√d_k): {ok}",
        call="get_score('dot').default_scale(d); attention(q, k, v, scale=1 / math.sqrt(d))",
        **_verdict(ok, "the default scale is not 1/√d_k"),
    )


@check("004-1-f")
def _worked_example() -> Finding:
    from ... import attention

    Q = torch.tensor([[1.0, 0], [0, 1], [1, 1], [-1, 2]], dtype=F64)
    K = torch.tensor([[1.0, 1], [0, 2], [2, 0], [-1, -1]], dtype=F64)
    V = torch.tensor([[1.0, 0], [0, 1], [2, 2], [-1, 3]], dtype=F64)
    raw = [float(Q[1] @ K[j]) for j in range(4)]
    e = [math.exp(r / math.sqrt(2)) for r in raw]
    alpha = [x / sum(e) for x in e]
    by_hand = sum(a * V[j] for j, a in enumerate(alpha))
    out = attention(Q.unsqueeze(0), K.unsqueeze(0), V.unsqueeze(0))[0]  # (4, 2), 3-D in
    ok = _close(out[1], by_hand, 1e-14)
    return Finding(
        computed=f"q_2·k_j = {raw}; α_2j = [{', '.join(fmt(a) for a in alpha)}]; "
        f"Σ α_2j v_j = [{', '.join(fmt(float(x)) for x in by_hand)}]; attnlab row 2 = "
        f"[{', '.join(fmt(float(x)) for x in out[1])}]",
        call="attention(Q[None], K[None], V[None])[0, 1]",
        **_verdict(ok, "row 2 of attnlab's output differs from Σ α_2j v_j"),
    )


@check("004-2-a")
def _init_assumption() -> Finding:
    from ... import MultiHeadAttention

    g = _gen(5)
    parts, means, vars_, logit_vars = [], [], [], []
    for d in (32, 128, 512):
        with torch.random.fork_rng(devices=[]):  # the module's init, seeded, leaves no trace
            torch.manual_seed(5)
            mha = MultiHeadAttention(d, 1, bias=False).to(F64)
        with torch.no_grad():
            q, k, _ = mha.project(_randn_from(g, 1, 512, d))
        logits = (q[0, 0, :256] * k[0, 0, 256:]).sum(-1) / math.sqrt(d)  # independent pairs
        means.append(float(q.mean()))
        vars_.append(float(torch.cat([q.flatten(), k.flatten()]).var()))
        logit_vars.append(float(logits.var()))
        parts.append(
            f"d_k={d}: mean {fmt(means[-1], 2)}, Var(q_i) {fmt(vars_[-1], 3)}, "
            f"Var(q·k/√d_k) {fmt(logit_vars[-1], 3)}"
        )
    ok = all(abs(m) < 0.05 for m in means) and max(vars_) / min(vars_) < 1.1
    return Finding(
        computed="; ".join(parts) + " (PyTorch's default init gives Var(q_i) = 1/3, not 1: a "
        "constant factor, so the logit variance is 1/9 at every d_k)",
        call="q, k, _ = MultiHeadAttention(d, 1, bias=False).to(torch.float64).project(x)",
        **_verdict(ok, "at init the entries of q, k are not zero-mean with a d_k-free variance"),
    )


#: Var(q·k) = d_k as each text's claim is checked: the experiment (d_ks, samples, keys), the call
#: as the finding shows it, the relative tolerance, how it words one width, and the claim's
#: wording of a failure.
_VAR_DK = {
    "002-8.1.3-a": (
        ((16, 64, 256), 1024, 16),
        "scaling_experiment(d_ks=(16, 64, 256), samples=1024, keys=16)",
        0.06,
        "d_k={d}: Var(q·k)={v}",
        "the variance of q·k does not track d_k",
    ),
    "004-2-d": (
        (_DKS, 256, 32),
        _SCALING_CALL,
        0.1,
        "d_k={d}: Var(q·k) = {v}",
        "Var(q·k) is not d_k",
    ),
}


@check("002-8.1.3-a", "004-2-d")
def _var_dk(cid: str) -> Finding:
    """For q, k with unit-variance entries Var(q·k) = d_k: `scaling_experiment`'s ``var q·k``
    column at the widths of claim ``cid`` (`_VAR_DK`).

    Args:
        cid: the claim id.

    Returns:
        The finding: the variance at each width.
    """
    args, call, tol, part, why = _VAR_DK[cid]
    r = _scaling(*args)
    d, var = r.column("d_k"), r.column("var q·k")
    return _found(
        "; ".join(part.format(d=dk, v=fmt(v)) for dk, v in zip(d, var, strict=True)),
        call + ".column('var q·k')",
        all(abs(v / dk - 1) < tol for dk, v in zip(d, var, strict=True)),
        why,
    )


@check("004-2-e")
def _var_scaled() -> Finding:
    var = _scaling().column("var q·k/√d_k")
    ok = all(abs(v - 1) < 0.1 for v in var)
    return Finding(
        computed="; ".join(
            f"d_k={d}: Var(q·k/√d_k) = {fmt(v)}" for d, v in zip(_DKS, var, strict=True)
        ),
        call=_SCALING_CALL + ".column('var q·k/√d_k')",
        **_verdict(ok, "the scaled logits' variance is not 1"),
    )


@check("004-2-h")
def _large_or_small() -> Finding:
    from ... import attention, attention_stats

    g = _gen(10)
    q, k, v = _randn_from(g, 1, 1, 4, 8), _randn_from(g, 1, 1, 16, 8), _randn_from(g, 1, 1, 16, 3)
    _, w0 = attention(q, k, v, return_weights=True)
    shift = [
        attention(q, k, v, bias=torch.full((4, 16), c, dtype=F64), return_weights=True)[1]
        for c in (1000.0, -1000.0)
    ]
    invariant = all(_close(w, w0, 1e-12) for w in shift)
    ent = {
        c: float(attention_stats(q, k, v, scale=c / math.sqrt(8)).entropy.mean())
        for c in (1e3, 1.0, 1e-3)
    }
    small_uniform = abs(ent[1e-3] - math.log(16)) < 1e-3
    large_onehot = ent[1e3] < 0.05
    error = invariant and small_uniform and large_onehot
    qn, kn = q[0, 0].numpy(), k[0, 0].numpy()
    witness = ind.close(w0[0, 0].numpy(), ind.attention_weights(qn, kn)) and all(
        abs(ent[c] - float(ind.entropy(ind.attention_weights(qn, kn, c / math.sqrt(8))).mean()))
        < 1e-9
        for c in ent
    )
    return Finding(
        computed=f"logits + 1000 and − 1000 give the same weights as the logits: {invariant}; "
        f"mean entropy with logits ×1000: < 0.05 ({large_onehot}), ×1: {fmt(ent[1.0], 3)}, ×0.001: "
        f"{fmt(ent[1e-3], 4)} nats (uniform: log 16 = {fmt(math.log(16), 4)})",
        call="attention(q, k, v, bias=torch.full((4, 16), ±1000.0), return_weights=True); "
        "attention_stats(q, k, v, scale=c / √8).entropy",
        **judged(
            not error,
            "softmax sees only differences of its inputs (softmax(x + c) = softmax(x)): a large "
            "spread of the logits gives one-hot, a small spread (small inputs) gives near-uniform "
            "weights (entropy → log n), never one-hot; the saturation argument itself stands",
            Derivation(
                witness,
                "softmax(QKᵀ·c/√8) and its entropy in numpy equal attnlab's weights and "
                "attention_stats' entropies at c = 1000, 1, 0.001",
            ),
        ),
    )


@check("004-2-j")
def _scaled_stable() -> Finding:
    r = _scaling()
    ent, jac = r.column("entropy scaled"), r.column("grad norm scaled")
    ok = max(ent) / min(ent) < 1.05 and max(jac) / min(jac) < 1.05
    return Finding(
        computed="scaled logits: "
        + "; ".join(
            f"d_k={d}: entropy {fmt(e, 3)}, Jacobian norm {fmt(j, 3)}"
            for d, e, j in zip(_DKS, ent, jac, strict=True)
        ),
        call=_SCALING_CALL + ".column('entropy scaled'), .column('grad norm scaled')",
        **_verdict(ok, "scaled softmax statistics still depend on d_k"),
    )
