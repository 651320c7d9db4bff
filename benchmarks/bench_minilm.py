"""MiniLM sentence embeddings: attnlab's loader against sentence-transformers, side by side.

Encodes the same 256 sentences (varied lengths, a few past the 256-token limit) with
``attnlab.models.minilm().encode`` and ``SentenceTransformer(path).encode`` on one model
directory, interleaved repeat by repeat, in float32 and in bfloat16 (``model.to(torch.bfloat16)``
for both libraries), and prints the times, sentences/s, and the throughput ratios against
sentence-transformers in float32 (targets: attnlab fp32 >= 1.0x; attnlab bf16 >= 2x on CPUs with
AMX). Before timing it asserts that every attnlab embedding has cosine >= 0.999 to
sentence-transformers' float32 one (bf16) or >= 0.99999 (fp32). The header names the CPU, AMX,
and the fp32 and bf16 matmul rates (the physical limits).

Run: HF_HUB_OFFLINE=1 nice -n 19 python benchmarks/bench_minilm.py [--repeats 15] [--batch-size 32]
     [--clock wall|cpu] [--threads N] [--stat median|min]

On a shared machine ``--clock cpu --threads 1 --stat min`` times this process's CPU seconds (the
uncontended time of one thread) and reports the best interleaved repeat.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time
from collections.abc import Callable

import torch

from common import matmul_gflops, print_machine, timed

os.environ.setdefault("HF_HUB_OFFLINE", "1")

_TEXT = (
    "the a of and to in is was for on that with as by at from it his her they this which be "
    "are or had an not but have one all their there were been has more when who will would "
    "time people year way day man thing woman life child world school state family student "
    "group country problem hand part place case week company system program question work "
    "government number night point home water room mother area money story fact month lot "
    "right study book eye job word business issue side kind head house service friend father "
    "power hour game line end member law car city community name president team minute idea "
    "kid body information back parent face others level office door health person art war "
    "history party result change morning reason research girl guy moment air teacher force "
    "education attention model encoder sentence embedding transformer café naïve résumé"
)
_WORDS = _TEXT.split()


def sentences(n: int = 256, seed: int = 0) -> list[str]:
    """n sentences of 3–60 words, plus one in 16 of 150–300 words (truncated at 256 tokens)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        k = rng.randint(150, 300) if i % 16 == 7 else rng.randint(3, 60)
        words = [rng.choice(_WORDS) for _ in range(k)]
        out.append(" ".join(words).capitalize() + rng.choice(".?!"))
    return out


def compare(
    fns: dict[str, Callable[[], object]], repeats: int
) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Wall and process-CPU seconds of each function per repeat, interleaved so drift hits all
    alike (CPU time counts every thread of this process; it is less sensitive to other load)."""
    for fn in fns.values():
        fn()
    wall: dict[str, list[float]] = {name: [] for name in fns}
    cpu: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            c0 = time.process_time()
            wall[name].append(timed(fn))
            cpu[name].append(time.process_time() - c0)
    return wall, cpu


def min_cosine(a: torch.Tensor, ref: torch.Tensor) -> float:
    """The smallest per-sentence cosine between embeddings ``(N, E)`` and the reference's."""
    return torch.nn.functional.cosine_similarity(a.float(), ref.float()).min().item()


def fixed_batches(model, texts: list[str], batch_size: int) -> torch.Tensor:
    """attnlab's model with sentence-transformers' batching: sort, then cut every batch_size."""
    ids = model.tokenize(texts)
    order = sorted(range(len(ids)), key=lambda i: -len(ids[i]))
    out = torch.empty(len(texts), model.embedding_dim)
    with torch.inference_mode():
        for start in range(0, len(order), batch_size):
            chunk = order[start : start + batch_size]
            batch, mask = model.pad_batch([ids[i] for i in chunk], torch.device("cpu"))
            out[chunk] = model(batch, mask)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--sentences", type=int, default=256)
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's choice)")
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall")
    parser.add_argument("--stat", choices=("median", "min"), default="median")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    from sentence_transformers import SentenceTransformer

    import attnlab
    from attnlab.models.minilm import minilm, model_path

    path = model_path()
    ours = minilm()
    ours16 = minilm().to(torch.bfloat16)
    theirs = SentenceTransformer(str(path), device="cpu")
    theirs16 = SentenceTransformer(str(path), device="cpu").to(torch.bfloat16)
    texts = sentences(args.sentences)
    tokens = sum(len(ids) for ids in ours.tokenize(texts))
    bs = args.batch_size

    ref = theirs.encode(texts, batch_size=bs, convert_to_tensor=True)
    cos = {
        "attnlab fp32": min_cosine(ours.encode(texts, batch_size=bs), ref),
        "attnlab bf16": min_cosine(ours16.encode(texts, batch_size=bs), ref),
        "sentence-transformers bf16": min_cosine(
            theirs16.encode(texts, batch_size=bs, convert_to_tensor=True), ref
        ),
    }

    q = torch.randn(bs, 12, 64, 32)
    why = attnlab.explain(q, q, q, mask=torch.ones(bs, 1, 1, 64, dtype=torch.bool))

    print_machine((torch.float32, torch.bfloat16))
    dtypes = (torch.float32, torch.bfloat16)
    rates = [matmul_gflops(2048, dtype=d, clock=time.process_time) for d in dtypes]  # CPU clock
    print(
        f"matmul rate per thread, CPU clock (torch.mm 2048²): float32 {rates[0]:.1f}, "
        f"bfloat16 {rates[1]:.1f} GFLOP/s"
    )
    print(f"load average: {os.getloadavg()[0]:.2f}")
    print(f"{len(texts)} sentences, {tokens} tokens after truncation to 256, batch_size={bs}")
    engines = "; ".join(why.engines)
    print(f"attention backend for a padded batch: {why.backend}: {why.reason}; engine: {engines}")
    for name, c in cos.items():
        print(f"min cosine({name}, sentence-transformers fp32) = {c:.7f}")
    assert cos["attnlab fp32"] >= 0.99999, cos
    assert cos["attnlab bf16"] >= 0.999, cos
    print()

    wall, cpu = compare(
        {
            "sentence-transformers fp32": lambda: theirs.encode(
                texts, batch_size=bs, convert_to_tensor=True
            ),
            "sentence-transformers bf16": lambda: theirs16.encode(
                texts, batch_size=bs, convert_to_tensor=True
            ),
            "attnlab fp32": lambda: ours.encode(texts, batch_size=bs),
            "attnlab bf16": lambda: ours16.encode(texts, batch_size=bs),
            "attnlab fp32, fixed batches": lambda: fixed_batches(ours, texts, bs),
        },
        args.repeats,
    )
    stat = min if args.stat == "min" else statistics.median
    times = cpu if args.clock == "cpu" else wall
    best = {name: stat(s) for name, s in times.items()}
    print(f"{args.stat} of {args.repeats} interleaved repeats, {args.clock} clock")
    print(f"{'encoder':<28} {'s':>8} {'min s':>8} {'max s':>8} {'sent/s':>8} {'vs ST fp32':>10}")
    ref_name = "sentence-transformers fp32"
    for name, s in times.items():
        rate = len(texts) / best[name]
        print(
            f"{name:<28} {best[name]:8.3f} {min(s):8.3f} {max(s):8.3f} {rate:8.1f} "
            f"{best[ref_name] / best[name]:9.2f}x"
        )
    for name, target in (("attnlab fp32", "1.0x"), ("attnlab bf16", "2x on AMX")):
        per_repeat = sorted(x / y for x, y in zip(times[ref_name], times[name], strict=True))
        print(
            f"\nthroughput ratio {name} / {ref_name}: {best[ref_name] / best[name]:.3f}x "
            f"(target >= {target}); per-repeat ratios {per_repeat[0]:.3f}–{per_repeat[-1]:.3f}, "
            f"median {statistics.median(per_repeat):.3f}"
        )
    bf = "sentence-transformers bf16"
    print(
        f"attnlab bf16 / {bf}: {best[bf] / best['attnlab bf16']:.3f}x; load average now "
        f"{os.getloadavg()[0]:.2f}"
    )


if __name__ == "__main__":
    main()
