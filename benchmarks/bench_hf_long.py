"""Long contexts in a transformers model: peak memory of a Llama forward at 4K-16K tokens with
``attn_implementation="attnlab"`` against ``"eager"``.

A Llama-family model is built from a config with random weights (float32, 2 layers, hidden 256,
2 query heads of dim 128 sharing 1 k/v head), saved with ``save_pretrained`` and loaded from the
folder. Each (implementation, L) runs in its own subprocess: the process builds the model and the
input, resets its peak RSS (``/proc/self/clear_refs``, Linux), runs one forward of the base model
(``use_cache=False``, inference mode) and reports ``peak RSS − RSS before the forward``: the
forward's peak memory growth. Implementations:

- ``eager``: transformers' own attention (L×S weights per head);
- ``attnlab``: the bridge with the 2-D all-ones ``attention_mask`` transformers users pass (a key
  mask: the tiled backend);
- ``attnlab-nomask``: the bridge without ``attention_mask`` (pure causal: torch's fused SDPA);
- ``null``: an attention that returns q unchanged and computes nothing: the memory of the rest of
  the model (embeddings, MLP, norms, RoPE), subtracted from the others to give attention's share;
- ``stats``: ``attnlab.hf.attention_stats`` over the same forward (per-row statistics, no L×S).

Eager is measured only where it fits (``--eager-max``); nothing is extrapolated.

Run: python benchmarks/bench_hf_long.py [--lengths 4096 8192 16384] [--eager-max 16384]
     [--threads 1] [--impls eager attnlab attnlab-nomask null stats]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

HIDDEN, LAYERS, HEADS, KV_HEADS, VOCAB = 256, 2, 2, 1, 1000


def build(folder: str) -> None:
    """Saves the random Llama to ``folder`` (safetensors)."""
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=2 * HIDDEN,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        max_position_embeddings=32768,
    )
    transformers.LlamaForCausalLM(config).save_pretrained(folder, safe_serialization=True)


def child(folder: str, impl: str, length: int, threads: int) -> dict:
    """One forward in this process; returns its peak memory growth and time."""
    import torch
    import transformers

    import attnlab.hf

    torch.set_num_threads(threads)
    attnlab.hf.register()
    name = {"eager": "eager", "null": "null"}.get(impl, "attnlab")
    if impl == "null":
        # transformers' AttentionInterface signature (module, q, k, v, mask, **kwargs)
        def null_attention(_module, query, _key, _value, _attention_mask, **_kwargs):
            return query.transpose(1, 2), None  # (B, L, H, D): no attention work at all

        transformers.AttentionInterface.register("null", null_attention)
        transformers.masking_utils.AttentionMaskInterface.register("null", lambda *_a, **_k: None)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        folder, attn_implementation=name, local_files_only=True, use_safetensors=True
    ).model.eval()
    ids = torch.randint(0, VOCAB, (1, length))
    mask = None if impl == "attnlab-nomask" else torch.ones(1, length, dtype=torch.long)
    from common import peak_growth

    def forward() -> None:
        if impl == "stats":
            result = attnlab.hf.attention_stats(model, {"input_ids": ids, "attention_mask": mask})
            assert len(result.layers) == LAYERS
        else:
            model(input_ids=ids, attention_mask=mask, use_cache=False)

    with torch.inference_mode():
        model(input_ids=ids[:, :64], attention_mask=None if mask is None else mask[:, :64])
        _, growth, seconds = peak_growth(forward)
    return {"impl": impl, "L": length, "growth": growth, "seconds": seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 8192, 16384])
    parser.add_argument("--eager-max", type=int, default=16384)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--impls", nargs="+", default=["null", "eager", "attnlab", "attnlab-nomask", "stats"]
    )
    parser.add_argument("--child", nargs=3, metavar=("FOLDER", "IMPL", "L"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        folder, impl, length = args.child
        print(json.dumps(child(folder, impl, int(length), args.threads)))
        return
    import torch

    sys.path.insert(0, os.path.dirname(__file__))
    from common import cpu_model

    print(f"CPU: {cpu_model()}; torch {torch.__version__}, {args.threads} thread(s)")
    print(
        f"Llama: hidden {HIDDEN}, {LAYERS} layers, {HEADS} heads × {HIDDEN // HEADS} "
        f"(k/v heads {KV_HEADS}), float32, batch 1; load (1 min) {os.getloadavg()[0]:.2f}"
    )
    rows: dict[tuple[str, int], dict] = {}
    with tempfile.TemporaryDirectory() as folder:
        build(folder)
        for length in args.lengths:
            for impl in args.impls:
                if impl == "eager" and length > args.eager_max:
                    continue
                cmd = [sys.executable, __file__, "--threads", str(args.threads)]
                cmd += ["--child", folder, impl, str(length)]
                done = subprocess.run(cmd, capture_output=True, text=True)
                if done.returncode != 0:
                    print(f"{impl} L={length}: failed ({done.stderr.strip().splitlines()[-1:]})")
                    continue
                row = json.loads(done.stdout.strip().splitlines()[-1])
                rows[impl, length] = row
                print(
                    f"{impl:>15} L={length:>6}: peak growth {row['growth'] / 2**20:9.1f} MiB, "
                    f"{row['seconds']:7.2f} s",
                    flush=True,
                )
    print("\nattention's share = growth − growth(null); ratio = attnlab share / eager share")
    for length in args.lengths:
        base = rows.get(("null", length))
        if base is None:
            continue
        shares = {
            impl: (rows[impl, length]["growth"] - base["growth"]) / 2**20
            for impl in args.impls
            if impl != "null" and (impl, length) in rows
        }
        text = ", ".join(f"{k} {v:.1f} MiB" for k, v in shares.items())
        eager = shares.get("eager")
        ratio = ""
        if eager:
            ratio = "; " + ", ".join(
                f"{k}/eager {v / eager:.4f}" for k, v in shares.items() if k != "eager"
            )
        print(f"L={length}: {text}{ratio}")


if __name__ == "__main__":
    main()
