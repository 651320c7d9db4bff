"""The NaN rule (issue 13) for the linear family: planted inputs and the pattern the rule names.

`expected_finite` writes the rule out row by row from an explicit (B, L, S) mask, independent of
the library's own poison helpers; `check_nan_rule` compares a fast form and its reference with it.
"""

from __future__ import annotations

import torch

from attnlab import masks
from helpers import FIXED_TABLE, fwd_bwd, seeded

F64 = torch.float64
FWD_ATOL, FWD_RTOL, GRAD_ATOL, GRAD_RTOL = FIXED_TABLE[F64]
BAD = (float("nan"), float("inf"), float("-inf"))


def as_mask(causal: bool, key_mask: torch.Tensor | None) -> masks.Mask | None:
    """The ``mask=`` of a causal flag and a key mask ``(B|1, S)`` (True = real key).

    A prefix per row becomes ``masks.padding(lengths)``; any other key mask (left padding,
    holes) ``masks.from_tensor(key_mask[:, None, None, :])``.
    """
    mask = masks.causal() if causal else None
    if key_mask is not None:
        lengths = key_mask.sum(-1)
        prefix = torch.arange(key_mask.shape[-1]) < lengths[:, None]
        if torch.equal(prefix, key_mask):
            keys = masks.padding(lengths.tolist())
        else:
            keys = masks.from_tensor(key_mask[:, None, None, :])
        mask = keys if mask is None else mask & keys
    return mask


def keep_matrix(B: int, L: int, S: int, causal: bool, key_mask: torch.Tensor | None):
    """``(B, L, S)`` bool: row i may attend key j (bottom-right causal, padding)."""
    keep = torch.ones(B, L, S, dtype=torch.bool)
    for i in range(L):
        for j in range(S):
            if causal and j > i + S - L:
                keep[:, i, j] = False
    if key_mask is not None:
        keep &= key_mask.expand(B, S)[:, None, :]
    return keep


def planted(seed: int, B=2, H=4, H_kv=2, L=9, S=11, D=4, Dv=3, key_mask=None):
    """q, k, v with a few NaN/±inf entries at random places, and always NaN in padded keys."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (
        seeded(B, H, L, D, seed=seed),
        seeded(B, H_kv, S, D, seed=seed + 1),
        seeded(B, H_kv, S, Dv, seed=seed + 2),
    )
    for t, count in ((q, 3), (k, 1), (v, 3)):
        flat = t.view(-1)
        idx = torch.randperm(flat.numel(), generator=g)[:count]
        which = torch.randint(0, 3, (count,), generator=g)
        for i, w in zip(idx.tolist(), which.tolist(), strict=True):
            flat[i] = BAD[w]
    if key_mask is not None:
        pad = ~key_mask.expand(B, S)  # (B, S)
        k[pad[:, None, :].expand_as(k[..., 0])] = float("nan")
        v[pad[:, None, :].expand_as(v[..., 0])] = float("inf")
    return q, k, v


def expected_finite(q, k, v, keep):
    """``(B, H, L, Dv)`` bool: where the NaN rule leaves the output finite."""
    B, H, L, _ = q.shape
    H_kv, Dv = k.shape[1], v.shape[-1]
    G = H // H_kv
    fin = torch.ones(B, H, L, Dv, dtype=torch.bool)
    for b in range(B):
        for h in range(H):
            for i in range(L):
                js = keep[b, i].nonzero().flatten()
                if js.numel() == 0:
                    continue  # attends nothing: zeros, whatever q_i holds
                kk, vv = k[b, h // G, js], v[b, h // G, js]
                if not torch.isfinite(q[b, h, i]).all() or not torch.isfinite(kk).all():
                    fin[b, h, i] = False
                else:
                    fin[b, h, i] = torch.isfinite(vv).all(dim=0)
    return fin


def cleaned(fn):
    """``fn`` on the inputs with non-finite entries read as 0 (zero gradient there)."""
    return lambda *xs: fn(*(torch.nan_to_num(x, 0.0, 0.0, 0.0) for x in xs))


def check_nan_rule(fast, ref, inputs, keep, key_mask=None):
    """Fast form and reference obey the rule: pattern, finite values, gradients."""
    q, k, v = inputs
    want = expected_finite(q, k, v, keep)
    assert (~want).any() and want.any()  # the case exercises both sides of the rule
    golden, golden_grads = fwd_bwd(cleaned(ref), inputs)
    for fn in (ref, fast):
        out, grads = fwd_bwd(fn, inputs)
        assert torch.equal(torch.isfinite(out), want)
        assert not torch.isinf(out).any()  # the rule's non-finite outputs are NaN
        torch.testing.assert_close(out[want], golden[want], atol=FWD_ATOL, rtol=FWD_RTOL)
        no_key = ~keep.any(dim=-1)  # (B, L)
        assert (out.transpose(1, 2)[no_key] == 0).all()
        for g, gg in zip(grads, golden_grads, strict=True):
            assert torch.isfinite(g).all()
            torch.testing.assert_close(g, gg, atol=GRAD_ATOL, rtol=GRAD_RTOL)
        if key_mask is not None:  # no gradient reaches padding
            pad = ~key_mask.expand(k.shape[0], k.shape[2])
            assert (grads[1].transpose(1, 2)[pad] == 0).all()
            assert (grads[2].transpose(1, 2)[pad] == 0).all()
