"""The call most users make: a transformers model with ``attn_implementation="attnlab"``.

Prefill — ``model.model(input_ids, attention_mask=mask)``, the base model's forward, inference
mode — of Llama, Mistral (sliding window) and Gemma2 (soft-capped logits, alternating sliding
and full layers) shapes with random weights, against the attention transformers users would
pick instead, in the same run, rounds interleaved (best of ``--rounds``):

- ``sdpa`` (Llama, Mistral); for Gemma2, whose soft-capping transformers' sdpa lacks,
  ``flex_attention`` (transformers' compiled FlexAttention; the first round compiles, the best
  of ``--rounds`` is kept);
- ``eager`` (every family; up to ``--eager-max`` tokens: its L×S weights need tens of GB beyond);
- ``attnlab``.

The mask is what transformers users pass: ``B = 1`` with the all-ones 2-D ``attention_mask``
(every tokenizer call and ``generate`` pass one), and a left-padded ``B = 8`` batch whose lengths
spread over 25–100 % of L. Every contender's hidden states on the real tokens are compared with
the same model in float64 (up to ``--golden-max`` tokens): the tolerance rule's forward factor,
at most 2× the max error of the first contender (a padding row's output is undefined in
transformers). Prints the CPU
header and the matmul rate of each dtype.

``--generate`` times ``model.generate`` instead: greedy ``--new-tokens`` after each prompt
length, with transformers' dynamic and static KV caches, tokens/s beside sdpa (eager for Gemma2),
in each of ``--dtypes``. ``--floor`` adds a contender without attention (zeros): the rest of the
model's time, the bound no attention implementation can pass on this machine. ``--memory`` adds
each prefill contender's peak memory growth, measured in a fresh process per contender
(``/proc/self/clear_refs``), and attention's share of it against eager's (share = growth minus
the floor's growth; needs ``--floor`` and eager). A contender the allocator refuses (sdpa's
float mask of a left-padded ``B = 8`` batch at 32K tokens is one 34 GB tensor) is reported as out
of memory, and the others still run.

Run: python benchmarks/bench_hf.py [--lengths 1024 4096] [--batches 1 8]
     [--families llama mistral gemma2] [--dtypes float32] [--rounds 3] [--eager-max 8192]
     [--floor] [--memory] [--golden-max 4096]
     python benchmarks/bench_hf.py --generate [--prompts 128 4096] [--caches dynamic static]
     [--batches 1 4] [--new-tokens 64] [--dtypes float32 bfloat16] [--floor]
"""

from __future__ import annotations

import argparse
import copy
import json
import re
import subprocess
import sys
import time

import torch

from common import print_machine

HIDDEN, HEADS, KV_HEADS, LAYERS, FFN, VOCAB = 512, 8, 2, 2, 1024, 1000
"""The benchmark's model: hidden 512, 8 query heads of 64 sharing 2 k/v heads."""


def family(name: str, max_len: int):
    """``(model class, config)`` of a family at the benchmark's size."""
    import transformers

    common = dict(
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        num_hidden_layers=LAYERS,
        intermediate_size=FFN,
        vocab_size=VOCAB,
        max_position_embeddings=max_len,
    )
    if name == "llama":
        return transformers.LlamaForCausalLM, transformers.LlamaConfig(**common)
    if name == "mistral":
        cfg = transformers.MistralConfig(**common, sliding_window=4096)
        return transformers.MistralForCausalLM, cfg
    if name == "gemma2":
        cfg = transformers.Gemma2Config(
            **common,
            head_dim=HIDDEN // HEADS,
            sliding_window=4096,
            query_pre_attn_scalar=HIDDEN // HEADS,
            attn_logit_softcapping=50.0,
            final_logit_softcapping=None,
            layer_types=["sliding_attention", "full_attention"],
        )
        return transformers.Gemma2ForCausalLM, cfg
    raise SystemExit(f"unknown family {name!r}: llama, mistral or gemma2")


def inputs(B: int, L: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids ``(B, L)`` and the 2-D mask: all ones for B = 1, else left padding with real
    lengths spread over 25–100 % of L."""
    g = torch.Generator().manual_seed(L + B)
    ids = torch.randint(0, VOCAB, (B, L), generator=g)
    mask = torch.ones(B, L, dtype=torch.long)
    for b in range(B if B > 1 else 0):
        real = int(L * (0.25 + 0.75 * b / (B - 1)))
        mask[b, : L - real] = 0
    return ids, mask


FLOOR = "floor"
"""The contender without attention: an attention function that returns zeros and computes
nothing, so its time is the rest of the model (projections, MLP, norms, RoPE, cache, the loop):
the floor no attention can go below. ``(t_anchor − t_floor) / (t_attnlab − t_floor)`` is the
attention's own speed-up, and ``t_anchor / t_floor`` bounds the model-level ratio any attention
could reach on this machine."""


def register_floor() -> None:
    """Registers `FLOOR` with transformers' attention and mask interfaces."""
    import transformers

    def floor_attention(_module, query, _key, value, _mask, **_kwargs):
        B, H, L = query.shape[:3]
        return value.new_zeros(B, L, H, value.shape[-1]), None  # (B, L, H, Dv)

    transformers.AttentionInterface.register(FLOOR, floor_attention)
    transformers.masking_utils.AttentionMaskInterface.register(FLOOR, lambda *_a, **_k: None)


def build_models(cls, cfg, impls: list[str], dtype: torch.dtype) -> dict:
    """One model per attention implementation, in eval mode, all with the first one's weights
    (random, seed 0); each gets its own copy of the config (transformers writes into it)."""
    torch.manual_seed(0)
    models: dict = {}
    for impl in impls:
        model = cls._from_config(copy.deepcopy(cfg), attn_implementation=impl, dtype=dtype)
        if models:
            model.load_state_dict(next(iter(models.values())).state_dict())
        models[impl] = model.eval()
    return models


def run_case(name: str, B: int, L: int, dtype: torch.dtype, args) -> None:
    """Times one (family, B, L, dtype) for every contender that applies; prints one line each."""
    cls, cfg = family(name, max(args.lengths))
    # transformers has no sdpa for Gemma2's soft-capping: its compiled FlexAttention instead
    impls = ["sdpa"] if name != "gemma2" else ["flex_attention"]
    impls += ["eager"] if args.eager_max >= L else []
    impls.append("attnlab")
    impls += [FLOOR] if args.floor else []
    models = build_models(cls, cfg, impls, dtype)
    ids, mask = inputs(B, L)
    best: dict[str, float] = {}
    outs: dict[str, torch.Tensor] = {}
    failed: dict[str, str] = {}  # contender -> why it could not run (e.g. its mask's memory)
    with torch.inference_mode():
        for _ in range(args.rounds):
            for impl, model in models.items():
                if impl in failed:
                    continue
                t0 = time.perf_counter()
                try:
                    outs[impl] = model.model(ids, attention_mask=mask).last_hidden_state
                except (RuntimeError, MemoryError) as err:  # the allocator's "can't allocate"
                    if "allocate" not in str(err) and not isinstance(err, MemoryError):
                        raise
                    failed[impl] = _out_of_memory(err)
                    continue
                best[impl] = min(best.get(impl, float("inf")), time.perf_counter() - t0)
    for impl, why in failed.items():
        print(f"{name:<8} B={B} L={L:<6} {impl:<8} could not run on this machine: {why}")
    impls = [i for i in impls if i not in failed]
    real = mask.bool()
    first = next(iter(outs))
    golden = None
    if args.golden_max >= L:  # the model in float64 (sdpa's or eager's attention)
        base = next((i for i in ("sdpa", "eager") if i in outs), first)
        ref = copy.deepcopy(models[base]).double()
        with torch.inference_mode():
            golden = ref.model(ids, attention_mask=mask).last_hidden_state[real]
        del ref
    others = [i for i in impls if i not in ("attnlab", FLOOR)]
    anchor = min(others, key=best.__getitem__) if others else None
    growth = {i: memory_of(name, B, L, dtype, i) for i in impls} if args.memory else {}
    for impl in impls:
        bound = ""
        if impl == FLOOR:
            bound = f"bound {best[anchor] / best[impl]:.2f}× {anchor}'s" if anchor else ""
            check = "(no attention: the rest of the model)"
        elif impl == first and golden is None:
            check = "(the first contender: the others are compared with it)"
        elif golden is None:
            diff = (outs[impl][real].float() - outs[first][real].float()).abs().max().item()
            check = f"max|Δ| vs {first} {diff:.1e} (no float64 golden beyond --golden-max)"
        else:
            check = _rule_check(outs[impl][real], golden, outs[first][real], first)
        ratio = ""
        if impl == "attnlab" and anchor is not None:
            ratio = f"speed {best[anchor] / best[impl]:.2f}× {anchor}'s"
            if FLOOR in best:
                own = (best[anchor] - best[FLOOR]) / (best[impl] - best[FLOOR])
                ratio += f" (attention alone {own:.2f}×)"
        dt = str(dtype).removeprefix("torch.")
        print(
            f"{name:<8} B={B} L={L:<6} {dt:<9} {impl:<8} {best[impl]:8.3f} s  {ratio}{bound}  "
            f"{check}{_memory_text(growth, impl)}"
        )


def _out_of_memory(err: BaseException) -> str:
    """One line for a contender the allocator refused: how much it asked for, when it says."""
    asked = re.search(r"allocate (\d+) bytes", str(err))
    size = f" (one allocation of {int(asked[1]) / 1e9:.1f} GB)" if asked else ""
    return f"out of memory{size}"


def memory_child(name: str, B: int, L: int, dtype: torch.dtype, impl: str) -> dict:
    """One prefill of ``impl`` in this (fresh) process: its peak RSS growth (`common.peak_growth`)
    after a 64-token warm-up."""
    from common import peak_growth

    cls, cfg = family(name, L)
    torch.manual_seed(0)
    model = cls._from_config(copy.deepcopy(cfg), attn_implementation=impl, dtype=dtype).eval()
    ids, mask = inputs(B, L)
    with torch.inference_mode():
        model.model(ids[:, -64:], attention_mask=mask[:, -64:])
        _, growth, _ = peak_growth(lambda: model.model(ids, attention_mask=mask))
    return {"growth": growth}


def memory_of(name: str, B: int, L: int, dtype: torch.dtype, impl: str) -> int | None:
    """`memory_child` in a subprocess (bytes), or None if it failed (e.g. out of memory)."""
    dt = str(dtype).removeprefix("torch.")
    cmd = [sys.executable, __file__, "--memory-child", name, str(B), str(L), dt, impl]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        return None
    return int(json.loads(done.stdout.strip().splitlines()[-1])["growth"])


def _memory_text(growth: dict[str, int | None], impl: str) -> str:
    """``peak +X MiB`` of a contender, and attention's share against eager's when both and the
    floor were measured (share = growth − the floor's growth)."""
    mine = growth.get(impl)
    if mine is None:
        return ""
    text = f"  peak +{mine / 2**20:.0f} MiB"
    floor, eager = growth.get(FLOOR), growth.get("eager")
    if impl == "attnlab" and floor is not None and eager is not None and eager > floor:
        text += f" (attention's share {(mine - floor) / (eager - floor):.3f}× eager's)"
    return text


def _rule_check(out: torch.Tensor, golden: torch.Tensor, naive: torch.Tensor, first: str) -> str:
    """The tolerance rule's forward factor at model level, on the real tokens' hidden states: the
    max error against the float64 model at most 2× that of ``first`` (transformers' own attention
    in the same dtype, whose projections and MLP round alike)."""
    err = (out.double() - golden).abs().max().item()
    ref = (naive.double() - golden).abs().max().item()
    verdict = "ok" if err <= 2 * ref else f"FAILS (> 2× {first}'s {ref:.1e})"
    return f"max|Δ| vs float64 {err:.1e} {verdict}"


def run_generate(name: str, B: int, prompt: int, cache: str, dtype: torch.dtype, args) -> None:
    """Times ``model.generate`` of ``--new-tokens`` greedy tokens after a ``prompt``-token
    prompt (all-ones mask for B = 1, left padding otherwise) with a ``cache`` KV cache
    (``"dynamic"`` or ``"static"``); prints tokens/s per contender and whether the generated
    tokens equal the first contender's."""
    cls, cfg = family(name, prompt + args.new_tokens + 8)
    impls = ["sdpa", "attnlab"] if name != "gemma2" else ["eager", "attnlab"]
    impls += [FLOOR] if args.floor else []
    models = build_models(cls, cfg, impls, dtype)
    ids, mask = inputs(B, prompt)
    kw = dict(
        attention_mask=mask,
        max_new_tokens=args.new_tokens,
        min_new_tokens=args.new_tokens,
        do_sample=False,
        cache_implementation=cache,
        pad_token_id=0,
    )
    best: dict[str, float] = {}
    tokens: dict[str, torch.Tensor] = {}
    with torch.inference_mode():
        for _ in range(args.rounds):
            for impl, model in models.items():
                t0 = time.perf_counter()
                tokens[impl] = model.generate(ids, **kw)
                best[impl] = min(best.get(impl, float("inf")), time.perf_counter() - t0)
    first = impls[0]
    dt = str(dtype).removeprefix("torch.")
    for impl in impls:
        rate = B * args.new_tokens / best[impl]
        ratio = f"speed {best[first] / best[impl]:.2f}× {first}'s" if impl != first else ""
        if impl == FLOOR:
            ratio = f"bound {best[first] / best[impl]:.2f}× {first}'s (no attention)"
            same = ""
        else:
            same = f"same tokens as {first}: {torch.equal(tokens[impl], tokens[first])}"
        print(
            f"{name:<8} generate B={B} prompt={prompt:<5} {cache:<7} {dt:<9} {impl:<8} "
            f"{rate:8.1f} tokens/s  {ratio}  {same}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--families", nargs="+", default=["llama", "mistral", "gemma2"])
    parser.add_argument("--dtypes", nargs="+", default=["float32"])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--eager-max", type=int, default=8192)
    parser.add_argument(
        "--golden-max",
        type=int,
        default=4096,
        help="check prefill against the float64 model up to this length",
    )
    parser.add_argument("--generate", action="store_true", help="time generate instead of prefill")
    parser.add_argument("--prompts", type=int, nargs="+", default=[128, 4096])
    parser.add_argument("--caches", nargs="+", default=["dynamic", "static"])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument(
        "--floor",
        action="store_true",
        help="add the contender without attention (the rest of the model: the bound)",
    )
    parser.add_argument(
        "--memory",
        action="store_true",
        help="prefill: each contender's peak memory growth, measured in a fresh process",
    )
    parser.add_argument("--memory-child", nargs=5, help=argparse.SUPPRESS)
    args = parser.parse_args()
    import attnlab.hf

    attnlab.hf.register()
    register_floor()
    if args.memory_child:
        name, B, L, dt, impl = args.memory_child
        print(json.dumps(memory_child(name, int(B), int(L), getattr(torch, dt), impl)))
        return
    dtypes = tuple(getattr(torch, d) for d in args.dtypes)
    print_machine(dtypes)
    if args.generate:
        for dtype in dtypes:
            for name in args.families:
                for B in args.batches:
                    for prompt in args.prompts:
                        for cache in args.caches:
                            run_generate(name, B, prompt, cache, dtype, args)
        return
    for dtype in dtypes:
        for name in args.families:
            for B in args.batches:
                for L in args.lengths:
                    run_case(name, B, L, dtype, args)


if __name__ == "__main__":
    main()
