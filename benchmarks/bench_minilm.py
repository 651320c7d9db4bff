"""MiniLM sentence embeddings: attnlab's loader against sentence-transformers, side by side.

Encodes the same 256 sentences (varied lengths, a few past the 256-token limit) with
``attnlab.models.minilm().encode`` and ``SentenceTransformer(path).encode`` on one model
directory, interleaved repeat by repeat, and prints the median times, the throughput ratio
attnlab / sentence-transformers (target >= 1.0) and the machine's fp32 matmul rate.

Run: HF_HUB_OFFLINE=1 python benchmarks/bench_minilm.py [--repeats 15] [--batch-size 32]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time
from collections.abc import Callable

import torch

from common import matmul_gflops, timed

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


def fixed_batches(model, texts: list[str], batch_size: int) -> torch.Tensor:
    """attnlab's model with sentence-transformers' batching: sort, then cut every batch_size."""
    ids = model.tokenize(texts)
    order = sorted(range(len(ids)), key=lambda i: -len(ids[i]))
    out = torch.empty(len(texts), model.embedding_dim)
    with torch.inference_mode():
        for start in range(0, len(order), batch_size):
            chunk = order[start : start + batch_size]
            batch, mask = model._pad([ids[i] for i in chunk], torch.device("cpu"))
            out[chunk] = model(batch, mask)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--sentences", type=int, default=256)
    args = parser.parse_args()

    from sentence_transformers import SentenceTransformer

    import attnlab
    from attnlab.models.minilm import minilm, model_path

    path = model_path()
    ours = minilm()
    theirs = SentenceTransformer(str(path), device="cpu")
    texts = sentences(args.sentences)
    tokens = sum(len(ids) for ids in ours.tokenize(texts))
    bs = args.batch_size

    a = ours.encode(texts, batch_size=bs)
    b = theirs.encode(texts, batch_size=bs, convert_to_tensor=True)
    cos = torch.nn.functional.cosine_similarity(a, b).min().item()

    q = torch.randn(bs, 12, 64, 32)
    backend = attnlab.explain(q, q, q, mask=torch.ones(bs, 1, 1, 64, dtype=torch.bool))

    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"fp32 matmul rate (torch.mm 2048²): {matmul_gflops():.1f} GFLOP/s")
    print(f"{len(texts)} sentences, {tokens} tokens after truncation to 256, batch_size={bs}")
    print(f"attention backend for a padded batch: {backend}")
    print(f"min cosine(attnlab, sentence-transformers) = {cos:.7f}\n")

    wall, cpu = compare(
        {
            "sentence-transformers": lambda: theirs.encode(
                texts, batch_size=bs, convert_to_tensor=True
            ),
            "attnlab": lambda: ours.encode(texts, batch_size=bs),
            "attnlab, fixed batches": lambda: fixed_batches(ours, texts, bs),
        },
        args.repeats,
    )
    med = {name: statistics.median(s) for name, s in wall.items()}
    med_cpu = {name: statistics.median(s) for name, s in cpu.items()}
    print(f"{'encoder':<24} {'median s':>9} {'min s':>8} {'max s':>8} {'sent/s':>8} {'cpu s':>8}")
    for name, s in wall.items():
        rate = len(texts) / med[name]
        print(
            f"{name:<24} {med[name]:9.3f} {min(s):8.3f} {max(s):8.3f} {rate:8.1f} "
            f"{med_cpu[name]:8.3f}"
        )
    ref = "sentence-transformers"
    for name in ("attnlab", "attnlab, fixed batches"):
        per_repeat = sorted(x / y for x, y in zip(wall[ref], wall[name], strict=True))
        print(
            f"\nthroughput ratio {name} / {ref}: {med[ref] / med[name]:.3f}x wall "
            f"(target >= 1.0x), {med_cpu[ref] / med_cpu[name]:.3f}x cpu; per-repeat wall ratios "
            f"{per_repeat[0]:.3f}–{per_repeat[-1]:.3f}, median {statistics.median(per_repeat):.3f}"
        )


if __name__ == "__main__":
    main()
