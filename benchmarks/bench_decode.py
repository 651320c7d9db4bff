"""How much does the KV cache save when a GPT generates text?

Generates 512 new tokens after a 512-token prompt with `GPT.generate`, once with one `KVCache` per
layer (prefill once, then one token per forward pass) and once recomputing the whole context for
every token, side by side in one run; checks that both produce the same tokens, and prints the
ratio (target >= 10x) plus the machine's fp32 matmul rate as the physical limit.

Run: python benchmarks/bench_decode.py [--prompt 512] [--new 512] [--repeats 3] [--threads N]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from attnlab.models import GPT, TransformerConfig
from common import matmul_gflops


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt", type=int, default=512, help="prompt tokens (default 512)")
    parser.add_argument("--new", type=int, default=512, help="generated tokens (default 512)")
    parser.add_argument(
        "--repeats", type=int, default=3, help="cached runs (median); uncached runs once"
    )
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's choice)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    cfg = TransformerConfig(
        vocab_size=256,
        d_model=256,
        n_layers=4,
        n_heads=8,
        n_kv_heads=2,
        max_seq_len=args.prompt + args.new,
        positional="rope",
    )
    model = GPT(cfg).eval()
    n_params = sum(p.numel() for p in model.parameters())
    prompt = torch.randint(0, cfg.vocab_size, (1, args.prompt))
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"load average (1 min) at start: {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs")
    print(f"fp32 matmul rate (torch.mm 2048²): {matmul_gflops():.1f} GFLOP/s")
    print(
        f"GPT: d_model={cfg.d_model}, n_layers={cfg.n_layers}, "
        f"heads {cfg.n_heads}/{cfg.n_kv_heads} (GQA), RoPE, {n_params / 1e6:.2f}M parameters; "
        "greedy decoding, batch 1\n"
    )

    def run(use_cache: bool) -> torch.Tensor:
        return model.generate(prompt, args.new, top_k=1, use_cache=use_cache)

    model.generate(prompt[:, :16], 4, top_k=1)  # warm-up
    cached_times: list[float] = []
    out_cached = out_recomputed = None
    # Interleaved: cached, recomputed, cached, cached, ... so machine drift hits both.
    for i in range(max(1, args.repeats)):
        t0 = time.perf_counter()
        out_cached = run(True)
        cached_times.append(time.perf_counter() - t0)
        if i == 0:
            t0 = time.perf_counter()
            out_recomputed = run(False)
            recomputed = time.perf_counter() - t0
    cached = statistics.median(cached_times)
    same = torch.equal(out_cached, out_recomputed)
    print(f"{'mode':<34} {'seconds':>9} {'new tokens/s':>13}")
    print(f"{'KV cache (prefill + 1 token/step)':<34} {cached:9.2f} {args.new / cached:13.1f}")
    print(
        f"{'recompute the context every step':<34} {recomputed:9.2f} {args.new / recomputed:13.1f}"
    )
    print(f"\nspeed-up of the cache: {recomputed / cached:.1f}x (target >= 10x)")
    print(f"identical tokens: {same}")


if __name__ == "__main__":
    main()
