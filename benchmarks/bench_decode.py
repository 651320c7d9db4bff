"""How much does the KV cache save when a GPT generates text, and what does attnlab's decode step
cost over a hand-written one?

Case ``generate``: generates 512 new tokens after a 512-token prompt with `GPT.generate`, once with
one `KVCache` per layer (prefill once, then one token per forward pass) and once recomputing the
whole context for every token, side by side in one run; checks that both produce the same tokens,
and prints the ratio (target >= 10x).

Case ``step``: one attention layer decoding token by token against a cache of ``--prompt`` tokens:
`MultiHeadAttention` + `KVCache` (GQA, RoPE) against a hand-written module doing the same work with
torch's SDPA — the same fused QKV and output projections (shared weights), the same pre-RoPE cache
in a preallocated buffer with every cached key re-rotated at each step (rotate-half RoPE from a
table computed once), the same GQA kernel call. It checks that both give the same outputs and
prints the per-step times and their ratio (target <= 1.1x). The other pairing is measured too:
`MultiHeadAttention` + ``KVCache(rotate_at_insert=True)`` (keys rotated once, when cached: less
work, correct for static RoPE without eviction) against a hand-written rotate-at-insert layer;
both ratios are printed. ``--ext-ab`` adds the module with attnlab's C++ operators switched off
(``ATTNLAB_EXT=0``: the pure-PyTorch path, as on a machine without a compiler) to the same rounds.

Both print the CPU model and the fp32 matmul rate (the physical limit).

Run: python benchmarks/bench_decode.py [--case all|generate|step] [--prompt 512] [--new 512]
     [--steps 64] [--repeats 3] [--threads N] [--clock wall|cpu] [--stat median|min] [--ext-ab]

On a shared machine ``--clock cpu`` times the step case in this process's CPU time
(``time.process_time``; with ``--threads 1`` the uncontended time) and ``--stat min`` reports the
best interleaved run.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import attnlab
from attnlab import attention, masks
from attnlab.models import GPT, TransformerConfig
from attnlab.modules import KVCache, MultiHeadAttention
from attnlab.positional import RoPE
from common import print_machine


def generate_case(args: argparse.Namespace) -> None:
    """GPT.generate with and without KV caches."""
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
    print(
        f"GPT: d_model={cfg.d_model}, n_layers={cfg.n_layers}, "
        f"heads {cfg.n_heads}/{cfg.n_kv_heads} (GQA), RoPE, {n_params / 1e6:.2f}M parameters; "
        f"greedy decoding, batch 1, {args.prompt}-token prompt, {args.new} new tokens\n"
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


class HandDecoder(nn.Module):
    """One attention layer with a preallocated cache, written directly against torch's SDPA.

    Shares the projection weights of ``mha``. ``rotate_at_insert=False`` stores keys before RoPE
    and re-rotates all of them at each step (what `MultiHeadAttention` + `KVCache` do);
    ``True`` stores rotated keys and rotates only the new ones.
    """

    def __init__(
        self,
        mha: MultiHeadAttention,
        rope: RoPE,
        capacity: int,
        batch: int,
        rotate_at_insert: bool,
        attnlab_kernel: bool = False,
        backend: str = "auto",
    ) -> None:
        super().__init__()
        self.mha, self.rotate_at_insert = mha, rotate_at_insert
        self.attnlab_kernel, self.backend = attnlab_kernel, backend
        self.H, self.H_kv, self.D = mha.num_heads, mha.num_kv_heads, mha.head_dim
        inv_freq, scale = rope.frequencies()
        angle = torch.arange(capacity, dtype=torch.float64)[:, None] * inv_freq  # (N, D/2)
        self.cos = (angle.cos() * scale).float()  # (N, D/2)
        self.sin = (angle.sin() * scale).float()
        self.k = torch.zeros(batch, self.H_kv, capacity, self.D)
        self.v = torch.zeros(batch, self.H_kv, capacity, self.D)
        self.n = 0

    @staticmethod
    def rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """Rotate-half RoPE of x ``(B, n, T, D)`` with tables ``(T, D/2)``."""
        a, b = x.chunk(2, dim=-1)
        return torch.cat((a * cos - b * sin, b * cos + a * sin), dim=-1)

    def forward(self, x: Tensor) -> Tensor:
        """``(B, T, E) -> (B, T, E)``: append T tokens and attend (causal within them)."""
        B, T, _ = x.shape
        H, H_kv, D, n = self.H, self.H_kv, self.D, self.n
        qkv = self.mha.qkv_proj(x)  # (B, T, (H + 2 H_kv) D)
        q, k, v = qkv.split([H * D, H_kv * D, H_kv * D], dim=-1)
        q = q.view(B, T, H, D).transpose(1, 2)  # (B, H, T, D)
        k = k.view(B, T, H_kv, D).transpose(1, 2)  # (B, H_kv, T, D)
        v = v.view(B, T, H_kv, D).transpose(1, 2)
        cos, sin = self.cos[n : n + T], self.sin[n : n + T]
        q = self.rotate(q, cos, sin)
        if self.rotate_at_insert:
            k = self.rotate(k, cos, sin)
        self.k[:, :, n : n + T] = k
        self.v[:, :, n : n + T] = v
        self.n = n = n + T
        keys = self.k[:, :, :n]
        if not self.rotate_at_insert:
            keys = self.rotate(keys, self.cos[:n], self.sin[:n])  # (B, H_kv, n, D)
        mask = None
        if T > 1:
            mask = torch.ones(T, n, dtype=torch.bool).tril(n - T)  # bottom-right causal
        if self.attnlab_kernel:  # isolates the module's own overhead from the kernel's
            o = attention(q, keys, self.v[:, :, :n], mask=mask, backend=self.backend)
        else:
            o = F.scaled_dot_product_attention(
                q, keys, self.v[:, :, :n], attn_mask=mask, enable_gqa=True
            )  # (B, H, T, D)
        return self.mha.out_proj(o.transpose(1, 2).reshape(B, T, H * D))  # (B, T, E)


def step_case(args: argparse.Namespace) -> None:
    """MultiHeadAttention + KVCache decode steps against the hand-written SDPA layer."""
    torch.manual_seed(0)
    E, H, H_kv, B = 256, 8, 2, 1
    rope = RoPE(E // H)
    mha = MultiHeadAttention(E, H, num_kv_heads=H_kv, rope=rope, backend=args.backend).eval()
    capacity = args.prompt + args.steps
    x = torch.randn(B, capacity, E)
    print(
        f"decode step: E={E}, heads {H}/{H_kv} (GQA), D={E // H}, RoPE, batch {B}, fp32, "
        f"{args.steps} steps after a {args.prompt}-token prompt (cache {args.prompt}.."
        f"{capacity}); backend={args.backend!r}; {args.stat} of {args.repeats} interleaved runs, "
        f"{args.clock} clock\n"
    )

    clock = time.process_time if args.clock == "cpu" else time.perf_counter

    def attnlab_run(rotate_at_insert: bool = False, ext: bool = True) -> tuple[float, Tensor]:
        os.environ["ATTNLAB_EXT"] = "auto" if ext else "0"
        attnlab.refresh_settings()  # read once per process: read again after the change
        cache = KVCache(capacity, rotate_at_insert=rotate_at_insert)
        mha(x[:, : args.prompt], mask=masks.causal(), cache=cache)
        outs = []
        t0 = clock()
        for t in range(args.prompt, capacity):
            outs.append(mha(x[:, t : t + 1], cache=cache))
        elapsed = clock() - t0
        os.environ["ATTNLAB_EXT"] = "auto"
        attnlab.refresh_settings()
        return elapsed, torch.cat(outs, dim=1)

    def hand_run(rotate_at_insert: bool, attnlab_kernel: bool = False) -> tuple[float, Tensor]:
        layer = HandDecoder(mha, rope, capacity, B, rotate_at_insert, attnlab_kernel, args.backend)
        layer(x[:, : args.prompt])
        outs = []
        t0 = clock()
        for t in range(args.prompt, capacity):
            outs.append(layer(x[:, t : t + 1]))
        return clock() - t0, torch.cat(outs, dim=1)

    runs = {
        "attnlab MHA + KVCache (re-rotate)": attnlab_run,
        "hand-written SDPA (re-rotate)": lambda: hand_run(False),
        "attnlab MHA + KVCache (rotate at insert)": lambda: attnlab_run(True),
        "hand-written SDPA (rotate at insert)": lambda: hand_run(True),
        "hand-written, attnlab.attention kernel": lambda: hand_run(False, True),
    }
    if args.ext_ab:
        runs["attnlab MHA + KVCache (re-rotate), no C++"] = lambda: attnlab_run(ext=False)
    with torch.inference_mode():
        outs = {name: fn()[1] for name, fn in runs.items()}  # warm-up, and the outputs
        times: dict[str, list[float]] = {name: [] for name in runs}
        for _ in range(max(1, args.repeats)):
            for name, fn in runs.items():
                times[name].append(fn()[0])
    ref = outs["hand-written SDPA (re-rotate)"]
    print(f"{'implementation':<42} {'µs/step':>9} {'vs hand re-rotate':>18} {'max |diff|':>11}")
    pick = min if args.stat == "min" else statistics.median
    per_step = {name: pick(ts) / args.steps for name, ts in times.items()}
    base = per_step["hand-written SDPA (re-rotate)"]
    for name, s in per_step.items():
        diff = (outs[name] - ref).abs().max().item()
        print(f"{name:<42} {s * 1e6:9.1f} {s / base:17.3f}x {diff:11.2e}")
    ours = per_step["attnlab MHA + KVCache (re-rotate)"]
    kernel = per_step["hand-written, attnlab.attention kernel"]
    insert = per_step["attnlab MHA + KVCache (rotate at insert)"]
    hand_insert = per_step["hand-written SDPA (rotate at insert)"]
    print(f"\nattnlab / hand-written, same work (re-rotate): {ours / base:.3f}x (target <= 1.1x)")
    print(
        f"attnlab / hand-written, same work (rotate at insert): {insert / hand_insert:.3f}x "
        "(target <= 1.1x)"
    )
    if args.ext_ab:
        off = per_step["attnlab MHA + KVCache (re-rotate), no C++"]
        print(f"without attnlab's C++ operators (re-rotate): {off / base:.3f}x")
    print(
        f"  module + cache + RoPE overhead (both on attnlab.attention): {ours / kernel:.3f}x; "
        f"attnlab.attention vs F.sdpa (NaN rule included): {kernel / base:.3f}x"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", choices=("all", "generate", "step"), default="all")
    parser.add_argument("--prompt", type=int, default=512, help="prompt tokens (default 512)")
    parser.add_argument("--new", type=int, default=512, help="generated tokens (default 512)")
    parser.add_argument("--steps", type=int, default=64, help="decode steps timed in `step`")
    parser.add_argument("--backend", default="auto", help="attnlab backend in `step`")
    parser.add_argument(
        "--repeats", type=int, default=3, help="timed runs (median); uncached generate runs once"
    )
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's choice)")
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall", help="step timer")
    parser.add_argument("--stat", choices=("median", "min"), default="median", help="step stat")
    parser.add_argument(
        "--ext-ab", action="store_true", help="also time the module without the C++ operators"
    )
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print_machine()
    print(f"load average (1 min) at start: {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs\n")
    if args.case in ("all", "step"):
        step_case(args)
        print()
    if args.case in ("all", "generate"):
        generate_case(args)


if __name__ == "__main__":
    main()
