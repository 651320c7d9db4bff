"""Checks of linear attention and its relatives: the kernel formula, its state, hierarchical
attention and FNet mixing (subjects ``linear``, ``linear-state``, ``fnet``)."""

from __future__ import annotations

import torch

from .. import derivations as ind
from ..core import Derivation, Finding, check, fmt, judged, tiny
from ._shared import _err, _est, _found, _qkv, _qkv_nm, _softmax_ref


@check("000-linear-a")
def _linear_phi_on_values() -> Finding:
    from ...linear import linear_attention

    q, k, v = _qkv_nm(64, 64, 16, 16, seed=9)
    phi = lambda x: torch.nn.functional.elu(x) + 1  # noqa: E731
    ours = linear_attention(q, k, v, feature_map="elu", eps=0.0)
    right = ind.linear_attention(q.numpy(), k.numpy(), v.numpy())
    text = q @ (phi(k).mT @ phi(v))
    gap = float(abs(ours.numpy() - right).max())
    rel = float((text - ours).norm() / ours.norm())
    wrong = rel > 0.5
    return Finding(
        computed="linear_attention = φ(Q)(φ(K)ᵀV) / (φ(Q)φ(K)ᵀ1) to "
        f"{tiny(gap, 1e-10)}; the text's Q·φ(K)ᵀ·φ(V) differs from it by {rel:.3g} (relative)",
        call="linear_attention(q, k, v, feature_map='elu', eps=0.0) vs q @ (φ(k).mT @ φ(v))",
        **judged(
            not wrong,
            "φ belongs on Q and K, not V, and the row normaliser φ(Q)φ(K)ᵀ1 is missing: "
            "linear attention is φ(Q)(φ(K)ᵀV) / (φ(Q)(φ(K)ᵀ1))",
            Derivation(
                gap < 1e-10,
                "φ(Q)(φ(K)ᵀV) / (φ(Q)(φ(K)ᵀ1)) with φ = elu + 1 in numpy (Katharopoulos et "
                "al., eq. 6) equals linear_attention to 1e-10",
            ),
        ),
    )


@check("000-linear-b")
def _linear_works() -> Finding:
    from torch.utils.flop_counter import FlopCounterMode

    from ...functional.fnet import fnet_mixing
    from ...functional.performer import favor_attention
    from ...linear import linear_attention

    def count(fn) -> int:
        with FlopCounterMode(display=False) as fc:
            fn()
        return fc.get_total_flops()

    growth = {}
    for name, fn in (
        (
            "Performer",
            lambda q: favor_attention(
                q, q, q, num_features=64, generator=torch.Generator().manual_seed(17)
            ),
        ),
        ("Linear Transformer", lambda q: linear_attention(q, q, q, feature_map="elu")),
    ):
        f1, f2 = (count(lambda n=n, fn=fn: fn(torch.zeros(1, 1, n, 32))) for n in (512, 1024))
        growth[name] = f2 / f1
    x = torch.zeros(1, 8, 4, dtype=torch.float64)
    x[0, 3, 1] = 1.0
    mixed = fnet_mixing(x)[0]
    negative, reached = int((mixed < -1e-12).sum()), int((mixed.abs() > 1e-12).sum())
    wrong = all(abs(g - 2) < 0.01 for g in growth.values()) and negative > 0
    fft_ok = ind.close(mixed.numpy(), ind.fourier_mixing(x.numpy())[0], 1e-12)
    return Finding(
        computed="FLOPs ×"
        + ", ×".join(f"{g:.3f} ({k})" for k, g in growth.items())
        + " when n doubles (linear); FNet's fnet_mixing(x) takes no queries or keys: a one-hot "
        f"token reaches {reached} of {mixed.numel()} outputs, {negative} with negative weights (no "
        "softmax, not a distribution), by an FFT",
        call="FlopCounterMode over favor_attention(q, q, q, num_features=64) and "
        "linear_attention(q, q, q, feature_map='elu') at n = 512, 1024; fnet_mixing(one-hot)",
        **judged(
            not wrong,
            "Performer and the Linear Transformer are linear-time attention, but FNet is not "
            "attention at all (a fixed Fourier token mixing without queries, keys or softmax) "
            "and its FFT costs O(n log n), not O(n)",
            Derivation(
                fft_ok,
                "FNet's mixing Re(FFT_seq(FFT_hidden(x))) by numpy's FFT equals fnet_mixing on the "
                "one-hot token",
            ),
        ),
    )


@check("002-8.4.4-d")
def _linear_without_normaliser() -> Finding:
    from ...linear import linear_attention

    q, k, v = _qkv(H=1, L=256, D=16)
    phi = lambda x: torch.nn.functional.elu(x) + 1  # noqa: E731
    text = phi(q) @ (phi(k).transpose(-1, -2) @ v)
    lin = linear_attention(q, k, v)
    norm = phi(q) @ phi(k).sum(-2, keepdim=True).transpose(-1, -2)  # φ(q_i)ᵀ Σ_j φ(k_j)
    err_norm = float((text / norm - lin).abs().max())
    rel = float((text - lin).norm() / lin.norm())
    witness = ind.close(lin.numpy(), ind.linear_attention(q.numpy(), k.numpy(), v.numpy()), 1e-9)
    return _found(
        f"‖φ(Q)(φ(K)ᵀV) − linear_attention‖/‖linear_attention‖ = {fmt(rel)}; divided by "
        f"φ(Q)(φ(K)ᵀ1) it matches to {_err(err_norm, 1e-9)}",
        "linear_attention(q, k, v) vs phi(q) @ (phi(k).mT @ v)",
        rel < 1e-6,
        "the normaliser is missing: φ(Q)(φ(K)ᵀV) must be divided row-wise by φ(Q)(φ(K)ᵀ1), "
        "else rows are sums, not weighted averages (here ~n·mean times too large)",
        Derivation(
            witness,
            "φ(Q)(φ(K)ᵀV) / (φ(Q)(φ(K)ᵀ1)) with φ = elu + 1 in numpy equals linear_attention "
            "to 1e-9",
        ),
    )


@check("002-8.4.4-e")
def _linear_cost() -> Finding:
    def core(n: int, d: int) -> float:
        e = _est(n, d, 1)
        return sum(e.value(r, "linear") for r in ("scores QKᵀ", "softmax", "weighted sum PV"))

    rn, rd = core(2048, 64) / core(1024, 64), core(1024, 128) / core(1024, 64)
    return _found(
        f"×{fmt(rn)} for 2n, ×{fmt(rd)} for 2d (4 for a pure d² term; the O(n·d) normaliser "
        "and feature map make it a little less)",
        "estimate(n, d, 1) rows 'scores QKᵀ' + 'softmax' + 'weighted sum PV', 'linear'",
        rn == 2 and 3.8 < rd <= 4,
        "the linear form's cost is not linear in n and quadratic in d",
    )


@check("002-8.4.4-f")
def _hierarchical() -> Finding:
    from ...functional import reference
    from ...linear import hierarchical_attention

    q, k, v = _qkv(H=1, L=64)
    out = hierarchical_attention(q, k, v, block_size=8)
    ref = reference.hierarchical_attention(q, k, v, block_size=8)
    err = float((out - ref).abs().max())
    dense = float((out - _softmax_ref(q, k, v)).abs().max())
    return _found(
        f"output {tuple(out.shape)}; max |fast − reference| = {_err(err)}; differs from dense "
        f"attention by up to {fmt(dense)} (an approximation)",
        "hierarchical_attention(q, k, v, block_size=8)",
        err < 1e-12 and out.shape == q.shape,
        "the hierarchical scheme does not produce n outputs from n/k summaries",
    )
