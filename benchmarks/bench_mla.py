"""Multi-head latent attention (DeepSeek-V3): the latent cache's bytes per token and the absorbed
decode step against a per-head K/V-cache step, in one run.

One attention layer at DeepSeek-V3's shapes (H = 128, kv_lora_rank C = 512, rope R = 64,
nope Dn = 128, v Dv = 128; batch 1), ``--cached`` tokens already cached (default 4096), decoding
one token at a time from the same inputs (the new token's queries, latent and rotary key):

- ``absorbed``: `LatentCache` (the latent and the rotary key per token, one buffer) and the
  absorbed form as `MultiHeadLatentAttention` runs it: W_UK folded into the query (``W_UKᵀ``
  made once, as the module keeps it per weight version), multi-query attention over ``[c ; r]``
  through `attnlab.attention` (the cache read in place, its one key head handed over as one
  view per thread: `attnlab.modules.mla.key_head_views`), W_UV after the weighted sum;
- ``per-head K/V``: the new latent up-projected into every head's key and value (kv_b_proj), a
  `KVCache` of ``(B, H, S, Dn + R)`` keys and ``(B, H, S, Dv)`` values, attention on the
  decode backend's C++ step (one task per head; `attnlab.attention` where it is not built).

Both end at the per-head outputs ``(B, H, 1, Dv)``; the projections both forms share (q, the
latent's down-projection, o_proj) are left out. The two outputs are checked equal at every step.
Prints the measured cache bytes per token of each (the preallocated buffers' bytes / capacity;
target for the latent: exactly ``(C + R) × dtype size``, no per-head K/V kept), the per-step
times (interleaved rounds, median) and their ratio (target: absorbed >= 2× faster), and the
absorbed step's arithmetic rate against the machine's matmul rate with the speed-up it would
have at that rate (the bound: its products, 2·H·S·(2C + R) + 2·H·C·(Dn + Dv) FLOPs, cannot
run faster).

Run: python benchmarks/bench_mla.py [--cached 4096] [--steps 8] [--repeats 5]
     [--dtype float32|bfloat16] [--threads N] [--clock wall|cpu] [--small]
``--clock cpu`` times in this process's CPU time (with ``--threads 1``: the uncontended time on
a shared machine; with more threads it adds the threads' times, so use the wall clock).
``--small`` runs tiny shapes (H = 4, C = 32, …; a check that the script works, no verdict).
"""

from __future__ import annotations

import argparse

import torch
from torch import Tensor

from attnlab import attention
from attnlab.analysis.estimate import cache_bytes_per_token
from attnlab.functional import nan_rule
from attnlab.functional.decode import decode_step_run
from attnlab.modules import KVCache, LatentCache
from attnlab.modules.mla import _absorbed
from common import CLOCKS, interleaved_medians, print_machine

DEEPSEEK_V3 = dict(H=128, C=512, R=64, Dn=128, Dv=128)
SMALL = dict(H=4, C=32, R=8, Dn=16, Dv=12)


def build(shape: dict[str, int], cached: int, capacity: int, dtype: torch.dtype):
    """The weights, both caches filled with the same ``cached`` tokens, and a step input maker."""
    H, C, R, Dn, Dv = (shape[k] for k in ("H", "C", "R", "Dn", "Dv"))
    g = torch.Generator().manual_seed(0)

    def rnd(*s: int, scale: float = 1.0) -> Tensor:
        return (torch.randn(*s, generator=g) * scale).to(dtype)

    w_kv_b = rnd(H * (Dn + Dv), C, scale=C**-0.5)  # kv_b_proj.weight
    w = w_kv_b.view(H, Dn + Dv, C)
    w_uk, w_uv = w[:, :Dn], w[:, Dn:]  # (H, Dn, C), (H, Dv, C)
    latent, k_rope = rnd(1, cached, C), rnd(1, cached, R)
    latent_cache, kv_cache = LatentCache(capacity), KVCache(capacity)
    latent_cache.update(latent, k_rope)
    kv_cache.update(*expand(latent, k_rope, w_kv_b, H, Dn))

    def step_inputs() -> tuple[Tensor, Tensor, Tensor, Tensor]:
        return rnd(1, H, 1, Dn), rnd(1, H, 1, R), rnd(1, 1, C), rnd(1, 1, R)

    return (w_kv_b, w_uk, w_uv), latent_cache, kv_cache, step_inputs


def expand(
    latent: Tensor, k_rope: Tensor, w_kv_b: Tensor, H: int, Dn: int
) -> tuple[Tensor, Tensor]:
    """Per-head keys ``(B, H, T, Dn + R)`` and values ``(B, H, T, Dv)`` of T tokens."""
    B, T, _ = latent.shape
    kv = (latent @ w_kv_b.T).view(B, T, H, -1).transpose(1, 2)  # (B, H, T, Dn + Dv)
    r = k_rope.unsqueeze(1).expand(B, H, T, -1)  # (B, H, T, R)
    return torch.cat((kv[..., :Dn], r), dim=-1), kv[..., Dn:]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cached", type=int, default=4096)
    p.add_argument("--steps", type=int, default=8, help="decode steps per timed round")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--clock", choices=list(CLOCKS), default="wall")
    p.add_argument("--small", action="store_true", help="tiny shapes: check the script runs")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    shape = SMALL if args.small else DEEPSEEK_V3
    H, C, R, Dn, Dv = (shape[k] for k in ("H", "C", "R", "Dn", "Dv"))
    clock = CLOCKS[args.clock]
    rate = print_machine((dtype,), clock)[dtype]
    print(
        f"MLA decode, one layer, B=1: H={H}, C={C}, R={R}, Dn={Dn}, Dv={Dv}, {args.dtype}, "
        f"{args.cached} cached tokens, {args.clock} clock\n"
    )
    capacity = args.cached + (args.repeats + 2) * args.steps
    (w_kv_b, w_uk, w_uv), latent_cache, kv_cache, step_inputs = build(
        shape, args.cached, capacity, dtype
    )
    scale = (Dn + R) ** -0.5
    # W_UKᵀ (H, C, Dn), made once per weight version as the module keeps it
    w_uk_t = w_uk.transpose(1, 2).contiguous()

    def absorbed(x: tuple[Tensor, ...]) -> Tensor:
        q_nope, q_rope, latent, k_rope = x
        view = latent_cache.update(latent, k_rope)
        return _absorbed(q_nope, q_rope, view.joint, C, w_uk, w_uv, None, scale, w_uk_t)

    # the per-head step on attnlab's fastest per-head decode: the C++ step (one task per head)
    # where it is built, called directly — `attention` sends a bfloat16 step of these sizes to
    # SDPA (the decode backend's size cap counts float32 copies of K and V that only its tensor
    # path makes), 30× slower than the C++ step
    direct = nan_rule.ext_ready(torch.zeros(1, dtype=dtype))

    def per_head(x: tuple[Tensor, ...]) -> Tensor:
        q_nope, q_rope, latent, k_rope = x
        view = kv_cache.update(*expand(latent, k_rope, w_kv_b, H, Dn))
        q = torch.cat((q_nope, q_rope), -1)
        if direct:
            return decode_step_run(q, view.k, view.v, scale)
        return attention(q, view.k, view.v, scale=scale)

    with torch.no_grad():
        inputs = [step_inputs() for _ in range(capacity - args.cached)]
        # Both forms see the same tokens in the same order: check their outputs agree.
        cursor = {"absorbed": 0, "per-head K/V": 0}
        worst = 0.0

        def run(name: str, fn) -> None:
            nonlocal worst
            for _ in range(args.steps):
                x = inputs[cursor[name]]
                out = fn(x)
                if name == "absorbed":
                    outs[cursor[name]] = out
                else:
                    diff = (out.double() - outs[cursor[name]].double()).abs().max()
                    worst = max(worst, float(diff))
                cursor[name] += 1

        outs: dict[int, Tensor] = {}
        times = interleaved_medians(
            {
                "absorbed": lambda: run("absorbed", absorbed),
                "per-head K/V": lambda: run("per-head K/V", per_head),
            },
            args.repeats,
            clock,
        )
    item = dtype.itemsize
    k_buf, v_buf = kv_cache.contiguous_buffers()  # type: ignore[misc]
    measured = {
        "absorbed": latent_cache.nbytes / capacity,
        "per-head K/V": (k_buf.nbytes + v_buf.nbytes) / capacity,
    }
    model = cache_bytes_per_token(
        H, kv_lora_rank=C, qk_rope_head_dim=R, qk_nope_head_dim=Dn, v_head_dim=Dv, dtype=args.dtype
    )
    print(f"{'form':<14}{'cache bytes/token':>20}{'estimate':>12}{'step':>12}")
    for name, key in (("absorbed", "latent"), ("per-head K/V", "per-head K/V")):
        step_ms = times[name] / args.steps * 1e3
        print(f"{name:<14}{measured[name]:>20,.0f}{model[key]:>12,}{step_ms:>10.3f} ms")
    print(f"\nmax |absorbed − per-head| over the steps: {worst:.2e}")
    ratio = times["per-head K/V"] / times["absorbed"]
    exact = measured["absorbed"] == (C + R) * item
    print(
        f"latent cache bytes per token = (C + R) × {item} = {(C + R) * item}: "
        f"{'yes' if exact else 'NO'}; per-head K/V kept by the latent cache: none"
    )
    S = args.cached + args.steps  # keys of a mid-run step
    flops = 2 * H * S * (2 * C + R) + 2 * H * C * (Dn + Dv)
    absorbed_s = times["absorbed"] / args.steps
    at_rate = flops / (rate * 1e9)
    bound = times["per-head K/V"] / args.steps / at_rate
    print(
        f"absorbed step: {flops / 1e9:.2f} GFLOP at {flops / absorbed_s / 1e9:.1f} GFLOP/s = "
        f"{100 * at_rate / absorbed_s:.0f} % of the matmul rate; at that rate it would take "
        f"{at_rate * 1e3:.3f} ms, a speed-up of {bound:.2f}× (the bound)"
    )
    verdict = "" if args.small else (" — target ≥ 2×: " + ("met" if ratio >= 2 else "NOT met"))
    print(f"absorbed step speed-up over the per-head K/V step: {ratio:.2f}×{verdict}")


if __name__ == "__main__":
    main()
