"""What windows in the layers buy a GPT: the same model with full attention, a window in every
layer (Mistral), interleaved sliding/full layers (Gemma 2) and local/global heads.

For each length L, a GPT (E = 256, 4 layers, 4 heads, fp32) is timed, interleaved with its
variants: the forward pass (no grad), a training step's forward + backward, and one decoding
step with caches holding L tokens. The sliding layers' band (W keys) runs on the tiled
backend's band kernel once auto prefers it (the line "auto picks" names the backend of the
window's call at that size); a decode step of a sliding layer reads a `SlidingWindowCache` of W
keys instead of L. Expected: the window's share of the attention work is W / L, so the ratios
fall with L; the target is a window-in-every-layer forward + backward below 0.75× of full
attention at L = 4096, W = 256.

Run: python benchmarks/bench_layers.py [--repeats 5] [--lengths 1024 2048 4096] [--window 256]
"""

from __future__ import annotations

import argparse

import torch

import attnlab
from attnlab import masks
from attnlab.models import GPT, TransformerConfig, interleaved_layer_types
from common import interleaved_medians, print_machine

TARGET = 0.75


def configs(L: int, W: int, layers: int) -> dict[str, TransformerConfig]:
    base = {"vocab_size": 256, "d_model": 256, "n_layers": layers, "n_heads": 4, "max_seq_len": L}
    return {
        "full": TransformerConfig(**base),
        "window": TransformerConfig(**base, sliding_window=W),
        "interleaved": TransformerConfig(
            **base, sliding_window=W, layer_types=interleaved_layer_types(layers, 1)
        ),
        "local_global": TransformerConfig(**base, sliding_window=W, attention="local_global"),
    }


def _forward(model: GPT, idx: torch.Tensor):
    def fn():
        with torch.no_grad():
            return model(idx)

    return fn


def _train_step(model: GPT, idx: torch.Tensor):
    def fn():
        model.zero_grad(set_to_none=True)
        logits = model(idx)
        logits.float().logsumexp(-1).mean().backward()
        return logits

    return fn


def _decode_step(model: GPT, idx: torch.Tensor):
    """One new token against caches that hold ``L − 1`` tokens (the caches are filled once)."""
    L = idx.shape[1]
    with torch.no_grad():
        caches = model.new_caches(L)
        model(idx[:, :-1], caches=caches)
    state = [(c.seen, len(c)) for c in caches]

    def fn():
        for c, (seen, n) in zip(caches, state, strict=True):  # back to L − 1 tokens
            c.seen, c._len = seen, n  # noqa: SLF001 (rewinding a cache for a repeatable step)
        with torch.no_grad():
            return model(idx[:, -1:], caches=caches)

    return fn


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096])
    parser.add_argument("--window", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: all)")
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    print_machine()
    W = args.window
    print(f"B=1 E=256 layers={args.layers} H=4 fp32 W={W}; medians of {args.repeats} interleaved")
    print(f"{'L':>5} {'pass':8} {'variant':13} {'ms':>9} {'vs full':>8}")
    verdict = None
    for L in args.lengths:
        q = torch.randn(1, 4, L, 64)
        picked = attnlab.explain(q, q, q, mask=masks.sliding_window(W)).backend
        print(f"{L:5d} auto picks {picked!r} for the window's call")
        torch.manual_seed(0)
        models = {name: GPT(cfg) for name, cfg in configs(L, W, args.layers).items()}
        idx = torch.randint(0, 256, (1, L))
        for kind, make in (("fwd", _forward), ("fwd+bwd", _train_step), ("decode", _decode_step)):
            runs = {name: make(m.train(kind == "fwd+bwd"), idx) for name, m in models.items()}
            t = interleaved_medians(runs, args.repeats)
            for name, s in t.items():
                ratio = s / t["full"]
                print(f"{L:5d} {kind:8} {name:13} {s * 1e3:9.2f} {ratio:8.3f}", flush=True)
                if L == 4096 and kind == "fwd+bwd" and name == "window" and W == 256:
                    verdict = ratio
    if verdict is None:
        print("\n(the target is read at L = 4096, W = 256)")
    else:
        met = "met" if verdict < TARGET else "NOT met"
        print(f"\nwindow fwd+bwd / full at L = 4096: {verdict:.3f} (target < {TARGET}): {met}")


if __name__ == "__main__":
    main()
