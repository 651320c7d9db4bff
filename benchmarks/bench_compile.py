"""What does Inductor (``torch.compile``'s default compiler) buy on attnlab's CPU paths?

Case ``train``: one GPT training step — forward, cross-entropy, backward, AdamW step — at
d_model 256, 4 layers, 4 heads, context 256, batch 16 (vocabulary 256, RoPE, attn_backend
"auto"), eager against ``torch.compile(model, fullgraph=True)`` (Inductor; the loss and AdamW
run eagerly in both). Two copies of one initialisation step in interleaved rounds; the first
losses are checked to agree. Prints both medians and eager/compiled (target >= 1.2x).

Case ``attention``: forward + backward of `attnlab.attention` (B=1, H=8, D=64, float32) on
backends "flash" and "sdpa", masks causal and sliding_window(256), at L = 4096 and 16384,
eager against ``torch.compile(..., fullgraph=True)`` of the same call (compiled/eager, target
<= 1.05x: the kernels are the same, the graph must not add copies around them).

Both print the CPU model, its flags of interest and the fp32 matmul rate (the physical limit).

Run: python benchmarks/bench_compile.py [--case all|train|attention] [--repeats 5]
     [--lengths 4096 16384] [--threads N]
"""

from __future__ import annotations

import argparse
import copy
import time

import torch
import torch._dynamo as dynamo
import torch.nn.functional as F

from attnlab import attention, masks
from attnlab.models import GPT, TransformerConfig
from common import cpu_flags, interleaved_medians, print_machine, timed

FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16")


def _train_step(fwd, opt, idx, tgt) -> torch.Tensor:
    opt.zero_grad(set_to_none=True)
    logits = fwd(idx)
    loss = F.cross_entropy(logits.flatten(0, 1), tgt.flatten())
    loss.backward()
    opt.step()
    return loss.detach()


def train_case(args: argparse.Namespace) -> None:
    cfg = TransformerConfig(
        vocab_size=256, d_model=256, n_layers=4, n_heads=4, max_seq_len=256, positional="rope"
    )
    torch.manual_seed(0)
    eager = GPT(cfg).train()
    comp = copy.deepcopy(eager)
    g = torch.Generator().manual_seed(1)
    idx = torch.randint(0, 256, (16, 256), generator=g)
    tgt = torch.randint(0, 256, (16, 256), generator=g)
    opt_e = torch.optim.AdamW(eager.parameters(), lr=1e-4)
    opt_c = torch.optim.AdamW(comp.parameters(), lr=1e-4)
    dynamo.reset()
    compiled = torch.compile(comp, fullgraph=True)
    t0 = time.perf_counter()
    loss_c = _train_step(compiled, opt_c, idx, tgt)
    first = time.perf_counter() - t0
    loss_e = _train_step(eager, opt_e, idx, tgt)
    assert torch.allclose(loss_c, loss_e, rtol=1e-5, atol=1e-5), (loss_c, loss_e)
    med = interleaved_medians(
        {
            "eager": lambda: _train_step(eager, opt_e, idx, tgt),
            "compiled": lambda: _train_step(compiled, opt_c, idx, tgt),
        },
        args.repeats,
    )
    n = sum(p.numel() for p in eager.parameters())
    print(
        f"\n[train] GPT d_model 256, 4 layers, 4 heads, context 256, batch 16, "
        f"{n / 1e6:.2f}M parameters, AdamW; first compiled step (compile + run) {first:.1f} s; "
        f"first losses eager {loss_e.item():.6f}, compiled {loss_c.item():.6f}"
    )
    print(f"eager step    {med['eager'] * 1e3:9.1f} ms (median of {args.repeats})")
    print(f"compiled step {med['compiled'] * 1e3:9.1f} ms")
    print(f"eager / compiled = {med['eager'] / med['compiled']:.2f}x (target >= 1.2x)")


def _fwd_bwd(fn, q, k, v, dout) -> None:
    for t in (q, k, v):
        t.grad = None
    out = fn(q, k, v)
    out.backward(dout)


def attention_case(args: argparse.Namespace) -> None:
    print(
        "\n[attention] forward + backward of attnlab.attention, B=1, H=8, D=64, float32; "
        "median seconds, compiled/eager (target <= 1.05x)"
    )
    print(f"{'L':>6} {'mask':>16} {'backend':>7} {'eager s':>9} {'compiled s':>10} {'ratio':>6}")
    for L in args.lengths:
        g = torch.Generator().manual_seed(L)
        q, k, v = (torch.randn(1, 8, L, 64, generator=g).requires_grad_(True) for _ in range(3))
        dout = torch.randn(1, 8, L, 64, generator=g)
        for mask_name, make in (
            ("causal", masks.causal),
            ("sliding_window256", lambda: masks.sliding_window(256)),
        ):
            for backend in ("flash", "sdpa"):
                # the largest dense cases take ~10 s a call on 2 cores: fewer rounds there
                big = L > 4096 and mask_name != "causal"
                reps = max(1, args.repeats // 2) if big else args.repeats
                eager, compiled = _attention_pair(make, backend, q, k, v, dout, reps)
                print(
                    f"{L:>6} {mask_name:>16} {backend:>7} {eager:9.3f} "
                    f"{compiled:10.3f} {compiled / eager:6.2f}",
                    flush=True,
                )


def _attention_pair(make, backend: str, q, k, v, dout, repeats: int) -> tuple[float, float]:
    """Median seconds of eager and compiled forward + backward of one attention call."""

    def call(q, k, v):
        return attention(q, k, v, mask=make(), backend=backend)

    dynamo.reset()  # one static graph per case
    compiled = torch.compile(call, fullgraph=True)
    timed(lambda: _fwd_bwd(compiled, q, k, v, dout))  # compile
    med = interleaved_medians(
        {
            "eager": lambda: _fwd_bwd(call, q, k, v, dout),
            "compiled": lambda: _fwd_bwd(compiled, q, k, v, dout),
        },
        repeats,
    )
    return med["eager"], med["compiled"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--case", choices=["all", "train", "attention"], default="all")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--lengths", type=int, nargs="+", default=[4096, 16384])
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print_machine()
    flags = cpu_flags()
    print("CPU flags: " + ", ".join(f"{f} {'yes' if f in flags else 'no'}" for f in FLAGS))
    if args.case in ("all", "train"):
        train_case(args)
    if args.case in ("all", "attention"):
        attention_case(args)


if __name__ == "__main__":
    main()
