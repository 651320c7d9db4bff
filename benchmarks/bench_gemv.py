"""A decode step's linear layers: attnlab's streaming kernel against torch's, side by side.

The weights of a Llama-like model (default: the 55M-parameter model of bench_generate_hf.py:
8 layers of fused QKV 512 → 768, output 512 → 512, gate and up 512 → 1368, down 1368 → 512,
and the 512 → 32000 head) are applied in turn to M = 1, 4 and 8 rows, as one decode step does;
each pass is timed for ``torch.nn.functional.linear`` and ``attnlab.functional.gemv.linear``
(the operator directly: no routing rule) in interleaved rounds. With a few rows the product is
bound by reading the weights, so the rates are printed as GB/s of weight read per second beside
the physical limit, one streaming read of the same bytes (``Tensor.sum`` over every weight),
and the matmul rate of the dtype.

Run: python benchmarks/bench_gemv.py [--threads 1] [--rounds 9] [--rows 1 4 8]
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from attnlab import _ext
from attnlab.functional import gemv
from common import interleaved_medians, print_machine


def shapes(layers: int, d_model: int, qkv: int, d_ff: int, vocab: int) -> list[tuple[int, int]]:
    """``(out, in)`` of every weight of one decode step."""
    per_layer = [(qkv, d_model), (d_model, d_model), (d_ff, d_model), (d_ff, d_model)]
    return per_layer * layers + [(d_model, d_ff)] * layers + [(vocab, d_model)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--d-model", type=int, default=512)
    parser.add_argument("--qkv", type=int, default=768)
    parser.add_argument("--d-ff", type=int, default=1368)
    parser.add_argument("--vocab", type=int, default=32000)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if not _ext.load(gemv.EXT, wait=True):
        raise SystemExit(f"attnlab's gemv extension is unavailable: {_ext.status(gemv.EXT)}")
    dtypes = (torch.float32, torch.bfloat16)
    print_machine(dtypes)
    dims = shapes(args.layers, args.d_model, args.qkv, args.d_ff, args.vocab)
    print(
        f"{len(dims)} weights per step ({sum(n * k for n, k in dims) / 1e6:.1f}M parameters); "
        f"min of {args.rounds} interleaved rounds, wall clock; weight rows per pass: "
        + ", ".join(
            f"{d} {gemv.rows_per_pass() or torch.ops.attnlab_gemv.default_rows_per_pass(d)}"
            for d in dtypes
        )
        + f" ({gemv.ROWS_ENV}={gemv.rows_per_pass() or 'auto'})\n"
    )
    print(
        f"{'dtype':<9} {'rows':>4} {'torch ms':>9} {'GB/s':>6} {'attnlab ms':>11} {'GB/s':>6} "
        f"{'speed-up':>8} {'stream read GB/s':>17}"
    )
    op = torch.ops.attnlab_gemv.linear
    per_pass = gemv.rows_per_pass()
    for dtype in dtypes:
        if not torch.ops.attnlab_gemv.supported(dtype):
            print(f"{dtype!s:<9} no kernel on this CPU")
            continue
        gen = torch.Generator().manual_seed(0)
        weights = [torch.randn(n, k, generator=gen).mul_(0.05).to(dtype) for n, k in dims]
        gb = sum(w.numel() for w in weights) * weights[0].element_size() / 1e9
        stream = interleaved_medians(
            {"sum": lambda ws=weights: [w.sum() for w in ws]}, args.rounds, stat="min"
        )["sum"]
        for M in args.rows:
            xs = {k: torch.randn(M, k, generator=gen).to(dtype) for k in {k for _, k in dims}}

            def run(f, ws=weights, xs=xs) -> None:
                for w in ws:
                    f(xs[w.shape[1]], w)

            with torch.inference_mode():
                for w in weights[:5]:  # the same product, up to the order of the float32 sums
                    x = xs[w.shape[1]]
                    torch.testing.assert_close(
                        op(x, w, None, per_pass), F.linear(x, w), rtol=2e-2, atol=2e-2
                    )
                t = interleaved_medians(
                    {
                        "torch": lambda: run(F.linear),
                        "attnlab": lambda: run(lambda r, weight: op(r, weight, None, per_pass)),
                    },
                    args.rounds,
                    stat="min",
                )
            print(
                f"{str(dtype).removeprefix('torch.'):<9} {M:>4} {t['torch'] * 1e3:9.2f} "
                f"{gb / t['torch']:6.1f} {t['attnlab'] * 1e3:11.2f} {gb / t['attnlab']:6.1f} "
                f"{t['torch'] / t['attnlab']:7.2f}× {gb / stream:17.1f}"
            )


if __name__ == "__main__":
    main()
