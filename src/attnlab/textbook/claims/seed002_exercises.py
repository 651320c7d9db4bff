"""Seed 002, §8.8: the exercises as stated and their worked solutions.

The checks of claims whose metadata is in ``claims/seed002.toml``.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .. import derivations as ind
from ..core import (
    Derivation,
    Finding,
    check,
    fmt,
    tiny,
)
from ..derivations import np  # NumPy on first use (the textbook extra)
from .seed002 import F64, _err, _found, _mha, _mha_by_hand, _qkv, _randn, _softmax_ref
from .seed002_costs import _est


# ------------------------------------------------------------------------ 8.8 exercises
def _unscaled_saturation() -> tuple[float, float, float, float]:
    """d_k=512: P(|q·k| > 20), std of q·k, mean max weight unscaled and scaled (64 keys)."""
    from ... import attention

    q, k = _randn(1, 1, 256, 512, seed=3), _randn(1, 1, 64, 512, seed=4)
    v = _randn(1, 1, 64, 4, seed=5)
    dots = q @ k.transpose(-1, -2)
    frac = float((dots.abs() > 20).to(F64).mean())
    _, raw = attention(q, k, v, scale=1.0, return_weights=True)
    _, sc = attention(q, k, v, return_weights=True)
    return frac, float(dots.std()), float(raw.amax(-1).mean()), float(sc.amax(-1).mean())


@check("002-ex8.1-a")
def _ex81_claim() -> Finding:
    frac, std, raw, sc = _unscaled_saturation()
    return _found(
        f"std(q·k) = {fmt(std)} (√512 = {fmt(math.sqrt(512))}); {fmt(100 * frac, 3)} % of |q·k| "
        f"exceed 20; mean max weight {fmt(raw)} unscaled vs {fmt(sc)} with 1/√d_k",
        "attention(q, k, v, scale=1.0, return_weights=True) vs attention(q, k, v, "
        "return_weights=True)",
        std > 20 and frac > 0.2 and raw > 0.7 and sc < 0.3,
        "the unscaled logits do not reach ±20 or softmax does not saturate",
    )


@check("002-ex8.2-a")
def _ex82a() -> Finding:
    e = _est(1024, 768, 12, batch=32, dtype="float16")
    w, wb = e.value("projection weights", "naive"), e.value("projection weights + biases", "naive")
    return _found(
        f"{int(w):,} weights; {int(wb):,} with biases",
        "estimate(1024, 768, 12, batch=32, dtype='float16').value('projection weights', 'naive')",
        w == 2_359_296,
        "the weight count is not 2,359,296",
    )


@check("002-ex8.2-b")
def _ex82b() -> Finding:
    b = _est(1024, 768, 12, batch=32, dtype="float16").value("score matrix", "naive")
    return _found(
        f"{int(b):,} bytes = {fmt(b / 2**20)} MiB",
        "estimate(1024, 768, 12, batch=32, dtype='float16').value('score matrix', 'naive')",
        b == 768 * 2**20,
        "the score matrices do not take 768 MiB",
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


def _local(n: int, k: int) -> tuple[Tensor, Tensor, Tensor]:
    """Exercise 8.4: the text's loop, attnlab with a band mask, attnlab with an additive −∞ M."""
    from ... import attention, masks

    q, k_, v = _qkv(H=1, L=n)
    loop = torch.zeros_like(q)
    for i in range(n):
        s, e = max(0, i - k), min(n, i + k + 1)
        loop[:, :, i] = _softmax_ref(q[:, :, i : i + 1], k_[:, :, s:e], v[:, :, s:e])[:, :, 0]
    band = attention(q, k_, v, mask=masks.sliding_window(k + 1, causal=False))
    idx = torch.arange(n)
    m = torch.zeros(n, n, dtype=F64).masked_fill((idx[:, None] - idx).abs() > k, float("-inf"))
    additive = attention(q, k_, v, mask=m)
    return loop, band, additive


@check("002-ex8.4-a")
def _ex84() -> Finding:
    from ... import masks

    loop, band, additive = _local(32, 3)
    err = max(float((band - loop).abs().max()), float((additive - loop).abs().max()))
    e = _est(4096, 64, 1, mask=masks.sliding_window(65, causal=False))
    pairs = e.value("attended pairs per head", "flash")
    ratio = e.value("scores QKᵀ", "flash") / e.value("scores QKᵀ", "naive")
    want = 4096 * 129 - 64 * 65
    return _found(
        f"loop vs band mask vs −∞ matrix: max |Δ| = {_err(err)}; n=4096, k=64: {int(pairs):,} "
        f"pairs (= n(2k+1) − k(k+1)), score FLOPs {fmt(100 * ratio, 3)} % of dense",
        "attention(q, k, v, mask=masks.sliding_window(k + 1, causal=False)); "
        "estimate(4096, 64, 1, mask=…)",
        err < 1e-12 and pairs == want,
        "the local-attention forms or their cost differ",
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


def _io_flash(N: int, d: int, B: float) -> float:
    """DRAM traffic (elements) of tiled attention with B-row blocks, from attnlab's IO model
    (`attnlab.analysis.costs.io_tiled`: Q and O once, K and V once per query block)."""
    from ...analysis.costs import io_tiled

    block = max(1, round(B))
    return float(io_tiled(N, d, sram=4 * block * d, block=block))


def _io_fit(block, io=None) -> float:
    """Slope of log IO against log M at N=2^20, d=64 for a block-size rule ``block(M, d)``
    (attnlab's IO model, or ``io(N, d, B)``)."""
    io = _io_flash if io is None else io
    Ms = (2**14, 2**16, 2**18)
    ios = [io(2**20, 64, block(M, 64)) for M in Ms]
    return (math.log(ios[-1]) - math.log(ios[0])) / (math.log(Ms[-1]) - math.log(Ms[0]))


def _io_closed(N: int, d: int, B: float) -> float:
    return float(ind.tiled_io(N, d, max(1, round(B))))


@check("002-ex8.6-a")
def _ex86() -> Finding:
    text = _io_fit(lambda M, d: math.sqrt(M / d))
    right = _io_fit(lambda M, d: M / (4 * d))  # K_j, V_j, Q_i, O_i blocks of B×d in SRAM
    closed = (
        _io_fit(lambda M, d: math.sqrt(M / d), _io_closed),
        _io_fit(lambda M, d: M / (4 * d), _io_closed),
    )
    return _found(
        f"IO ∝ M^{fmt(text, 3)} with B = √(M/d); IO ∝ M^{fmt(right, 3)} with B = M/(4d)",
        "io_tiled(N, d, sram, block=B) at B = sqrt(M/d) and B = M/(4d)",
        abs(text + 1) < 0.05,
        "B = √(M/d) gives O(N²d^1.5/√M); O(N²d²/M) needs B = Θ(M/d) (B×d blocks of Q, K, V, "
        "O filling the SRAM)",
        Derivation(
            abs(closed[0] - text) < 1e-9 and abs(closed[1] - right) < 1e-9,
            "FlashAttention's Algorithm 1 IO 2Nd + ⌈N/B⌉(3Nd + 4N) in closed form gives slopes "
            f"{fmt(closed[0], 3)} and {fmt(closed[1], 3)}",
        ),
    )


def _sine_only_residual(k: int = 1) -> tuple[float, float]:
    """Least-squares relative residual of PE(p+k) ≈ PE(p)·M for sine-only and sin/cos features."""
    from ...positional import sinusoidal

    p = torch.arange(300, dtype=F64)[:, None]
    w = 2.0 ** -torch.arange(8, dtype=F64)
    sines = torch.sin(p * w)  # PE_base(pos, i) = sin(pos·2^−i), the exercise's proposal
    a, b = sines[: 300 - k], sines[k:]
    m = torch.linalg.lstsq(a, b).solution
    r_sin = float((a @ m - b).norm() / b.norm())
    pe = sinusoidal(300, 16, dtype=F64)
    m2 = torch.linalg.lstsq(pe[: 300 - k], pe[k:]).solution
    r_pe = float((pe[: 300 - k] @ m2 - pe[k:]).norm() / pe[k:].norm())
    return r_sin, r_pe


def _table_is_closed_form() -> bool:
    """attnlab's sinusoidal(300, 16), the sin/cos table these exercises compare with, equals
    the closed form."""
    from ...positional import sinusoidal

    return ind.close(sinusoidal(300, 16, dtype=F64).numpy(), ind.sinusoid(300, 16), 1e-9)


@check("002-ex8.7-a")
def _ex87() -> Finding:
    r_sin, r_pe = _sine_only_residual()
    pos = np.arange(300, dtype=np.float64)[:, None]
    w_sin = ind.shift_residual(np.sin(pos * 2.0 ** -np.arange(8)))
    w_pe = ind.shift_residual(ind.sinusoid(300, 16))
    return _found(
        f"relative residual of the best linear map PE(p) → PE(p+1): {fmt(r_sin)} for sines only, "
        f"{_err(r_pe)} for sin/cos pairs",
        "torch.linalg.lstsq(PE[:-1], PE[1:]) for sin(pos·2^−i) and for sinusoidal(300, 16)",
        r_sin < 1e-6,
        "with sines alone no fixed linear map sends PE(p) to PE(p+k) (each sine needs its "
        "cosine, as in 8.2.2), so relative offsets are not linearly accessible",
        Derivation(
            abs(w_sin - r_sin) < 1e-9 and abs(w_pe - r_pe) < 1e-9 and _table_is_closed_form(),
            "attnlab's sinusoidal(300, 16) equals sin/cos(p/10000^(2i/16)) by math.sin and "
            f"math.cos; numpy least squares on the closed-form tables: residuals {fmt(w_sin)} "
            f"(sines) and {tiny(w_pe)} (sin/cos)",
        ),
    )


def _single_head_copy() -> tuple[Tensor, Tensor, Tensor]:
    """A one-head MHA built to output x_1 + x_n at every position: (y, target, weights)."""
    from ... import attention

    E, n, c = 8, 6, 200.0
    x = _randn(1, n, E, seed=7)
    x[..., 6] = 0.0
    x[:, [0, n - 1], 6] = 1.0  # marker on the first and last tokens
    x[..., 7] = 1.0  # a constant feature
    mha = _mha(E, 1, bias=False)
    with torch.no_grad():
        w = torch.zeros(3 * E, E, dtype=F64)
        w[0, 7] = c  # q = c·e_0 for every token
        w[E, 6] = 1.0  # k = e_0 on the marked tokens, 0 elsewhere
        w[2 * E :] = torch.eye(E, dtype=F64)  # v = x
        mha.qkv_proj.weight.copy_(w)
        mha.out_proj.weight.copy_(2 * torch.eye(E, dtype=F64))  # W^O = 2I
    y = mha(x)
    q, k, v = mha.project(x)
    _, a = attention(q, k, v, return_weights=True)
    _SINGLE_HEAD_WITNESS[0] = _mha_by_hand(mha, x)
    return y, (x[:, 0] + x[:, -1]).unsqueeze(1).expand_as(y), a[0, 0]


_SINGLE_HEAD_WITNESS: list[Derivation] = [Derivation(False, "not computed")]


@check("002-ex8.8-a")
def _ex88_single() -> Finding:
    y, target, a = _single_head_copy()
    err = float((y - target).abs().max())
    a1, an, rest = float(a[:, 0].min()), float(a[:, -1].min()), float(a[:, 1:-1].max())
    return _found(
        f"α_i1 = {fmt(a1, 6)}, α_in = {fmt(an, 6)} in every row, other weights {_err(rest)}; "
        f"max |y_i − (x_1 + x_n)| = {_err(err)}",
        "MultiHeadAttention(8, 1, bias=False) with hand-set weights; attention(…, "
        "return_weights=True)",
        not (abs(a1 - 0.5) < 1e-12 and abs(an - 0.5) < 1e-12 and err < 1e-12),
        "one head does it: equal logits on x_1 and x_n and much lower elsewhere give 0.5/0.5, "
        "and W^O = 2I outputs x_1 + x_n exactly",
        _SINGLE_HEAD_WITNESS[0],
    )


@check("002-ex8.8-b")
def _ex88_rank() -> Finding:
    from ... import attention

    _, _, a = _single_head_copy()
    r_copy = int(torch.linalg.matrix_rank(a))
    q, k, v = _qkv(H=1, L=16, D=16)
    _, w = attention(q, k, v, return_weights=True)
    r_rand = int(torch.linalg.matrix_rank(w[0, 0]))
    w_ind = ind.attention_weights(q.numpy(), k.numpy())[0, 0]
    witness = ind.close(w[0, 0].numpy(), w_ind) and _SINGLE_HEAD_WITNESS[0].agrees
    return _found(
        f"rank of the 0.5/0.5 matrix = {r_copy}; rank of one random head's 16×16 weights = "
        f"{r_rand}",
        "torch.linalg.matrix_rank(attention(q, k, v, return_weights=True)[1][0, 0])",
        r_copy >= 2 and r_rand == 1,
        "the 0.5/0.5 pattern has rank 1, and a single head's n×n weights are generically of "
        "full rank n, not rank 1",
        Derivation(
            witness,
            f"softmax(QKᵀ/√d) in numpy equals attnlab's weights (numpy rank "
            f"{int(np.linalg.matrix_rank(w_ind))}), and the copy head matches numpy",
        ),
    )


@check("002-ex8.8-c")
def _ex88_two_heads() -> Finding:
    from ... import attention

    n = 6
    x = _randn(1, 1, n, 8, seed=7)
    m1 = torch.zeros(n, n, dtype=torch.bool)
    m1[:, 0] = True
    m2 = torch.zeros(n, n, dtype=torch.bool)
    m2[:, -1] = True
    h1, h2 = attention(x, x, x, mask=m1), attention(x, x, x, mask=m2)
    xn = x.numpy()
    witness = ind.close(h1.numpy(), ind.sdpa(xn, xn, xn, keep=m1.numpy())) and ind.close(
        h2.numpy(), ind.sdpa(xn, xn, xn, keep=m2.numpy())
    )
    y = 0.5 * h1 + 0.5 * h2  # Σ_i head_i W_i^O with W_i^O = 0.5·I
    target = x[:, :, :1] + x[:, :, -1:]
    gap = float((y - target).abs().max())
    half = float((y - 0.5 * target).abs().max())
    return _found(
        f"max |y − (x_1 + x_n)| = {fmt(gap)}; max |y − 0.5(x_1 + x_n)| = {_err(half)}",
        "attention(x, x, x, mask=first/last column) per head; 0.5·head_1 + 0.5·head_2",
        gap < 1e-12,
        "W^O = 0.5·I gives 0.5(x_1 + x_n), half the stated target; W_i^O = I gives x_1 + x_n",
        Derivation(witness, "masked softmax(QKᵀ/√d)V in numpy equals both heads"),
    )


@check("002-8.3.2-d")
def _h_distributions() -> Finding:
    from ... import attention
    from ...analysis import head_diversity

    q, k, v = _qkv(H=4)
    _, w = attention(q, k, v, return_weights=True)
    sums = float((w.sum(-1) - 1).abs().max())
    div = float(head_diversity(w)[0])
    distinct = bool(
        (w[0, :, None] - w[0, None, :]).abs().amax((-1, -2)).add(torch.eye(4)).gt(1e-3).all()
    )
    return _found(
        f"weights {tuple(w.shape)}: one distribution per (head, query) (sums 1 ± {_err(sums)}), "
        f"the 4 heads' maps pairwise different: {distinct}; head_diversity {fmt(div)}",
        "attention(q, k, v, return_weights=True)[1]; head_diversity(w)",
        sums < 1e-12 and distinct,
        "the heads do not give separate distributions",
    )


@check("002-8.4.3-c")
def _mostly_matmul() -> Finding:
    share = {}
    for n in (512, 4096):
        e = _est(n)
        share[n] = 1 - e.value("softmax", "naive") / e.value("total", "naive")
    return _found(
        "matmul share of the FLOPs: "
        + ", ".join(f"n={n}: {fmt(100 * s, 4)} %" for n, s in share.items()),
        "1 − estimate(n, 768, 12).value('softmax') / .value('total')",
        min(share.values()) > 0.95,
        "the non-matmul work is not small",
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


@check("002-ex8.7-b")
def _ex87_laplacian() -> Finding:
    def codes(n: int) -> Tensor:
        lap = torch.diag(torch.tensor([1.0] + [2.0] * (n - 2) + [1.0], dtype=F64))
        lap -= torch.diag(torch.ones(n - 1, dtype=F64), 1) + torch.diag(
            torch.ones(n - 1, dtype=F64), -1
        )
        _, vec = torch.linalg.eigh(lap)
        vec = vec[:, 1:9]
        return vec * vec[0].sign()  # fix each eigenvector's sign

    c16, c32 = codes(16), codes(32)
    a, b = c32[:-1], c32[1:]
    m = torch.linalg.lstsq(a, b).solution
    resid = float((a @ m - b).norm() / b.norm())
    closed = ind.path_laplacian_modes(32, 8)
    witness = ind.close(c32.numpy(), closed, 1e-9) and ind.close(
        c16.numpy(), ind.path_laplacian_modes(16, 8), 1e-9
    )
    length = float((c16[3] - c32[3]).abs().max())
    return _found(
        f"position 3's code differs between n=16 and n=32 by up to {fmt(length)}; best linear "
        f"map code(p) → code(p+1) leaves a relative residual {fmt(resid)} (sin/cos: "
        f"{_err(_sine_only_residual()[1])})",
        "torch.linalg.eigh(path Laplacian); torch.linalg.lstsq(code[:-1], code[1:])",
        resid < 1e-6 and length < 1e-6,
        "the path Laplacian's eigenvectors are cos(πk(j+½)/n): they depend on the length n and "
        "have no fixed linear shift map (no sine partners, reflecting ends)",
        Derivation(
            witness and abs(ind.shift_residual(closed) - resid) < 1e-9 and _table_is_closed_form(),
            "the closed-form modes cos(πk(j+½)/n) equal torch's eigenvectors at n = 16 and 32, "
            "with the same shift residual; attnlab's sin/cos table compared with equals its "
            "closed form",
        ),
    )
