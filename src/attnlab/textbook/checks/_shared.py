"""Helpers the checks of several subjects share: seeded inputs, a reference softmax attention,
multi-head attention by hand, the finding and verdict shorthands, and the scaling experiment of
seed 004."""

from __future__ import annotations

import functools
import math

import torch
from torch import Tensor

from .. import derivations as ind
from ..core import Derivation, Finding, judged, tiny
from ..derivations import np  # NumPy on first use (the textbook extra)


def _qkv_nm(n: int, m: int, dk: int, dv: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    return tuple(
        torch.randn(1, 1, rows, cols, generator=g, dtype=torch.float64)
        for rows, cols in ((n, dk), (m, dk), (m, dv))
    )


def _mha_eval(E: int, heads: int, seed: int) -> torch.nn.Module:
    from ... import MultiHeadAttention

    torch.manual_seed(seed)
    return MultiHeadAttention(E, heads).double().eval()


def _seq(n: int, E: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, n, E, generator=g, dtype=torch.float64)


F64 = torch.float64


def _randn(*shape: int, seed: int = 0) -> Tensor:
    """Seeded float64 standard-normal tensor."""
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=F64)


def _qkv(B: int = 1, H: int = 2, L: int = 8, D: int = 8, seed: int = 0) -> tuple[Tensor, ...]:
    """Seeded q, k, v of shape (B, H, L, D) in float64."""
    return tuple(_randn(B, H, L, D, seed=seed + i) for i in range(3))


def _found(
    computed: str, call: str, ok: bool, why: str, derivation: Derivation | None = None
) -> Finding:
    """``agrees`` when the text's statement holds (``ok``); else ``text error`` with ``why`` if
    ``derivation`` backs attnlab's value, ``disagrees`` if not (`attnlab.textbook.core.judged`)."""
    return Finding(computed, call, **judged(ok, why, derivation))


def _mha_by_hand(mha, x: Tensor) -> Derivation:
    """``mha(x)`` against multi-head attention computed in numpy from the module's weights."""
    weights = (mha.qkv_proj.weight, mha.qkv_proj.bias, mha.out_proj.weight, mha.out_proj.bias)
    e = mha.out_proj.weight.shape[0]
    weights = [
        w.detach().numpy() if w is not None else np.zeros(n)
        for w, n in zip(weights, (3 * e, 3 * e, e, e), strict=True)
    ]
    with torch.no_grad():
        y = mha(x)
    ok = all(
        ind.close(y[b].numpy(), ind.mha(x[b].numpy(), *weights, heads=mha.num_heads))
        for b in range(x.shape[0])
    )
    return Derivation(
        ok,
        "multi-head attention in numpy from the module's weight matrices "
        "equals its output to 1e-12",
    )


_err = tiny  # a round-off-sized difference as ≈0 (< tol)


def _softmax_ref(q: Tensor, k: Tensor, v: Tensor, scale: float | None = None) -> Tensor:
    """softmax(QKᵀ·scale)V in plain torch, scale 1/√d_k by default."""
    s = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    return torch.softmax(q @ k.transpose(-1, -2) * s, -1) @ v


def _mha(E: int = 16, H: int = 4, *, bias: bool = True, seed: int = 0):
    """A seeded float64 `attnlab.MultiHeadAttention`."""
    from ...modules import MultiHeadAttention

    torch.manual_seed(seed)
    mha = MultiHeadAttention(E, H, bias=bias).double().eval()
    return mha.requires_grad_(False)


def _mha_parts(mha) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(W_q, W_k, W_v, W_o) of an attnlab MHA as torch Linear weights (out × in)."""
    (wq, _), (wk, _), (wv, _) = mha.projection_weights()
    return wq.detach(), wk.detach(), wv.detach(), mha.out_proj.weight.detach()


def _permutation_outputs() -> tuple[Tensor, Tensor, Tensor]:
    """attention(Q, K, V), attention of the row-permuted inputs, and the permutation."""
    from ... import attention

    q, k, v = _qkv(H=1, L=6)
    perm = torch.randperm(6, generator=torch.Generator().manual_seed(1))
    out = attention(q, k, v)
    out_p = attention(q[:, :, perm], k[:, :, perm], v[:, :, perm])
    return out, out_p, perm


def _est(n: int, E: int = 768, H: int = 12, **kw):
    from ...analysis import estimate

    return estimate(n, E, H, **kw)


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


def _io_flash(N: int, d: int, B: float) -> float:
    """DRAM traffic (elements) of tiled attention with B-row blocks, from attnlab's IO model
    (`attnlab.analysis.costs.io_tiled`: Q and O once, K and V once per query block)."""
    from ...analysis.costs import io_tiled

    block = max(1, round(B))
    return float(io_tiled(N, d, sram=4 * block * d, block=block))


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


def _heads_seq(n: int, d: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, 1, n, d, generator=g, dtype=torch.float64)


def _gen(seed: int) -> torch.Generator:
    """A CPU generator seeded with ``seed`` (checks never touch the global RNG)."""
    return torch.Generator().manual_seed(seed)


def _randn_from(g: torch.Generator, *shape: int) -> Tensor:
    """Standard normal float64 tensor of ``shape`` drawn from ``g``."""
    return torch.randn(*shape, generator=g, dtype=F64)


def _close(a: Tensor, b: Tensor, tol: float = 1e-12) -> bool:
    """``max |a − b| <= tol`` (False if any difference is NaN)."""
    return bool((a - b).abs().max() <= tol) if a.numel() else True


_verdict = judged  # the verdict keywords by the rule of attnlab.textbook.core.judged


def _scores(w: Tensor, lse: Tensor) -> Tensor:
    """The logits ``s_ij = log p_ij + lse_i`` recovered from attnlab's weights ``(…, L, S)`` and
    log-sum-exp ``(…, L)``."""
    return w.log() + lse.unsqueeze(-1)


_DKS = (4, 64, 1024)


@functools.cache
def _scaling(d_ks: tuple[int, ...] = _DKS, samples: int = 256, keys: int = 32):
    """`scaling_experiment` (seed 0), run once per arguments; by default seed 004's: d_k = 4, 64,
    1024, 256 queries × 32 keys.

    Args:
        d_ks: the key widths.
        samples: queries per width.
        keys: keys per query.

    Returns:
        The experiment's result table.
    """
    from ...analysis import scaling_experiment

    return scaling_experiment(d_ks=d_ks, samples=samples, keys=keys, seed=0)


_SCALING_CALL = "scaling_experiment(d_ks=(4, 64, 1024), samples=256, keys=32, seed=0)"


def _periodic(n: int, period: float) -> Tensor:
    """``(n, 2)`` = [sin(2πm/T), cos(2πm/T)] for m < n: attnlab's sinusoidal table with one
    explicit period (``periods=[T]``)."""
    from ...positional import sinusoidal

    return sinusoidal(n, 2, periods=[period], dtype=F64)


_PERIODIC_CALL = "sinusoidal(n, 2, periods=[T], dtype=torch.float64)"


def _unit_pair(g: torch.Generator, d: int) -> tuple[Tensor, Tensor]:
    basis, _ = torch.linalg.qr(_randn_from(g, d, 2))
    return basis[:, 0], basis[:, 1]


def _additive(dq: int, dk: int, hidden: int, seed: int, *, zero_bias: bool = True):
    """An `AdditiveAttention` in float64 with seeded init; ``zero_bias`` builds it with
    ``bias=False`` (the text's e = vᵀ tanh(W_1 q + W_2 k) has no bias)."""
    from ... import AdditiveAttention

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return AdditiveAttention(dq, dk, hidden, bias=not zero_bias).to(F64)
