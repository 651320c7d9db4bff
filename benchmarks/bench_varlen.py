"""Packed variable-length attention against padding to the longest sequence.

16 sequences with lengths drawn from 64…4096 (seeded; total ≈ 32K tokens), H=8, D=64, causal,
float32 and bfloat16: ``attnlab.functional.varlen_attn`` on the packed ``(T, H, D)`` tensors
against the usual workaround — pad every sequence to the longest and run
``torch.nn.functional.scaled_dot_product_attention`` with a bool mask (causal & key padding).
Forward, and forward + backward, interleaved medians in one run. Target: varlen >= 3x faster in
both (it computes each sequence's causal triangle only; the padded run computes 16 × 4096² × ½
and more).

Also the peak growth of live tensors of each forward (`common.peak_tensor_growth`): varlen's is
O(T) (output, lse, the per-sequence transposes), the padded run's holds the padded copies and
the (16, 1, 4096, 4096) mask.

Run: python benchmarks/bench_varlen.py [--repeats 5] [--dtypes float32 bfloat16] [--small]
     (``--small``: 4 sequences of 17…300 tokens, to check the script runs)
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from attnlab.functional import varlen_attn
from common import interleaved_medians, peak_tensor_growth, print_machine

H, D = 8, 64


def lengths(n: int, lo: int, hi: int, seed: int = 0) -> list[int]:
    """``n`` lengths uniform in ``[lo, hi]`` (seeded), the longest set to ``hi``."""
    g = torch.Generator().manual_seed(seed)
    out = torch.randint(lo, hi + 1, (n,), generator=g).tolist()
    out[0] = hi
    return out


def padded_inputs(q, k, v, lens):
    """``(qp, kp, vp (N, H, Lmax, D), mask (N, 1, Lmax, Lmax) bool)`` from the packed tensors."""
    N, Lmax = len(lens), max(lens)
    cu = [0, *torch.tensor(lens).cumsum(0).tolist()]
    pads = []
    for x in (q, k, v):
        p = x.new_zeros(N, Lmax, H, D)
        for b in range(N):
            p[b, : lens[b]] = x[cu[b] : cu[b + 1]]
        pads.append(p.transpose(1, 2).contiguous().requires_grad_())  # (N, H, Lmax, D)
    real = torch.arange(Lmax) < torch.tensor(lens).view(-1, 1)  # (N, Lmax)
    causal = torch.ones(Lmax, Lmax, dtype=torch.bool).tril()
    mask = causal & real[:, None, None, :]  # (N, 1, Lmax, Lmax)
    return (*pads, mask)


def run(dtype: torch.dtype, lens: list[int], repeats: int) -> None:
    T = sum(lens)
    torch.manual_seed(0)
    q, k, v = (torch.randn(T, H, D, dtype=dtype).requires_grad_() for _ in range(3))
    cu = torch.tensor([0, *lens]).cumsum(0).to(torch.int32)
    m = max(lens)
    qp, kp, vp, mask = padded_inputs(q.detach(), k.detach(), v.detach(), lens)

    def varlen_fwd():
        with torch.no_grad():
            return varlen_attn(q, k, v, cu, cu, m, m, window_size=(-1, 0))

    def padded_fwd():
        with torch.no_grad():
            return F.scaled_dot_product_attention(qp, kp, vp, attn_mask=mask)

    def varlen_step():
        varlen_attn(q, k, v, cu, cu, m, m, window_size=(-1, 0)).sum().backward()

    def padded_step():
        F.scaled_dot_product_attention(qp, kp, vp, attn_mask=mask).sum().backward()

    # the same numbers on the real rows
    out = varlen_fwd()
    ref = padded_fwd().transpose(1, 2)  # (N, Lmax, H, D)
    ref = torch.cat([ref[b, : lens[b]] for b in range(len(lens))])
    err = (out.float() - ref.float()).abs().max().item()
    times = interleaved_medians(
        {
            "varlen": varlen_fwd,
            "padded": padded_fwd,
            "varlen+bwd": varlen_step,
            "padded+bwd": padded_step,
        },
        repeats,
    )
    name = str(dtype).removeprefix("torch.")
    print(f"\n{name}: T = {T}, longest {m}, max |varlen − padded| = {err:.2e}")
    for a, b in (("varlen", "padded"), ("varlen+bwd", "padded+bwd")):
        ratio = times[b] / times[a]
        verdict = "PASS" if ratio >= 3 else "FAIL"
        print(
            f"  {b:>11} {times[b] * 1e3:9.1f} ms   {a:>11} {times[a] * 1e3:9.1f} ms   "
            f"{ratio:5.2f}x (target >= 3x: {verdict})"
        )
    mem_v, mem_p = peak_tensor_growth(varlen_fwd), peak_tensor_growth(padded_fwd)
    print(
        f"  peak tensor growth, forward: varlen {mem_v / 2**20:.1f} MiB "
        f"({mem_v / (T * H * D * q.element_size()):.1f}× q), padded {mem_p / 2**20:.1f} MiB"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--small", action="store_true", help="4 sequences of 17…300: a quick check")
    args = ap.parse_args()
    dtypes = tuple(getattr(torch, d) for d in args.dtypes)
    print_machine(dtypes)
    lens = lengths(4, 17, 300) if args.small else lengths(16, 64, 4096)
    for dtype in dtypes:
        run(dtype, lens, args.repeats)


if __name__ == "__main__":
    main()
