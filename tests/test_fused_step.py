"""A Transformer block's one-token decode step in one C++ call (`attnlab.models.fused_step`).

The fused call runs the operators the modules run, in their order, so against the modules on the
decode backend (``ATTNLAB_BLOCK_STEP=off``) its outputs and caches are bit-equal; every
condition it does not cover must leave the step to the modules.
"""

from __future__ import annotations

import copy

import pytest
import torch

from attnlab import _ext, masks
from attnlab.functional import gemv
from attnlab.models import GPT, TransformerConfig, fused_step
from attnlab.models.blocks import TransformerBlock
from attnlab.modules import CacheOverflowError, KVCache, SlidingWindowCache
from attnlab.positional import ALiBi, RoPE
from attnlab.testing import assert_close_rule


@pytest.fixture(scope="module")
def ext() -> None:
    """The C++ operators, built or loaded (first run on a machine: about a minute), else skip."""
    for name in ("nan_rule", "gemv", fused_step.EXT):
        if _ext.mode() == "off" or not _ext.load(name):
            pytest.skip(f"C++ extension unavailable: {_ext.status(name)}")


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """The same values (NaN positions included) in the same dtype and shape."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(0.0), b.nan_to_num(0.0))


def _block(seed: int, dtype: torch.dtype, **kw) -> TransformerBlock:
    """A block of a small config (E 64, H 4), in eval mode; RoPE when ``kw["rope"]``."""
    torch.manual_seed(seed)
    rope_kw = kw.pop("rope", None)
    cfg = TransformerConfig(vocab_size=32, d_model=64, n_layers=1, n_heads=4, **kw)
    rope = None if rope_kw is None else RoPE(cfg.head_dim, **rope_kw)
    block = TransformerBlock(cfg, rope=rope).eval().to(dtype)
    with torch.no_grad():  # norm weights and biases away from 1 and 0: every operand counts
        for name, p in block.named_parameters():
            if "norm" in name:
                p.add_(0.3 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
    return block


def _prefilled(block: TransformerBlock, B: int, P: int, capacity: int, seed: int) -> KVCache:
    """A cache after a P-token prompt through the block (auto's backend); the block's steps
    then run on the decode backend (the fused step's attention: bit-equal comparisons)."""
    block.attn.backend = "auto"
    rotate = block.attn.rope is not None
    cache = KVCache(capacity, rotate_at_insert=rotate)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, P, 64, generator=g).to(block.norm1.weight.dtype)
    with torch.no_grad():
        block(x, mask=None if P == 1 else masks.causal(), cache=cache)
    block.attn.backend = "decode"
    return cache


CONFIGS = {
    "llama (rms, swiglu silu, rope, gqa)": dict(
        norm="rmsnorm", mlp="swiglu", n_kv_heads=2, bias=False, rope={}
    ),
    "gpt2 (layernorm, gelu mlp, no rope, bias)": dict(norm="layernorm", mlp="gelu", bias=True),
    "post-ln geglu, interleaved rope": dict(
        norm="rmsnorm",
        mlp="swiglu",
        activation="gelu",
        prenorm=False,
        bias=True,
        rope={"interleaved": True},
    ),
    "layernorm relu mlp, partial rope, gqa": dict(
        norm="layernorm", mlp="gelu", activation="relu", n_kv_heads=1, rope={"rotary_dim": 8}
    ),
    "rms gelu_tanh swiglu, no bias": dict(
        norm="rmsnorm", mlp="swiglu", activation="gelu_tanh", bias=False, rope={}
    ),
}


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize(
    "dtype,B", [(torch.float32, 1), (torch.float32, 3), (torch.bfloat16, 2), (torch.float64, 2)]
)
def test_fused_step_bit_equal_to_the_modules(ext, monkeypatch, name, dtype, B) -> None:
    """Three steps through `fused_step.step` against the block's modules on the decode backend
    (``ATTNLAB_BLOCK_STEP=off``), from the same prefilled cache: the same output bits and the
    same cached keys (after RoPE) and values, for pre-/post-LN, both norms, both MLPs, every
    activation, RoPE (both layouts, partial) or none, GQA, biases, 1–3 rows, float32, bfloat16
    and float64 (torch's linear: the streaming one has no float64 kernel)."""
    block = _block(3, dtype, **CONFIGS[name])
    cache = _prefilled(block, B, 7, 16, seed=5)
    twin = copy.deepcopy(cache)
    g = torch.Generator().manual_seed(6)
    xs = [torch.randn(B, 1, 64, generator=g).to(dtype) for _ in range(3)]
    with torch.no_grad():
        fused = [fused_step.step(block, x, cache) for x in xs]
        monkeypatch.setenv(fused_step.ENV, "off")
        assert fused_step.step(block, xs[0], copy.deepcopy(twin)) is None
        modules = [block(x, cache=twin) for x in xs]
    for a, b in zip(fused, modules, strict=True):
        assert a is not None and _same(a, b)
    assert len(cache) == len(twin) == 10 and cache.seen == twin.seen == 10
    assert _same(cache._k[:, :, :10], twin._k[:, :, :10])
    assert _same(cache._v[:, :, :10], twin._v[:, :, :10])


def test_fused_step_follows_the_tolerance_rule_and_the_nan_rule(ext) -> None:
    """Against the float64 block (golden) and the float32 block with the C++ operators off
    (naive: RoPE's tensor ops, the tensor-op decode path, torch's linear), the fused float32 step
    follows the tolerance rule; a NaN planted in one row's cached key poisons that row only."""
    block = _block(8, torch.float32, **CONFIGS["llama (rms, swiglu silu, rope, gqa)"])
    gold = copy.deepcopy(block).double()
    cache = _prefilled(block, 2, 9, 12, seed=1)
    gcache = _prefilled(gold, 2, 9, 12, seed=1)
    ncache = copy.deepcopy(cache)
    cache._k[0, 1, 4, 5] = float("nan")
    gcache._k[0, 1, 4, 5] = float("nan")
    ncache._k[0, 1, 4, 5] = float("nan")
    x = torch.randn(2, 1, 64)
    with torch.no_grad():
        got = fused_step.step(block, x, cache)
        golden = gold(x.double(), cache=gcache)
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv(_ext.ENV, "0")
            mp.setenv(gemv.ENV, "off")
            naive = block(x, cache=ncache)
    assert got is not None
    assert got[0].isnan().all() and got[1].isfinite().all()
    assert naive[0].isnan().all()
    assert_close_rule(got[1:], golden[1:], naive[1:])


@pytest.mark.parametrize(
    "dtype,backend,P", [(torch.float32, "decode", 1), (torch.bfloat16, "auto", 6)]
)
def test_generate_takes_the_fused_step_and_makes_the_same_tokens(
    ext, monkeypatch, dtype, backend, P
) -> None:
    """`GPT.generate` plans the fused step once and runs it for every block and decode step
    (spied); the tokens equal those of the modules (``ATTNLAB_BLOCK_STEP=off``), greedy and
    sampled (same generator seed), and a model changed between calls is planned afresh. On the
    decode backend (a one-token prompt: its prefill is a decode call too) and with auto in
    bfloat16 (auto's decode steps take the decode backend)."""
    torch.manual_seed(0)
    cfg = TransformerConfig(
        vocab_size=97,
        d_model=64,
        n_layers=3,
        n_heads=4,
        n_kv_heads=2,
        norm="rmsnorm",
        mlp="swiglu",
        bias=False,
        max_seq_len=64,
        attn_backend=backend,
        tie_embeddings=False,
    )
    model = GPT(cfg).eval()
    with torch.no_grad():  # weights large enough that the blocks, not the embeddings, decide
        for p in model.parameters():
            p.normal_(0.0, 0.2 if p.dim() == 2 else 1.0)
    model = model.to(dtype)
    prompt = torch.randint(0, 97, (2, P))
    runs = []
    real = fused_step.StepPlan.run

    def spy(self, x, cache):
        y = real(self, x, cache)
        runs.append(y is not None)
        return y

    def both() -> tuple[torch.Tensor, torch.Tensor]:
        greedy = model.generate(prompt, 9, top_k=1)
        return greedy, model.generate(prompt, 9, generator=torch.Generator().manual_seed(2))

    # per call: a one-token prefill asks each block (an empty cache: declined), then 3 blocks ×
    # 8 steps run fused
    per_call = [False] * 3 * (P == 1) + [True] * 3 * 8
    monkeypatch.setattr(fused_step.StepPlan, "run", spy)
    fused = both()
    assert runs == per_call * 2
    assert all(len(set(row.tolist())) > 4 for row in fused[0])  # not one repeated token
    monkeypatch.setenv(fused_step.ENV, "off")
    modules = both()
    assert runs == per_call * 2  # planned off: no plan ran
    assert torch.equal(fused[0], modules[0]) and torch.equal(fused[1], modules[1])
    monkeypatch.delenv(fused_step.ENV)
    with torch.no_grad():
        model.blocks[1].mlp.down.weight.mul_(-3.0)
        model.lm_head.weight.mul_(1.5)
    changed = model.generate(prompt, 9, top_k=1)
    assert runs == per_call * 3
    monkeypatch.setenv(fused_step.ENV, "off")
    assert torch.equal(changed, model.generate(prompt, 9, top_k=1))
    assert not torch.equal(changed, fused[0])  # the change reached the tokens


def _hook(module, args, out):
    return out


def _out_of_scope(case, block, cache, x, fired, monkeypatch):
    """Puts ``block``/``cache``/``x`` in the state ``case`` names (a hook appends to ``fired``);
    returns ``(cache, x, hook handle or None)``."""
    handle = None
    if case == "training":
        block.train()
    elif case == "hook on a projection":
        handle = block.attn.qkv_proj.register_forward_hook(lambda *a: fired.append(1))
    elif case == "pre-hook on the norm":
        handle = block.norm2.register_forward_pre_hook(lambda *a: fired.append(1))
    elif case == "global hook":
        handle = torch.nn.modules.module.register_module_forward_hook(
            lambda m, a, o: fired.append(1) if m is block.mlp else None
        )
    elif case == "sdpa backend":
        block.attn.backend = "sdpa"
    elif case == "sliding-window cache":
        cache = SlidingWindowCache(32)
        with torch.no_grad():
            block(torch.randn(1, 5, 64), mask=masks.causal(), cache=cache)
    elif case == "keys before rope":
        cache = KVCache(16)
        with torch.no_grad():
            block(torch.randn(1, 5, 64), mask=masks.causal(), cache=cache)
    elif case == "two tokens":
        x = torch.randn(1, 2, 64)
    elif case == "cache full":
        with torch.no_grad():
            block(torch.randn(1, 1, 64), cache=cache)  # the 6th and last row
    elif case == "extension off":
        monkeypatch.setenv(_ext.ENV, "0")
    elif case == "dtype differs":
        x = x.double()
    return cache, x, handle


@pytest.mark.parametrize(
    "case",
    [
        "grad",
        "training",
        "hook on a projection",
        "pre-hook on the norm",
        "global hook",
        "alibi",
        "sdpa backend",
        "sliding-window cache",
        "keys before rope",
        "two tokens",
        "cache full",
        "extension off",
        "dtype differs",
    ],
)
def test_what_the_fused_step_leaves_to_the_modules(ext, monkeypatch, case) -> None:
    """Each condition outside the fused step's scope makes it decline (None, the cache
    untouched), and the block's forward then runs its modules (hooks fire, errors raise)."""
    kw = dict(CONFIGS["llama (rms, swiglu silu, rope, gqa)"])
    if case == "alibi":
        kw.pop("rope")
    block = _block(1, torch.float32, **kw)
    if case == "alibi":
        block.attn.bias_fn = ALiBi(4, causal=True)
    cache = _prefilled(block, 1, 5, 6 if case == "cache full" else 16, seed=2)
    block.attn.backend = "auto"  # the modules' path must run every case (grad too)
    x = torch.randn(1, 1, 64)
    fired: list[int] = []
    ctx = torch.enable_grad() if case == "grad" else torch.no_grad()
    cache, x, handle = _out_of_scope(case, block, cache, x, fired, monkeypatch)
    before = (len(cache), cache.seen)
    try:
        with ctx:
            assert fused_step.step(block, x, cache) is None
            assert (len(cache), cache.seen) == before
            if case == "cache full":
                with pytest.raises(CacheOverflowError):
                    block(x, cache=cache)
            elif case == "dtype differs":
                with pytest.raises((RuntimeError, ValueError)):
                    block(x, cache=cache)
            else:
                y = block(x, mask=masks.causal() if case == "two tokens" else None, cache=cache)
                assert y.shape == x.shape and y.isfinite().all()
    finally:
        if handle is not None:
            handle.remove()
    if case in ("hook on a projection", "pre-hook on the norm", "global hook"):
        assert fired


def test_the_operator_checks_its_arguments(ext) -> None:
    """``attnlab_block::step`` refuses what would write outside the cache or mis-split q/k/v,
    with a message naming the argument."""
    block = _block(2, torch.float32, **CONFIGS["llama (rms, swiglu silu, rope, gqa)"])
    cache = _prefilled(block, 1, 4, 8, seed=3)
    with torch.no_grad():
        p = fused_step.plan(block, 1, torch.float32)
    assert p is not None
    cos, sin = block.attn.rope.table(16, torch.device("cpu"), torch.float32)
    x = torch.randn(1, 1, 64)
    op = torch.ops.attnlab_block.step
    with pytest.raises(RuntimeError, match="length must leave a free cache row"):
        op(x, cache._k, cache._v, 8, cos, sin, *p.static)
    with pytest.raises(RuntimeError, match=r"x must be \(B, 1, E\)"):
        op(torch.randn(1, 2, 64), cache._k, cache._v, 4, cos, sin, *p.static)
    with pytest.raises(RuntimeError, match="caches must both be"):
        op(x, cache._k, cache._v[:, :1], 4, cos, sin, *p.static)
    bad = list(p.static)
    bad[11] = 3  # heads: 3 + 2·2 heads of 16 do not make the 128 rows of qkv_w
    with pytest.raises(RuntimeError, match="qkv_w must be"):
        op(x, cache._k, cache._v, 4, cos, sin, *bad)
    bad = list(p.static)
    bad[13] = "batch"
    with pytest.raises(RuntimeError, match="norm must be 'rms' or 'layer'"):
        op(x, cache._k, cache._v, 4, cos, sin, *bad)
    assert len(cache) == 4  # nothing was appended by the refused calls
