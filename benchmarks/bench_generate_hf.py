"""GPT decoding tokens/s: attnlab's `GPT.generate` against `LlamaForCausalLM.generate`.

One random-weight model, two implementations: an attnlab `GPT` with Llama's choices (RMSNorm,
SwiGLU, rotate-half RoPE, no biases, GQA) and the `LlamaForCausalLM` that `to_llama` builds from
the same configuration and the same weights (``attn_implementation="sdpa"``, transformers'
default dynamic cache). Both decode greedily from the same prompt, and the tokens are compared
before anything is timed (`agreement`): identical in float32 (asserted); in bfloat16 identical up
to the first difference, which must be a near-tie of the float32 logits (asserted; the two
libraries round differently). Then each ``generate`` call (prefill + new tokens) is timed in
rounds, interleaved, for fp32 and bf16 and each batch size, and the tokens/s of both and the ratio
attnlab / transformers are printed (target >= 1.5x).

The output projection is drawn with a larger scale (``--head-std``) so that greedy decoding has
clear top-2 margins rather than the near-uniform logits of a GPT-2 initialisation.

Run: nice -n 19 python benchmarks/bench_generate_hf.py [--clock cpu] [--threads 1] [--rounds 5]
     [--prompt 128] [--new 128] [--batch 1 4] [--dtype float32 bfloat16]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from functools import partial

import torch
from torch import Tensor

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from attnlab.models import GPT, TransformerConfig


def llama_like(
    vocab_size: int = 32000,
    d_model: int = 512,
    n_layers: int = 8,
    n_heads: int = 8,
    n_kv_heads: int = 2,
    d_ff: int | None = None,
    max_seq_len: int = 2048,
) -> TransformerConfig:
    """A `TransformerConfig` with Llama's choices (RMSNorm, SwiGLU, RoPE, no biases, GQA)."""
    return TransformerConfig(
        vocab_size=vocab_size,
        d_model=d_model,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        d_ff=d_ff,
        max_seq_len=max_seq_len,
        norm="rmsnorm",
        norm_eps=1e-5,
        mlp="swiglu",
        positional="rope",
        bias=False,
        tie_embeddings=False,
    )


def llama_config(cfg: TransformerConfig, attn_implementation: str | None = None):
    """The ``transformers.LlamaConfig`` of the same model; ValueError if Llama cannot express it."""
    import transformers

    wanted = {
        "norm": "rmsnorm",
        "mlp": "swiglu",
        "positional": "rope",
        "bias": False,
        "prenorm": True,
        "activation": None,
        "rope_scaling": None,
        "embed_norm": False,
        "type_vocab_size": 0,
    }
    bad = {k: getattr(cfg, k) for k, v in wanted.items() if getattr(cfg, k) != v}
    if bad:
        raise ValueError(f"a Llama model needs {wanted}; this config has {bad}")
    return transformers.LlamaConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.d_model,
        intermediate_size=cfg.ff_dim,
        num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads,
        num_key_value_heads=cfg.n_kv_heads or cfg.n_heads,
        head_dim=cfg.head_dim,
        max_position_embeddings=cfg.max_seq_len,
        rms_norm_eps=cfg.norm_eps,
        rope_theta=cfg.rope_base,
        hidden_act="silu",
        attention_bias=False,
        mlp_bias=False,
        tie_word_embeddings=cfg.tie_embeddings,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
        attn_implementation=attn_implementation,
    )


@torch.no_grad()
def to_llama(model: GPT, attn_implementation: str = "sdpa"):
    """A ``LlamaForCausalLM`` holding copies of ``model``'s weights (same dtype), in eval mode.

    q/k/v come from the fused ``qkv_proj`` rows ``[H·D | H_kv·D | H_kv·D]``; norms, MLP
    (gate/up/down), output projection, embeddings and head map one to one.
    """
    import transformers

    cfg = model.config
    config = llama_config(cfg, attn_implementation)
    dtype = model.tok_emb.weight.dtype
    hf = transformers.LlamaForCausalLM(config).to(dtype).eval()
    H, H_kv, D = cfg.n_heads, cfg.n_kv_heads or cfg.n_heads, cfg.head_dim
    hf.model.embed_tokens.weight.copy_(model.tok_emb.weight)
    for block, layer in zip(model.blocks, hf.model.layers, strict=True):
        q, k, v = block.attn.qkv_proj.weight.split([H * D, H_kv * D, H_kv * D])
        layer.self_attn.q_proj.weight.copy_(q)
        layer.self_attn.k_proj.weight.copy_(k)
        layer.self_attn.v_proj.weight.copy_(v)
        layer.self_attn.o_proj.weight.copy_(block.attn.out_proj.weight)
        layer.input_layernorm.weight.copy_(block.norm1.weight)
        layer.post_attention_layernorm.weight.copy_(block.norm2.weight)
        layer.mlp.gate_proj.weight.copy_(block.mlp.gate.weight)
        layer.mlp.up_proj.weight.copy_(block.mlp.up.weight)
        layer.mlp.down_proj.weight.copy_(block.mlp.down.weight)
    hf.model.norm.weight.copy_(model.norm_f.weight)
    if not cfg.tie_embeddings:
        hf.lm_head.weight.copy_(model.lm_head.weight)
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0
    return hf


def random_gpt(cfg: TransformerConfig, head_std: float = 0.02, seed: int = 0) -> GPT:
    """A `GPT` with GPT-2 initialisation, its output projection drawn N(0, head_std²)."""
    torch.manual_seed(seed)
    model = GPT(cfg).eval()
    with torch.no_grad():
        model.lm_head.weight.normal_(0.0, head_std)
    return model


def attnlab_generate(model: GPT, prompt: Tensor, new: int) -> Tensor:
    """Greedy decoding with KV caches: ``(B, P) -> (B, P + new)``."""
    return model.generate(prompt, new, top_k=1)


def hf_generate(hf, prompt: Tensor, new: int) -> Tensor:
    """transformers' greedy ``generate`` of exactly ``new`` tokens: ``(B, P) -> (B, P + new)``."""
    return hf.generate(
        prompt,
        attention_mask=torch.ones_like(prompt),
        max_new_tokens=new,
        min_new_tokens=new,
        do_sample=False,
    )


@torch.no_grad()
def agreement(model: GPT, ours: Tensor, theirs: Tensor, prompt_len: int, dtype: torch.dtype) -> str:
    """Asserts that both generations are the same tokens; returns a short description.

    float32: identical, full stop. bfloat16: the two implementations round differently
    (transformers rotates q and k in bf16, attnlab in float32), so a greedy step whose top two
    logits are within bf16 rounding may legitimately differ: the sequences must be identical up
    to their first difference, and there attnlab's float32 logits (the same weights, the common
    prefix as context) must have a top-2 margin below ``2**-6`` of their largest magnitude (a
    near-tie); otherwise AssertionError.
    """
    if torch.equal(ours, theirs):
        return "identical"
    first = int((ours != theirs).any(0).nonzero()[0])
    if dtype == torch.float32:
        raise AssertionError(f"float32: tokens differ from new token {first - prompt_len} on")
    row = int((ours[:, first] != theirs[:, first]).nonzero()[0])
    ref = random_gpt(model.config).float()
    ref.load_state_dict({k: v.float() for k, v in model.state_dict().items()})
    logits = ref(ours[row : row + 1, :first])[0, -1]  # (V,)
    top = logits.topk(2).values
    margin, scale = float(top[0] - top[1]), float(logits.abs().max())
    if margin > scale * 2**-6:
        raise AssertionError(
            f"{dtype}: tokens differ from new token {first - prompt_len} on (row {row}), where "
            f"the float32 top-2 margin {margin:.3g} is not a near-tie (max |logit| {scale:.3g})"
        )
    return (
        f"identical for {first - prompt_len} new tokens, then a near-tie (fp32 top-2 margin "
        f"{margin:.3g}, max |logit| {scale:.3g}) in row {row}"
    )


@torch.no_grad()
def linear_floor(
    model: GPT, batch: int, steps: int, clock: Callable[[], float], *, torch_kernel: bool = False
) -> float:
    """Seconds per decode step of the model's matrix products alone (the kernel bound).

    Every `nn.Linear` of ``model`` (fused QKV, output, gate, up, down, head) applied to a
    ``(batch, 1, in)`` input of the model's dtype, ``steps`` times: the weight traffic and
    arithmetic one decode step must do (attention over the cache and the elementwise work
    excluded, so a true step is slower) — as attnlab runs them (`StreamLinear`: its streaming
    kernel for a few rows), or with ``torch_kernel`` through ``torch.nn.functional.linear``
    (what transformers' step runs).
    """
    dtype = model.tok_emb.weight.dtype
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    xs = [torch.randn(batch, 1, m.in_features, dtype=dtype) for m in linears]

    def apply(m: torch.nn.Linear, x: Tensor) -> Tensor:
        return torch.nn.functional.linear(x, m.weight, m.bias) if torch_kernel else m(x)

    for m, x in zip(linears, xs, strict=True):
        apply(m, x)
    t0 = clock()
    for _ in range(steps):
        for m, x in zip(linears, xs, strict=True):
            apply(m, x)
    return (clock() - t0) / steps


def rounds(
    fns: dict[str, Callable[[], object]], n: int, clock: Callable[[], float]
) -> dict[str, list[float]]:
    """Seconds of each function per round, interleaved (one warm-up call each first)."""
    for fn in fns.values():
        fn()
    out: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(n):
        for name, fn in fns.items():
            t0 = clock()
            fn()
            out[name].append(clock() - t0)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--d-model", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--new", type=int, default=128)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--head-std", type=float, default=1.0)
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's choice)")
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall")
    parser.add_argument("--stat", choices=("min", "median"), default="min")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    import transformers

    from common import matmul_gflops, print_machine

    print_machine((torch.float32, *(getattr(torch, n) for n in args.dtype if n != "float32")))
    per_thread = partial(matmul_gflops, 2048, clock=time.process_time)  # CPU clock
    rates = ", ".join(f"{n} {per_thread(dtype=getattr(torch, n)):.1f}" for n in args.dtype)
    print(f"matmul rate per thread, CPU clock (torch.mm 2048²): {rates} GFLOP/s")
    print(f"transformers {transformers.__version__}; load: {os.getloadavg()[0]:.2f}")
    cfg = llama_like(args.vocab, args.d_model, args.layers, args.heads, args.kv_heads)
    base = random_gpt(cfg, args.head_std)
    n_params = sum(p.numel() for p in base.parameters())
    print(
        f"model: vocab {cfg.vocab_size}, d_model {cfg.d_model}, {cfg.n_layers} layers, heads "
        f"{cfg.n_heads}/{cfg.n_kv_heads} (D={cfg.head_dim}), SwiGLU {cfg.ff_dim}, "
        f"{n_params / 1e6:.1f}M parameters; greedy, {args.prompt}-token prompt, {args.new} new "
        f"tokens; {args.stat} of {args.rounds} interleaved rounds, {args.clock} clock, "
        f"{torch.get_num_threads()} threads\n"
    )
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    stat = min if args.stat == "min" else statistics.median
    print(
        f"{'dtype':<9} {'B':>2} {'attnlab tok/s':>14} {'HF tok/s':>9} {'ratio':>6} "
        f"{'matmul floor tok/s':>19} {'torch-linear floor':>19}  tokens"
    )
    for name in args.dtype:
        dtype = getattr(torch, name)
        model = random_gpt(cfg, args.head_std).to(dtype)
        hf = to_llama(model)
        for B in args.batch:
            gen = torch.Generator().manual_seed(B)
            prompt = torch.randint(0, cfg.vocab_size, (B, args.prompt), generator=gen)
            ours = attnlab_generate(model, prompt, args.new)
            theirs = hf_generate(hf, prompt, args.new)
            same = agreement(model, ours, theirs, args.prompt, dtype)
            times = rounds(
                {
                    "attnlab": partial(attnlab_generate, model, prompt, args.new),
                    "transformers": partial(hf_generate, hf, prompt, args.new),
                },
                args.rounds,
                clock,
            )
            ta, th = stat(times["attnlab"]), stat(times["transformers"])
            rate_a, rate_h = B * args.new / ta, B * args.new / th
            floor = min(linear_floor(model, B, 20, clock) for _ in range(args.rounds))
            floor_t = min(
                linear_floor(model, B, 20, clock, torch_kernel=True) for _ in range(args.rounds)
            )
            print(
                f"{name:<9} {B:>2} {rate_a:14.1f} {rate_h:9.1f} {rate_a / rate_h:6.2f} "
                f"{B / floor:19.1f} {B / floor_t:19.1f}  {same}"
                f"   (load {os.getloadavg()[0]:.2f})"
            )
    print(
        "\ntarget: attnlab >= 1.5x transformers' tokens/s. The matmul floor is the rate of the "
        "decode step's matrix products alone (every nn.Linear on a (B, 1, in) input) as attnlab "
        "runs them (StreamLinear: its streaming kernel for a few rows); the torch-linear floor "
        "runs them through torch.nn.functional.linear, as transformers' step does. A step with "
        "those products cannot decode faster than its floor."
    )


if __name__ == "__main__":
    main()
