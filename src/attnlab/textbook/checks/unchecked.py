"""Claims that cannot be checked here: history, GPU measurements, data and tasks that do not ship
(verdict ``not checkable here``, naming what is missing; no subjects)."""

from __future__ import annotations

import torch

from ..core import NOT_CHECKABLE, Finding, check, fmt
from ._shared import _est


@check("001-6.2-b")
def _usual_width() -> Finding:
    from ... import MultiHeadAttention

    with torch.device("meta"):
        built = [
            (E, H, MultiHeadAttention(E, H).head_dim) for E, H in ((512, 8), (768, 12), (1024, 16))
        ]
    return Finding(
        computed="attnlab builds any width divisible by the head count: "
        + ", ".join(f"d_model={E} with {H} heads (head_dim {D})" for E, H, D in built),
        call="MultiHeadAttention(E, H).head_dim on the meta device",
        verdict=NOT_CHECKABLE,
        explanation="which widths are usual is a historical fact about published models (the "
        "2017 Transformer used 512 and 1024, BERT-base and GPT-2 768), not something to compute",
    )


@check("002-8.3.3-e")
def _heads_survey() -> Finding:
    return Finding(
        "nothing computed",
        "—",
        NOT_CHECKABLE,
        "a historical fact: the configurations of published models (e.g. GPT-3 175B uses 96 "
        "heads, outside 16–32)",
    )


@check("002-8.4.3-b")
def _utilisation() -> Finding:
    return Finding(
        "nothing computed",
        "measure_estimate(estimate(...)) on the target accelerator",
        NOT_CHECKABLE,
        "a GPU/TPU with a known peak FLOPS (this CPU run is shared and unrepresentative)",
    )


@check("002-8.4.4-h")
def _flash_speed() -> Finding:
    naive = _est(65536, 64, 1, dtype="float16").value("score matrix", "naive")
    tiled = _est(65536, 64, 1, dtype="float16").value("activations kept for backward", "flash")
    return Finding(
        f"memory side at n=65536, one head, fp16: naive scores {fmt(naive / 2**30)} GiB; tiled "
        f"keeps {fmt(tiled / 2**20)} MiB",
        "estimate(65536, 64, 1, dtype='float16')",
        NOT_CHECKABLE,
        "a GPU with HBM/SRAM (the 2–4× is a GPU kernel measurement)",
    )


@check("002-8.5-a")
def _history() -> Finding:
    return Finding(
        "nothing computed",
        "—",
        NOT_CHECKABLE,
        "a historical fact (authors, year, page count of the paper)",
    )


@check("002-8.6-b")
def _gpu_numbers() -> Finding:
    return Finding(
        "nothing computed",
        "—",
        NOT_CHECKABLE,
        "a GPU (A100 memory sizes and bandwidths, and a GPU speed-up measurement)",
    )


@check("003-6-a")
def _translation() -> Finding:
    return Finding(
        computed="no computation: the published results are BLEU scores of large models trained "
        "on WMT corpora",
        call="—",
        verdict=NOT_CHECKABLE,
        explanation="needs the WMT training and test corpora (gigabytes, not shippable) and GPU "
        "training time; a historical result of the 2017 paper",
    )


@check("004-0-a")
def _hands_on() -> Finding:
    from ..exercises import get_exercise

    ids = [e for e in ("H1", "H2", "H3", "H4") if get_exercise(e).from_text is False]
    return Finding(
        computed=f"the seed file ends after chapter 1 (原理与机制); attnlab supplies exercises "
        f"{', '.join(ids)} (forward, tiled online-softmax forward, backward by hand, KV-cache "
        "decoding), each checked against attnlab.attention / autograd "
        "(`attnlab textbook --exercise H1`)",
        call="get_exercise('H1') … get_exercise('H4')",
        verdict=NOT_CHECKABLE,
        explanation="the announced hands-on chapter 3 is not in the source file, so its "
        "exercises cannot be checked; H1–H4 are attnlab's own",
    )


@check("004-0-b")
def _applications() -> Finding:
    import importlib

    from ... import apps, models

    # the chapter's domains and what attnlab ships for each: model classes and apps, by name
    shipped = {
        "language": ["GPT", "MiniLM", "BertEncoder", "Seq2SeqTransformer"],
        "vision": ["VisionTransformer"],
        "biology": [n for n in models.__all__ if n.lower().startswith(("protein", "dna", "bio"))],
        "economics": [n for n in models.__all__ if n.lower().startswith(("econ", "timeseries"))],
    }
    shipped = {k: [n for n in v if hasattr(models, n)] for k, v in shipped.items()}
    runnable = {k: [m for d, m in _APP_DOMAINS if d == k] for k in shipped}
    for names in runnable.values():
        for m in names:
            importlib.import_module(f"{apps.__name__}.{m}")  # the app exists and imports
    have = [k for k, v in shipped.items() if v]
    missing = [k for k, v in shipped.items() if not v]
    parts = [
        f"{k}: {', '.join(shipped[k])}"
        + (f" (apps: {', '.join(runnable[k])})" if runnable[k] else "")
        for k in have
    ]
    return Finding(
        computed="attnlab ships models for "
        + "; ".join(parts)
        + " — none for "
        + (", ".join(missing) or "no domain"),
        call="attnlab.models.__all__; attnlab.apps (translate, classify, vit)",
        verdict=NOT_CHECKABLE,
        explanation="the applications chapter is not in the source file"
        + (f", and nothing for {' or '.join(missing)} ships with attnlab" if missing else ""),
    )


_APP_DOMAINS = (("language", "translate"), ("language", "classify"), ("vision", "vit"))


@check("004-5.3-h")
def _sram_hbm() -> Finding:
    from ...functional.flash import BLOCK_K, BLOCK_Q

    return Finding(
        computed=f"attnlab's CPU tiled backend uses {BLOCK_Q}×{BLOCK_K} tiles (CPU caches, no "
        "HBM/SRAM split to count)",
        call="attnlab.functional.flash.BLOCK_Q, BLOCK_K",
        verdict=NOT_CHECKABLE,
        explanation="needs a GPU with SRAM/HBM and its memory-traffic counters; attnlab runs "
        "and measures on the CPU here",
    )
