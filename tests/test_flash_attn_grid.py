"""flash-attention's own test grid on attnlab (issue #38 item 9).

flash-attention (Dao-AILab/flash-attention, ``tests/test_flash_attn.py``) checks its kernels
against ``attention_ref`` — plain PyTorch on the padded batch: scores ``q·kᵀ/√d``, soft-capping
``c·tanh(s/c)``, key padding, a local window ``(left, right)`` (``-1`` = unbounded) aligned
bottom-right to each row's real key length, an ALiBi bias, softmax, ``·v``, rows without a key
zeroed — run twice: upcast (the golden value) and in the input dtype with the scale folded into
k (``upcast=False, reorder_ops=True``: "what PyTorch would get"). Its rule: the kernel's max error
against the golden value is at most 2× PyTorch's for the output and 3× for dQ, dK, dV; its newer
(Hopper) tests add the floor ``2·max|(g + 0.3 − 0.3) − g|`` in the input dtype and allow 3× on
the output when soft-capping. This file restates ``attention_ref`` independently (`fa_reference`,
the golden run in float64 instead of float32), checks attnlab's float64 reference against it,
and holds every backend to that rule over flash-attention's grid: odd lengths (113/203, 128/217,
1/239, 108/256, 256/113 with L > S, 339/1023), head dims 32–256 (59, 111 odd), float32 /
bfloat16 / float16, causal, local windows, soft-capping, ALiBi, MHA/GQA/MQA (H_kv = 6, 2, 1 of
H = 6), random key padding. Stricter than flash-attention in one place: its Hopper tests add
3e-4 to the gradient bound when soft-capping, which would cover any float32 error; not here.

Where torch's own kernel (``F.scaled_dot_product_attention`` on the same dense mask, or the bias
added to it as a float mask in the input dtype) exceeds the rule too, attnlab's error must stay
within 2× torch's on the same case (torch's error computed in the same test). Soft-capped calls
have no torch kernel (its fused kernel has no tanh stage): they must meet the rule.

What failed before issue #38 (the `FIXED` cases; the float32 ones fail on the code before it):

- ``softcap + ALiBi + MQA at L = 1`` (float32): the pure-PyTorch tile engine stacked the G query
  heads of a key head into one logit product, which BLAS runs on its matrix–matrix kernel instead
  of the per-head matrix–vector one (1.5–4× the logit error); large logits turned it into 3× the
  output and 9× the dK error of the per-head formula (`flash.engines.TorchEngine._scores`).
- ``softcap`` with merged key tiles (causal, key padding, float32): rows whose keys took several
  calls lost lse's rounding error (ulp(30) ≈ 2e-6), 2–4× dQ/dK (`merge.merge_compensated`).
- ``ALiBi + local window`` and window rows with a few keys at L > S (float32, attnlab's C++ band
  backward): δ = rowsum(dO ⊙ O) in one float32 chain over Dv, inconsistent with the tile's own
  P and dO·vᵀ; ALiBi's concentrated P and rows with one to a few keys passed that difference
  whole into dQ: 1.6× and 5× torch's dQ error (``_ext/band_attn.cpp``: δ = Σ P·dP of each row
  when the band call holds all its keys, ``grad_row_own``; else rowsum summed in double).
- ``bfloat16 GQA`` (causal, L > S): torch's kernel backward in 16 bits sums dK/dV per query block
  and over the G heads in bfloat16: dV 2.4× torch's own error on its unsplit call, within the
  rule (`flash.job.FlashJob._widen`: the backward is always widened).

One residual is accepted (float32, flash on torch's kernel with a row split into merged calls),
see `check`.
"""

from __future__ import annotations

import hashlib
import itertools
import math
from dataclasses import dataclass, replace

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

import attnlab
from attnlab import masks
from attnlab.functional.flash import flash_job
from attnlab.functional.request import build_request
from attnlab.positional import ALiBi, alibi_slopes

_NEG_INF = float("-inf")
NAMES = ("out", "dq", "dk", "dv")


# ------------------------------------------------------------------------------ the cases
@dataclass(frozen=True)
class Case:
    """One point of the grid (flash-attention's parameter names where they exist).

    Attributes:
        L, S: query and key lengths (flash-attention's seqlen_q, seqlen_k).
        D: head dim. dtype: input dtype.
        H, H_kv: query heads and key/value heads (MHA, GQA, MQA).
        causal: flash-attention's ``causal`` (the window's right side becomes 0).
        window: ``(left, right)``; key j is visible from aligned row p iff
            ``p − left <= j <= p + right``, ``-1`` = unbounded on that side.
        softcap: 0 = none, else ``c·tanh(s/c)`` on the scaled scores (q is scaled by c, as
            flash-attention does, so the scores reach the cap).
        alibi: add ALiBi (attnlab's slopes for H heads; flash-attention's bias form).
        key_padding: random key lengths in ``[S − 20, S]`` per batch item (flash-attention's
            ``generate_random_padding_mask(mode="random")``); alignment follows the real length.
        B: batch. seed: input seed (None: derived from the other fields).
    """

    L: int
    S: int
    D: int
    dtype: torch.dtype
    H: int = 6
    H_kv: int = 6
    causal: bool = False
    window: tuple[int, int] = (-1, -1)
    softcap: float = 0.0
    alibi: bool = False
    key_padding: bool = False
    B: int = 2
    seed: int | None = None

    @property
    def local(self) -> tuple[int, int] | None:
        """The window actually applied (causal forces right = 0), or None for none."""
        left, right = (self.window[0], 0) if self.causal else self.window
        return None if left < 0 and right < 0 else (left, right)

    def input_seed(self) -> int:
        if self.seed is not None:
            return self.seed
        text = repr(replace(self, seed=0)).encode()
        return int.from_bytes(hashlib.sha256(text).digest()[:4], "little")

    def label(self) -> str:
        parts = [f"{self.L}x{self.S}", f"d{self.D}", str(self.dtype).removeprefix("torch.")]
        parts.append(f"h{self.H}-{self.H_kv}")
        if self.causal:
            parts.append("causal")
        if self.local is not None and not (self.causal and self.window[0] < 0):
            parts.append(f"win{self.local[0]},{self.local[1]}")
        if self.softcap:
            parts.append(f"cap{self.softcap:g}")
        if self.alibi:
            parts.append("alibi")
        if self.key_padding:
            parts.append("kpad")
        if self.seed is not None:
            parts.append(f"s{self.seed}")
        return "-".join(parts)


@dataclass
class Inputs:
    """The tensors of a case: q ``(B, H, L, D)``, k/v ``(B, H_kv, S, D)``, dout, key lengths."""

    q: Tensor
    k: Tensor
    v: Tensor
    dout: Tensor
    lengths: Tensor | None  # (B,) int64, or None without key padding


def make_inputs(case: Case) -> Inputs:
    """Seeded unit-normal inputs (q scaled by the cap when soft-capping), drawn in float32."""
    g = torch.Generator().manual_seed(case.input_seed())
    B, H, Hk, L, S, D = case.B, case.H, case.H_kv, case.L, case.S, case.D
    q = torch.randn(B, H, L, D, generator=g) * (case.softcap or 1.0)
    k = torch.randn(B, Hk, S, D, generator=g)
    v = torch.randn(B, Hk, S, D, generator=g)
    dout = torch.randn(B, H, L, D, generator=g)
    lengths = None
    if case.key_padding:
        lengths = torch.randint(max(1, S - 20), S + 1, (B,), generator=g)
    return Inputs(*(x.to(case.dtype) for x in (q, k, v, dout)), lengths)


# ------------------------------------------------------- flash-attention's reference, restated
def fa_reference(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    case: Case,
    lengths: Tensor | None,
    *,
    golden: bool,
) -> Tensor:
    """flash-attention's ``attention_ref`` semantics in attnlab's layout ``(B, H, L, D)``.

    Args:
        q, k, v: the inputs (k, v with H_kv heads: query head h reads key head ``h // G``).
        case: the semantics (causal, window, softcap, ALiBi, padding).
        lengths: real key length per batch item (key padding), or None.
        golden: True computes in float64 (flash-attention upcasts to float32); False runs in
            the input dtype with the scale folded into k (``upcast=False, reorder_ops=True``);
            the ALiBi bias stays float32 there (its ``attn_bias`` is float32, so adding it
            promotes the scores, as in flash-attention).

    Returns:
        ``(B, H, L, D)`` in the input dtype; rows with no visible key are zeros.
    """
    dtype_og = q.dtype
    work = torch.float64 if golden else q.dtype
    q, k, v = q.to(work), k.to(work), v.to(work)
    B, H, L, D = q.shape
    S = k.shape[2]
    G = H // k.shape[1]
    k = k.repeat_interleave(G, dim=1)  # (B, H, S, D): flash's repeat "b s h d -> b s (h g) d"
    v = v.repeat_interleave(G, dim=1)
    if golden:
        scores = (q / math.sqrt(D)) @ k.transpose(-1, -2)  # (B, H, L, S)
    else:
        scores = q @ (k / math.sqrt(D)).transpose(-1, -2)  # (B, H, L, S)
    if case.softcap > 0:
        scores = torch.tanh(scores / case.softcap) * case.softcap
    row = torch.arange(L).view(L, 1)
    col = torch.arange(S).view(1, S)
    sk = torch.full((B, 1, 1, 1), S) if lengths is None else lengths.view(B, 1, 1, 1)
    aligned = row + sk - L  # (B|1, 1, L, 1): the key position row i lines up with
    hidden = torch.zeros(1, 1, L, S, dtype=torch.bool)
    if lengths is not None:
        hidden = hidden | (col >= sk)
    if case.local is not None:
        left, right = case.local
        if right >= 0:
            hidden = hidden | (col > aligned + right)
        if left >= 0:
            hidden = hidden | (col < aligned - left)
    hidden = hidden.expand(B, 1, L, S)
    if case.alibi:
        bias_dtype = torch.float64 if golden else torch.float32
        slopes = torch.tensor(alibi_slopes(H), dtype=bias_dtype).view(1, H, 1, 1)
        if case.causal:  # flash-attention's causal form: a per-row constant away from −slope·(p−j)
            bias = slopes * (col - (S - 1)).to(bias_dtype)
        else:
            bias = -slopes * (aligned - col).abs().to(bias_dtype)
        scores = scores + bias
    dead = hidden.all(dim=-1, keepdim=True)  # (B, 1, L, 1): rows with no key
    scores = scores.masked_fill(hidden, _NEG_INF).masked_fill(dead, 0.0)
    attn = torch.softmax(scores, dim=-1).to(v.dtype).masked_fill(dead, 0.0)
    return (attn @ v).to(dtype_og)  # (B, H, L, D)


# ------------------------------------------------------------------- attnlab's equivalent call
class _ShiftedBias:
    """A bias function evaluated at query positions moved by a per-batch shift (key padding:
    flash-attention aligns rows to each item's real key length, attnlab to S)."""

    relative = False

    def __init__(self, fn: ALiBi, shift: Tensor) -> None:
        self.fn, self.shift, self.num_heads = fn, shift, fn.num_heads  # shift: (B,)

    def __call__(self, b: Tensor, h: Tensor, i: Tensor, j: Tensor) -> Tensor:
        return self.fn(b, h, i - self.shift.to(i.device)[b], j)  # shift[b]: (B, 1, 1, 1)


def attnlab_mask_bias(case: Case, lengths: Tensor | None):
    """``(mask, bias)`` for `attnlab.attention` with exactly `fa_reference`'s semantics.

    attnlab's own masks where they say it (``causal()``, ``sliding_window``, ``padding``, ALiBi);
    a window of two different sides, or one aligned to each item's real key length, as
    ``masks.from_fn`` on the aligned position ``i`` (attnlab aligns row ``r`` to
    ``i = r + S − L``; flash-attention to ``r + length − L``: ``shift = S − length``).
    """
    shift = None if lengths is None else case.S - lengths  # (B,)
    mask: masks.Mask | None = None
    local = case.local
    if local is not None:
        left, right = local
        if shift is None and left < 0 and right == 0:
            mask = masks.causal()
        elif shift is None and left >= 0 and right == 0:
            mask = masks.sliding_window(left + 1, causal=True)
        elif shift is None and left == right:
            mask = masks.sliding_window(left + 1, causal=False)
        else:
            moved = torch.zeros(1, dtype=torch.long) if shift is None else shift  # (B|1,)

            def window(b: Tensor, h: Tensor, i: Tensor, j: Tensor) -> Tensor:
                p = i - moved.to(i.device)[b.clamp(max=moved.numel() - 1)]  # (B|1, 1, L, 1)
                keep = j <= p + right if right >= 0 else torch.ones_like(j, dtype=torch.bool)
                return keep & (j >= p - left) if left >= 0 else keep

            mask = masks.from_fn(window, batch_size=None if shift is None else case.B)
    if lengths is not None:
        pad = masks.padding(lengths)
        mask = pad if mask is None else mask & pad
    bias = None
    if case.alibi:
        alibi = ALiBi(case.H, causal=case.causal)
        # the causal form differs from the shifted one by a per-row constant: keep ALiBi itself
        bias = alibi if shift is None or case.causal else _ShiftedBias(alibi, shift)
    return mask, bias


def torch_dense(case: Case, mask, bias) -> tuple[Tensor, Tensor | None]:
    """The same mask as a dense bool ``(B, H|1, L, S)`` and the bias as float32 ``(B, H, L, S)``."""
    B, H, L, S = case.B, case.H, case.L, case.S
    keep = torch.ones(B, 1, L, S, dtype=torch.bool)
    if mask is not None:
        keep = keep & mask.to_dense(L, S, batch=B, heads=H)
    add = None
    if bias is not None:
        b = torch.arange(B).view(B, 1, 1, 1)
        h = torch.arange(H).view(1, H, 1, 1)
        i = (torch.arange(L) + S - L).view(1, 1, L, 1)
        j = torch.arange(S).view(1, 1, 1, S)
        add = bias(b, h, i, j).to(torch.float32).expand(B, H, L, S)
    return keep, add


# ------------------------------------------------------------------------------ the rule
def _floor(golden: Tensor, dtype: torch.dtype) -> float:
    g = golden.to(dtype)
    return 2.0 * float(((g + 0.3) - 0.3 - g).abs().max().double()) if g.numel() else 0.0


def _err(x: Tensor, golden: Tensor) -> float:
    return float((x.double() - golden).abs().max()) if x.numel() else 0.0


def _fwd_bwd(fn, inp: Inputs, dtype: torch.dtype) -> list[Tensor]:
    """``[out, dq, dk, dv]`` of ``fn(q, k, v)`` on copies in ``dtype`` for the case's dout."""
    xs = [x.detach().to(dtype).requires_grad_(True) for x in (inp.q, inp.k, inp.v)]
    out = fn(*xs)
    grads = torch.autograd.grad(out, xs, inp.dout.to(dtype))
    return [out.detach(), *grads]


def merges_kernel_calls(case: Case, inp: Inputs, mask, bias) -> bool:
    """Whether flash runs this float32 case as several calls of torch's kernel that are merged
    per row (bottom-right causal with L < S: the keys before the square and the square; a mask
    whose rows take full and masked key tiles). See `check`'s residual."""
    if case.dtype != torch.float32 or case.softcap:
        return False
    req = build_request(
        inp.q,
        inp.k,
        inp.v,
        mask=mask,
        bias=bias,
        scale=None,
        temperature=1.0,
        score="dot",
        dropout_p=0.0,
        return_weights=False,
    )
    job = flash_job(req)
    return job.engine == "kernel" and not job.plan.merge_free


def _limits(naive: list[Tensor], golden: list[Tensor], case: Case) -> list[float]:
    """The rule's bound per tensor: 2× (3× soft-capped) / 3× PyTorch's error, plus the floor."""
    fwd_factor = 3.0 if case.softcap else 2.0
    return [
        (fwd_factor if n == 0 else 3.0) * _err(pt, gold) + _floor(gold, case.dtype)
        for n, (pt, gold) in enumerate(zip(naive, golden, strict=True))
    ]


def _backend_runs(case: Case, inp, mask, bias, merged: bool) -> tuple[dict, bool]:
    """``({backend: [out, dq, dk, dv]}, merged)``: every backend (auto reuses what it picks)."""
    softcap = case.softcap or None
    runs: dict[str, list[Tensor]] = {}
    for backend in ("flash", "sdpa", "auto"):
        if backend == "sdpa" and softcap is not None:
            continue  # torch's fused kernel has no tanh stage: sdpa declines soft-capping

        def call(q, k, v, backend=backend):
            return attnlab.attention(
                q, k, v, mask=mask, bias=bias, softcap=softcap, backend=backend
            )

        if backend == "auto":
            xs = [x.detach().requires_grad_(True) for x in (inp.q, inp.k, inp.v)]
            chosen = attnlab.explain(*xs, mask=mask, bias=bias, softcap=softcap).backend
            merged = merged and chosen == "flash"
            if chosen in runs:  # the same computation: no need to run it twice
                runs["auto"] = runs[chosen]
                continue
        runs[backend] = _fwd_bwd(call, inp, case.dtype)
    return runs, merged


def _torch_errors(case: Case, inp, mask, bias, golden: list[Tensor]) -> list[float] | None:
    """torch's own kernel's errors on the same dense mask (None when soft-capped: no kernel)."""
    if case.softcap:
        return None
    keep, add = torch_dense(case, mask, bias)
    dead = ~keep.any(dim=-1, keepdim=True)

    def torch_call(q, k, v):
        m = keep if add is None else torch.where(keep, add, _NEG_INF).to(q.dtype)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=m, enable_gqa=case.H_kv != case.H)
        return torch.where(dead, 0.0, out)

    return [_err(x, g) for x, g in zip(_fwd_bwd(torch_call, inp, case.dtype), golden, strict=True)]


def _violation(backend: str, n: int, err: float, limit: float, pt: float, torch_err, merged):
    """The rule's verdict on one tensor: None when it holds, else the message."""
    if err <= limit:
        return None
    residual = merged and backend in ("flash", "auto")
    if residual and torch_err is not None and err <= 2.0 * torch_err:
        return None  # the residual of `check`: torch's kernel, split and merged per row
    if torch_err is not None and torch_err > limit:
        if err <= 2.0 * torch_err:
            return None  # torch's kernel exceeds the rule too: within 2x of it
        return (
            f"{backend} {NAMES[n]}: err {err:.3e} > 2x torch's {torch_err:.3e} "
            f"(both over the rule's {limit:.3e})"
        )
    theirs = "" if torch_err is None else f"; torch {torch_err:.3e} passes"
    return (
        f"{backend} {NAMES[n]}: err {err:.3e} > rule {limit:.3e} (PyTorch naive {pt:.3e}){theirs}"
    )


def run_case(case: Case) -> list[str]:
    """Runs a case on every backend and torch's kernel; returns the rule's violations."""
    inp = make_inputs(case)
    golden = _fwd_bwd(
        lambda q, k, v: fa_reference(q, k, v, case, inp.lengths, golden=True), inp, torch.float64
    )
    naive = _fwd_bwd(
        lambda q, k, v: fa_reference(q, k, v, case, inp.lengths, golden=False), inp, case.dtype
    )
    limits = _limits(naive, golden, case)
    mask, bias = attnlab_mask_bias(case, inp.lengths)
    merged = merges_kernel_calls(case, inp, mask, bias)
    runs, merged = _backend_runs(case, inp, mask, bias, merged)
    torch_errs = _torch_errors(case, inp, mask, bias, golden)
    problems = []
    for backend, got in runs.items():
        for n, (x, gold) in enumerate(zip(got, golden, strict=True)):
            if not torch.isfinite(x).all():
                problems.append(f"{backend} {NAMES[n]}: non-finite values")
                continue
            torch_err = None if torch_errs is None else torch_errs[n]
            pt = _err(naive[n], gold)
            found = _violation(backend, n, _err(x, gold), limits[n], pt, torch_err, merged)
            if found is not None:
                problems.append(found)
    return problems


def check(case: Case) -> None:
    """Asserts flash-attention's rule for every backend on ``case``: the max error against the
    float64 golden value at most 2× (3× soft-capped) PyTorch's same-dtype error for the output
    and 3× for dQ, dK, dV, plus the floor; where torch's kernel exceeds that too, at most 2×
    torch's error; no NaN/inf.

    One residual, float32 only: where flash runs a row as several calls of torch's kernel whose
    results it merges (bottom-right causal with L < S — the keys before the diagonal square and
    the square, since torch's kernel is causal only top-left; masks whose rows take full and
    masked key tiles), each call returns its log-sum-exp rounded to float32 and the merge (and
    backward's ``exp(s − lse)``) carries those roundings: up to ~1.5× the error of torch's one
    call on the same rows. The rule then holds or, where torch's kernel itself sits near the
    bound (2.1–2.3× the naive error at S = 1023), flash stays within 2× torch's error.
    """
    problems = run_case(case)
    assert not problems, f"{case.label()}:\n  " + "\n  ".join(problems)


# ------------------------------------------------- attnlab's reference = flash-attention's
SEMANTICS = [
    dict(),
    dict(causal=True),
    dict(window=(7, 3)),
    dict(window=(-1, 5)),
    dict(window=(6, -1)),
    dict(window=(4, 4)),
    dict(causal=True, window=(9, -1)),
    dict(softcap=5.0),
    dict(softcap=5.0, causal=True, alibi=True),
    dict(alibi=True),
    dict(alibi=True, causal=True),
    dict(alibi=True, window=(8, 2)),
]


@pytest.mark.parametrize("key_padding", [False, True], ids=["dense", "kpad"])
@pytest.mark.parametrize("heads", [(6, 6), (6, 2), (6, 1)], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize(("L", "S"), [(1, 39), (64, 27), (17, 50)])
def test_reference_equals_flash_attn_semantics(L, S, heads, key_padding):
    """attnlab's float64 reference on the equivalent mask/bias = the restatement (1e-12)."""
    for n, sem in enumerate(SEMANTICS):
        case = Case(
            L, S, 16, torch.float64, heads[0], heads[1], key_padding=key_padding, B=3, seed=n, **sem
        )
        inp = make_inputs(case)
        want = fa_reference(inp.q, inp.k, inp.v, case, inp.lengths, golden=True)
        mask, bias = attnlab_mask_bias(case, inp.lengths)
        got = attnlab.attention(
            inp.q,
            inp.k,
            inp.v,
            mask=mask,
            bias=bias,
            softcap=case.softcap or None,
            backend="reference",
        )
        torch.testing.assert_close(got, want, atol=1e-12, rtol=0, msg=case.label)


# ------------------------------------------------------------------ the default slice
F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16

FIXED = [
    # soft-capping + ALiBi + MQA at L = 1 (dK 9x): per-head logit products (TorchEngine._scores)
    Case(1, 239, 64, F32, 6, 1, window=(-1, 5), softcap=30.0, alibi=True, B=4, seed=4),
    Case(1, 239, 64, F32, 6, 1, softcap=30.0, alibi=True, B=4, seed=12),
    # soft-capping over merged key tiles: lse's rounding error kept through merges
    Case(339, 1023, 256, F32, 6, 6, causal=True, softcap=30.0, key_padding=True, seed=0),
    # ALiBi + window on the C++ band backward (dQ 1.6x torch's): δ of each row's own P·dP
    Case(256, 512, 128, F32, 6, 6, window=(16, 16), alibi=True, B=4, seed=151),
    # window rows with a few keys at L > S, MQA, D = 256 (dQ 5x torch's): the same
    Case(256, 113, 256, F32, 6, 1, window=(16, 16), B=3, seed=21),
    # bfloat16 GQA backward widened (dV 2.4x torch's own error before; within the rule)
    Case(256, 113, 59, BF16, 6, 2, causal=True, seed=0),
    Case(256, 113, 59, BF16, 6, 2, causal=True, key_padding=True, seed=0),
]

DEFAULT = [
    Case(113, 203, 64, F32, 6, 2),
    Case(128, 217, 111, BF16, 6, 6, causal=True),
    Case(108, 256, 32, F16, 6, 1, window=(37, 11)),
    Case(256, 113, 128, F32, 6, 2, causal=True, key_padding=True),
    Case(1, 239, 256, BF16, 6, 2, alibi=True, key_padding=True),
    Case(113, 203, 59, F32, 6, 1, causal=True, alibi=True),
    Case(128, 217, 64, BF16, 6, 2, window=(20, -1), alibi=True),
    Case(108, 256, 128, F32, 4, 1, causal=True, softcap=30.0, alibi=True),
    Case(113, 203, 32, BF16, 4, 4, window=(-1, 5), softcap=30.0, key_padding=True),
    Case(256, 113, 111, F16, 4, 2, softcap=30.0),
    Case(128, 217, 59, F32, 6, 6, causal=True, window=(40, -1), key_padding=True),
    Case(339, 1023, 64, BF16, 6, 2, causal=True, alibi=True),
    Case(1023, 1024, 128, F32, 6, 1, alibi=True),
    Case(1024, 1023, 64, BF16, 6, 2, window=(16, 16), alibi=True, key_padding=True),
    Case(339, 1023, 111, F32, 4, 2, softcap=30.0, window=(37, 11)),
    Case(256, 113, 256, F16, 6, 6, window=(16, 16)),
]


@pytest.mark.parametrize("case", FIXED + DEFAULT, ids=lambda c: c.label())
def test_flash_attn_rule(case):
    check(case)


# ----------------------------------------------------------------------- the full grid
SEQS = [(113, 203), (128, 217), (1, 239), (108, 256), (256, 113), (339, 1023)]
DIMS = [32, 59, 64, 111, 128, 256]
DTYPES = [F32, BF16, F16]
VARIANTS = [
    dict(),
    dict(causal=True),
    dict(window=(37, 11)),
    dict(window=(-1, 5)),
    dict(window=(20, -1)),
    dict(window=(16, 16)),
    dict(causal=True, window=(40, -1)),
    dict(softcap=30.0),
    dict(softcap=30.0, causal=True),
    dict(softcap=30.0, window=(37, 11)),
    dict(softcap=30.0, alibi=True),
    dict(alibi=True),
    dict(alibi=True, causal=True),
    dict(alibi=True, window=(16, 16)),
]
HEADS = [(6, 6), (6, 2), (6, 1)]
POINTS = 3  # (lengths, head dim, dtype) points per variant × heads × padding


def full_grid() -> list[Case]:
    """Every variant × heads × padding, each with `POINTS` (lengths, head dim, dtype) points
    taken in turn: each variant meets every pair of lengths and dtype (6 × 3 = 18 = 6 × POINTS)
    and every head dim (a covering design of 14 · 3 · 2 · 3 = 252 cases; the full product is
    6·6·3·14·3·2 = 9072). Soft-capped cases use 4 heads, as flash-attention does (H_kv 4, 2,
    1). The 1023/1024-position pairs are in the default slice (float32, bfloat16): their
    float16 naive runs alone take 15–20 s each on a CPU without float16 products."""
    cases = []
    combos = itertools.product(VARIANTS, HEADS, (False, True))
    for n, (variant, (H, Hk), pad) in enumerate(combos):
        if variant.get("softcap"):
            H, Hk = 4, {6: 4, 2: 2, 1: 1}[Hk]
        for m in range(POINTS):
            t = POINTS * n + m
            L, S = SEQS[t % len(SEQS)]
            dtype = DTYPES[(t // len(SEQS)) % len(DTYPES)]
            D = DIMS[(t * 5) % len(DIMS)]
            cases.append(Case(L, S, D, dtype, H, Hk, key_padding=pad, **variant))
    return cases


@pytest.mark.slow
@pytest.mark.parametrize("case", full_grid(), ids=lambda c: c.label())
def test_flash_attn_rule_grid(case):
    check(case)
