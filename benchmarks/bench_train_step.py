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

Prints tokens/s (median of ``--steps`` steps after ``--warmup``), the peak memory of one step
(live tensors above those at its start, from torch's profiler: `common.peak_tensor_growth`) and
attnlab's speed over sdpa, after the CPU header with the fp32 matmul rate. FlexAttention has no
CPU backward (torch 2.13), so it is not a training contender; the compiled forward without
gradient (inference) is timed for sdpa, FlexAttention (the model's attention calls replaced by
compiled ``flex_attention`` on the BlockMask of the same mask) and attnlab.

Run: python benchmarks/bench_train_step.py [--contexts 128 512] [--batch 16] [--steps 5]
     [--warmup 2] [--no-compile]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from common import peak_tensor_growth, print_machine

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


def _setup(backend: str, L: int, docs: bool, args):
    """``(model, idx, target, mask)``: the GPT for ``backend`` (same weights for every contender)
    and one batch; ``mask`` is the document mask (dense for sdpa), None for plain causal."""
    from attnlab import masks
    from attnlab.models import GPT, TransformerConfig

    torch.manual_seed(0)
    cfg = TransformerConfig(
        vocab_size=256, d_model=128, n_layers=4, n_heads=4, max_seq_len=L, attn_backend=backend
    )
    model = GPT(cfg)
    g = torch.Generator().manual_seed(L)
    x = torch.randint(0, 256, (args.batch, L + 1), generator=g)
    mask = None
    if docs:
        mask = masks.document(document_ids(args.batch, L, g))
        if backend == "sdpa":  # what SDPA takes: the dense mask
            dense = (masks.causal() & mask).to_dense(L, L, batch=args.batch)
            mask = masks.from_tensor(dense)
    return model, x[:, :-1], x[:, 1:], mask


def step_time(backend: str, L: int, docs: bool, args) -> tuple[float, int]:
    """Median seconds of one forward + backward + AdamW step, and the peak memory of one more
    step: bytes of live tensors above those at its start (`common.peak_tensor_growth`)."""
    model, idx, target, mask = _setup(backend, L, docs, args)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)

    def loss_of(idx: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        logits = model(idx, mask=mask)
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten())

    run = loss_of if args.no_compile else torch.compile(loss_of)

    def step() -> None:
        run(idx, target).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    times = []
    for i in range(args.warmup + args.steps):
        t0 = time.perf_counter()
        step()
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
    return statistics.median(times), peak_tensor_growth(step)


def forward_time(contender: str, L: int, docs: bool, args) -> float:
    """Median seconds of one compiled forward without gradient (inference). ``contender``:
    "attnlab", "sdpa" (the dense document mask), or "flex": the same model with its attention
    calls replaced by compiled FlexAttention on the BlockMask of the same mask
    (``Mask.mask_mod``), which has a CPU forward but no CPU backward in torch 2.13."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    from attnlab import masks
    from attnlab.modules import mha

    model, idx, _, mask = _setup(BACKENDS.get(contender, "auto"), L, docs, args)
    real = mha.attention
    if contender == "flex":
        full = masks.causal() if mask is None else masks.causal() & mask
        block = create_block_mask(full.mask_mod(L, L), args.batch, None, L, L)

        def flex(q, k, v, **_kw):  # the model's mask is `block` (causal & documents)
            return flex_attention(q, k, v, block_mask=block)

        mha.attention = flex
        mask = masks.causal() if mask is None else mask  # the model's masked call path
    run = torch.compile(lambda idx: model(idx, mask=mask))
    try:
        times = []
        with torch.no_grad():
            for i in range(args.warmup + args.steps):
                t0 = time.perf_counter()
                run(idx)
                if i >= args.warmup:
                    times.append(time.perf_counter() - t0)
    finally:
        mha.attention = real
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
            runs = {b: step_time(BACKENDS[b], L, docs, args_mode) for b in BACKENDS}
            for backend, (s, growth) in runs.items():
                rate = args.batch * L / s
                ratio = f"speed {runs['sdpa'][0] / s:.2f}× sdpa's" if backend == "attnlab" else ""
                print(
                    f"{mode:<8} L={L:<5} {what:<16} {backend:<8} {s:7.3f} s/step "
                    f"{rate:9.0f} tokens/s  peak +{growth / 2**20:5.0f} MiB  {ratio}"
                )
    if args.no_compile:
        return
    for L in args.contexts:  # inference: compiled forwards, FlexAttention beside
        docs = args.contexts[0] != L
        what = "packed documents" if docs else "causal"
        secs = {c: forward_time(c, L, docs, args) for c in ("sdpa", "flex", "attnlab")}
        for contender, s in secs.items():
            ratio = ""
            if contender == "attnlab":
                ratio = f"speed {secs['flex'] / s:.2f}× flex's, {secs['sdpa'] / s:.2f}× sdpa's"
            print(
                f"forward  L={L:<5} {what:<16} {contender:<8} {s:7.3f} s "
                f"{args.batch * L / s:9.0f} tokens/s  {ratio}"
            )


if __name__ == "__main__":
    main()
