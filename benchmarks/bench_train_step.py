"""A training step users would run: GPT forward + backward + AdamW, attnlab against torch SDPA.

The README's GPT (`attnlab train`'s defaults: d_model 128, 4 layers, 4 heads, RoPE, B = 16,
L = 128) and the same model at 4× the context on packed documents (``masks.document(ids)``:
each token attends earlier tokens of its own document; document lengths drawn between L/8 and
L/2), in float32, eager and compiled (``torch.compile``, Inductor), for two attention backends
of the same model and weights:

- ``attnlab``: `attnlab.attention` with ``backend="auto"`` (flash's kernels for documents);
- ``sdpa``: the same calls on torch's ``scaled_dot_product_attention`` (``backend="sdpa"``):
  causal for the plain step, the document mask as the dense ``(B, 1, L, L)`` boolean mask SDPA
  takes (`attnlab.masks.from_tensor` of its rendering).

Prints tokens/s (median of ``--steps`` steps after ``--warmup``) and attnlab's speed over sdpa,
after the CPU header with the fp32 matmul rate. FlexAttention has no CPU backward (torch 2.13),
so it is not a training contender here.

Run: python benchmarks/bench_train_step.py [--contexts 128 512] [--batch 16] [--steps 5]
     [--warmup 2] [--no-compile]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from common import print_machine

BACKENDS = {"sdpa": "sdpa", "attnlab": "auto"}
"""Contender -> the model's ``attn_backend``."""


def document_ids(B: int, L: int, g: torch.Generator) -> torch.Tensor:
    """``(B, L)`` document ids of packed documents with lengths between L/8 and L/2."""
    rows = []
    for _ in range(B):
        lengths: list[int] = []
        while sum(lengths) < L:
            lengths.append(int(torch.randint(L // 8, L // 2 + 1, (1,), generator=g)))
        ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
        rows.append(ids[:L])
    return torch.stack(rows)


def step_time(backend: str, L: int, docs: bool, args) -> float:
    """Median seconds of one forward + backward + AdamW step."""
    from attnlab import masks
    from attnlab.models import GPT, TransformerConfig

    torch.manual_seed(0)
    cfg = TransformerConfig(
        vocab_size=256, d_model=128, n_layers=4, n_heads=4, max_seq_len=L, attn_backend=backend
    )
    model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(L)
    x = torch.randint(0, 256, (args.batch, L + 1), generator=g)
    idx, target = x[:, :-1], x[:, 1:]
    mask = None
    if docs:
        mask = masks.document(document_ids(args.batch, L, g))
        if backend == "sdpa":  # what SDPA takes: the dense mask
            dense = (masks.causal() & mask).to_dense(L, L, batch=args.batch)
            mask = masks.from_tensor(dense)

    def loss_of(idx: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        logits = model(idx, mask=mask)
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten())

    run = loss_of if args.no_compile else torch.compile(loss_of)
    times = []
    for i in range(args.warmup + args.steps):
        t0 = time.perf_counter()
        loss = run(idx, target)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[128, 512])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--no-compile", action="store_true", help="eager steps only")
    args = parser.parse_args()
    print_machine()
    modes = ["eager"] if args.no_compile else ["eager", "compiled"]
    for mode in modes:
        args_mode = argparse.Namespace(**{**vars(args), "no_compile": mode == "eager"})
        for L in args.contexts:
            docs = args.contexts[0] != L  # the default context plain, longer ones packed
            what = "packed documents" if docs else "causal"
            secs = {b: step_time(BACKENDS[b], L, docs, args_mode) for b in BACKENDS}
            for backend, s in secs.items():
                rate = args.batch * L / s
                ratio = f"speed {secs['sdpa'] / s:.2f}× sdpa's" if backend == "attnlab" else ""
                print(
                    f"{mode:<8} L={L:<5} {what:<16} {backend:<8} {s:7.3f} s/step "
                    f"{rate:9.0f} tokens/s  {ratio}"
                )


if __name__ == "__main__":
    main()
