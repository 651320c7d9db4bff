"""The transformers bridge itself: registration, the mask function, the attention function.

- ``import attnlab`` / ``import attnlab.hf`` do not import transformers; without it `register`
  names ``attnlab[hf]`` in one line; `register` is idempotent and refuses transformers < 5.4.
- The lower bound's API: the keywords transformers 5.4 passes to a mask interface and the
  masking primitives the bridge recognises (names, closure variables) exist in the installed one.
- `hf_mask` equals transformers' own boolean mask pair by pair for causal, padding, decoding,
  sliding-window caches, static caches, bidirectional (windowed) and cross attention, packed
  sequences and unknown patterns — structured attnlab masks where the offsets align, HF's own
  function (exact) elsewhere; nothing reads tensor data (meta tensors work).
- `attention_forward`: GQA without repeated k/v, dropout in training, soft-capping passed on,
  user 4-D masks, and clear errors for what attnlab does not compute.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import subprocess
import sys
from pathlib import Path

import pytest
import tomllib
import torch

import attnlab
import attnlab.hf
from attnlab import masks
from attnlab.hf import HFMask, UnsupportedAttentionError, attention_forward, hf_mask
from attnlab.utils.extras import MissingExtraError

transformers = pytest.importorskip("transformers")
if attnlab.hf.bridge._version_tuple(transformers.__version__) < attnlab.hf.MIN_TRANSFORMERS:
    pytest.skip("attnlab.hf needs transformers>=5.4", allow_module_level=True)

from transformers import masking_utils as mu  # noqa: E402
from transformers.modeling_utils import AttentionInterface  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SRC = str(ROOT / "src")

# ------------------------------------------------------------------- import and registration


def _run(code: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": SRC}
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120
    )


def test_importing_attnlab_hf_does_not_import_transformers():
    r = _run("import sys, attnlab, attnlab.hf; print('transformers' in sys.modules)")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "False"


def test_missing_transformers_names_the_extra_in_one_line():
    code = (
        "import sys; sys.modules['transformers'] = None\n"
        "import attnlab.hf\n"
        "try:\n    attnlab.hf.register()\n"
        "except ImportError as e:\n    print(type(e).__name__); print(repr(str(e)))\n"
    )
    r = _run(code)
    assert r.returncode == 0, r.stderr
    kind, message = r.stdout.strip().splitlines()
    assert kind == MissingExtraError.__name__
    assert "\\n" not in message and "attnlab[hf]" in message and "transformers" in message


def test_register_is_idempotent_and_fills_both_interfaces():
    attnlab.hf.register()
    before = (
        dict(AttentionInterface._global_mapping),
        dict(mu.AttentionMaskInterface._global_mapping),
    )
    attnlab.hf.register()
    after = (
        dict(AttentionInterface._global_mapping),
        dict(mu.AttentionMaskInterface._global_mapping),
    )
    assert before == after
    assert AttentionInterface._global_mapping["attnlab"] is attention_forward
    assert mu.AttentionMaskInterface._global_mapping["attnlab"] is hf_mask


def test_register_refuses_transformers_older_than_the_lower_bound(monkeypatch):
    # the module register() imports (transformers may have replaced its entry in sys.modules)
    monkeypatch.setattr(sys.modules["transformers"], "__version__", "5.3.0")
    with pytest.raises(ImportError, match=r"transformers>=5\.4, found 5\.3\.0"):
        attnlab.hf.register()


def test_hf_extra_declares_the_lower_bound():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    want = ".".join(map(str, attnlab.hf.MIN_TRANSFORMERS))
    assert extras["hf"] == [f"transformers>={want}"]
    assert "hf" in extras["all"][0]


# ---------------------------------------------------------------------- the lower bound's API

# What transformers 5.4.0 (the lower bound; read from its wheel) passes to a mask interface from
# create_causal_mask / create_sliding_window_causal_mask / create_bidirectional_mask.
API_5_4_MASK_KEYWORDS = {
    "batch_size",
    "q_length",
    "kv_length",
    "q_offset",
    "kv_offset",
    "mask_function",
    "attention_mask",
    "allow_is_causal_skip",
    "allow_is_bidirectional_skip",
    "local_size",
    "dtype",
    "config",
    "use_vmap",
    "device",
}
SEMANTIC = {
    "batch_size",
    "q_length",
    "kv_length",
    "q_offset",
    "kv_offset",
    "mask_function",
    "attention_mask",
}
# The masking primitives of 5.4.0 the bridge recognises, with the closure variables it reads.
API_5_4_PRIMITIVES = {
    "and_masks": ("and_masks.<locals>.and_mask", "mask_functions"),
    "sliding_window_overlay": ("sliding_window_overlay.<locals>.inner_mask", "sliding_window"),
    "sliding_window_bidirectional_overlay": (
        "sliding_window_bidirectional_overlay.<locals>.inner_mask",
        "sliding_window",
    ),
    "packed_sequence_mask_function": (
        "packed_sequence_mask_function.<locals>.inner_mask",
        "packed_sequence_mask",
    ),
}


def test_hf_mask_accepts_every_keyword_of_the_lower_bound():
    kw = {k: None for k in API_5_4_MASK_KEYWORDS - SEMANTIC}
    out = hf_mask(
        batch_size=1,
        q_length=3,
        kv_length=3,
        q_offset=0,
        kv_offset=0,
        mask_function=mu.causal_mask_function,
        attention_mask=None,
        **kw,
    )
    assert isinstance(out.mask, masks.CausalMask)


def test_installed_transformers_passes_the_lower_bound_keywords(monkeypatch):
    seen = []

    def spy(**kwargs):
        seen.append(set(kwargs))
        return hf_mask(**kwargs)

    attnlab.hf.register()
    monkeypatch.setitem(mu.AttentionMaskInterface._global_mapping, "attnlab", spy)
    config = transformers.LlamaConfig(
        vocab_size=50,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
    )
    config._attn_implementation = "attnlab"
    embeds = torch.zeros(2, 4, 16)
    mu.create_causal_mask(
        config=config, inputs_embeds=embeds, attention_mask=torch.ones(2, 4), past_key_values=None
    )
    config.sliding_window = 2
    mu.create_sliding_window_causal_mask(
        config=config, inputs_embeds=embeds, attention_mask=torch.ones(2, 4), past_key_values=None
    )
    mu.create_bidirectional_mask(
        config=config, inputs_embeds=embeds, attention_mask=torch.ones(2, 4)
    )
    assert len(seen) == 3
    for keys in seen:
        assert SEMANTIC <= keys <= API_5_4_MASK_KEYWORDS | {"local_size"}


@pytest.mark.parametrize("name", sorted(API_5_4_PRIMITIVES))
def test_recognised_primitives_exist_with_their_closures(name):
    qualname, freevar = API_5_4_PRIMITIVES[name]
    factory = getattr(mu, name)
    made = (
        factory(mu.causal_mask_function)
        if name == "and_masks"
        else factory(
            torch.zeros(1, 1, dtype=torch.long) if name == "packed_sequence_mask_function" else 2
        )
    )
    assert made.__module__ == "transformers.masking_utils"
    assert made.__qualname__ == qualname
    assert freevar in made.__code__.co_freevars
    for fn in ("causal_mask_function", "bidirectional_mask_function", "sdpa_mask"):
        assert callable(getattr(mu, fn))
    assert callable(AttentionInterface.register) and callable(mu.AttentionMaskInterface.register)


# ------------------------------------------------------------------------------ hf_mask


B = 2
PAD = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1, 1]], dtype=torch.bool)
POS = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4], [0, 1, 0, 1, 2, 3, 4, 5]])
PACKED = mu.find_packed_sequence_indices(POS)


def _packed(inner):
    if hasattr(mu, "packed_sequence_compatibility_function"):
        return mu.packed_sequence_compatibility_function(inner, POS, PACKED)
    return mu.and_masks(inner, mu.packed_sequence_mask_function(PACKED))  # 5.4's form


CASES = {
    # name: (kwargs of the mask interface, the attnlab kind expected inside)
    "causal": (dict(q_length=8, kv_length=8, mask_function=mu.causal_mask_function), "causal()"),
    "causal+left padding": (
        dict(q_length=8, kv_length=8, mask_function=mu.causal_mask_function, attention_mask=PAD),
        "(causal() & from_tensor(shape=(2, 1, 1, 8)))",
    ),
    "decode one token": (
        dict(
            q_length=1,
            kv_length=8,
            q_offset=7,
            mask_function=mu.causal_mask_function,
            attention_mask=PAD,
        ),
        "(causal() & from_tensor(shape=(2, 1, 1, 8)))",
    ),
    "chunked prefill after a cache": (
        dict(
            q_length=3,
            kv_length=8,
            q_offset=5,
            mask_function=mu.causal_mask_function,
            attention_mask=PAD,
        ),
        "(causal() & from_tensor(shape=(2, 1, 1, 8)))",
    ),
    "full sliding-window cache": (  # cumulative 6, window 3: keys 4..7, queries 6, 7
        dict(
            q_length=2,
            kv_length=4,
            q_offset=6,
            kv_offset=4,
            attention_mask=PAD,
            mask_function=mu.sliding_window_causal_mask_function(3),
        ),
        "sliding_window(3, causal=True)",  # keys 4..7 carry no padding: dropped (eager)
    ),
    "static cache": (  # 5 tokens seen, a buffer of 10, queries 3 and 4: keys 0..4 used
        dict(
            q_length=2,
            kv_length=10,
            q_offset=torch.tensor(3),
            attention_mask=PAD[:, :5],
            mask_function=mu.causal_mask_function,
        ),
        "(causal() & from_tensor(shape=(2, 1, 1, 5)))",
    ),
    "static cache prefill": (  # an empty buffer of 10, a prompt of 6
        dict(
            q_length=6,
            kv_length=10,
            q_offset=torch.tensor(0),
            attention_mask=PAD[:, :6],
            mask_function=mu.causal_mask_function,
        ),
        "(causal() & from_tensor(shape=(2, 1, 1, 6)))",
    ),
    "static cache decode": (  # token 7 of a buffer of 10
        dict(
            q_length=1,
            kv_length=10,
            q_offset=torch.tensor(7),
            attention_mask=PAD,
            mask_function=mu.causal_mask_function,
        ),
        "(causal() & from_tensor(shape=(2, 1, 1, 8)))",
    ),
    "static sliding-window cache": (  # window 3, 6 tokens seen in a buffer of 8
        dict(
            q_length=2,
            kv_length=8,
            q_offset=torch.tensor(4),
            attention_mask=PAD[:, :6],
            mask_function=mu.sliding_window_causal_mask_function(3),
        ),
        "(sliding_window(3, causal=True) & from_tensor(shape=(2, 1, 1, 6)))",
    ),
    "static cache, bidirectional (whole buffer)": (
        dict(
            q_length=2,
            kv_length=10,
            q_offset=torch.tensor(3),
            attention_mask=PAD[:, :5],
            mask_function=mu.bidirectional_mask_function,
        ),
        "from_tensor(shape=(2, 1, 1, 10))",
    ),
    "one row, not recognised": (  # decoding: HF's own function on the row, a key mask
        dict(
            q_length=1,
            kv_length=8,
            q_offset=7,
            mask_function=mu.or_masks(mu.causal_mask_function, lambda b, h, q, kv: kv == 0),
        ),
        "from_tensor(shape=(2, 1, 1, 8))",
    ),
    "bidirectional+padding": (
        dict(
            q_length=8,
            kv_length=8,
            mask_function=mu.bidirectional_mask_function,
            attention_mask=PAD,
        ),
        "from_tensor(shape=(2, 1, 1, 8))",
    ),
    "cross attention": (
        dict(
            q_length=3,
            kv_length=8,
            mask_function=mu.bidirectional_mask_function,
            attention_mask=PAD,
        ),
        "from_tensor(shape=(2, 1, 1, 8))",
    ),
    "bidirectional window": (
        dict(
            q_length=8,
            kv_length=8,
            attention_mask=PAD,
            mask_function=mu.sliding_window_bidirectional_mask_function(2),
        ),
        "(sliding_window(3, causal=False) & from_tensor(shape=(2, 1, 1, 8)))",
    ),
    "packed causal": (
        dict(q_length=8, kv_length=8, mask_function=_packed(mu.causal_mask_function)),
        "causal() & document",
    ),
    "packed window": (
        dict(
            q_length=8,
            kv_length=8,
            mask_function=_packed(mu.sliding_window_causal_mask_function(2)),
        ),
        "sliding_window(2, causal=True) & document",
    ),
    "packed bidirectional window": (
        dict(
            q_length=8,
            kv_length=8,
            mask_function=_packed(mu.sliding_window_bidirectional_mask_function(2)),
        ),
        "sliding_window(3, causal=False) & document",
    ),
    "chunked attention (not recognised)": (
        dict(
            q_length=8,
            kv_length=8,
            attention_mask=PAD,
            mask_function=mu.chunked_causal_mask_function(3, torch.tensor([2, 0])),
        ),
        "(from_fn(hf_pattern) & from_tensor(shape=(2, 1, 1, 8)))",
    ),
    "or_masks (not recognised)": (
        dict(
            q_length=8,
            kv_length=8,
            mask_function=mu.or_masks(mu.causal_mask_function, lambda b, h, q, kv: kv == 0),
        ),
        "from_fn(hf_pattern)",
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_hf_mask_equals_transformers_mask(case):
    kw, kind = CASES[case]
    got = hf_mask(batch_size=B, **kw)
    want = mu.sdpa_mask(batch_size=B, allow_is_causal_skip=False, **kw)  # (B, 1, L, S) bool
    assert isinstance(got, HFMask) and tuple(got.shape) == tuple(want.shape)
    L, S = kw["q_length"], kw["kv_length"]
    assert torch.equal(got.mask.to_dense(L, S, batch=B).expand_as(want), want), case
    mask, n = got.mask, S
    if got.used is not None:  # a static cache in eager mode: the keys the call uses
        n, mask = got.used
        assert "static" in case and n < S
        dense = mask.to_dense(L, n, batch=B).expand(B, 1, L, n)
        dense = torch.nn.functional.pad(dense, (0, S - n), value=False)  # the unused keys
        assert torch.equal(dense, want), case
    text = repr(mask)
    assert all(part in text for part in kind.split(" & ")) if "document" in kind else text == kind


def test_an_all_ones_padding_mask_is_dropped_in_eager_mode():
    """transformers passes a 2-D mask of ones with every tokenizer batch and in ``generate``: in
    eager mode (one read per forward, as transformers' sdpa path reads it) the call is the
    pattern alone; with any padding the key mask stays."""
    ones = torch.ones(2, 8, dtype=torch.long)
    kw = dict(batch_size=2, q_length=8, kv_length=8, mask_function=mu.causal_mask_function)
    assert repr(hf_mask(attention_mask=ones, **kw).mask) == "causal()"
    assert "from_tensor" in repr(hf_mask(attention_mask=PAD, **kw).mask)
    bidirectional = dict(kw, mask_function=mu.bidirectional_mask_function)
    assert hf_mask(attention_mask=ones, **bidirectional) is None


def test_bidirectional_without_padding_is_no_mask():
    assert (
        hf_mask(batch_size=2, q_length=4, kv_length=4, mask_function=mu.bidirectional_mask_function)
        is None
    )


def test_a_prebuilt_mask_is_passed_through():
    built = hf_mask(
        batch_size=2,
        q_length=1,
        kv_length=8,
        q_offset=torch.tensor(7),
        mask_function=mu.causal_mask_function,
        attention_mask=PAD,
    )
    assert built.contiguous() is built and built.ndim == 4 and built.dim() == 4
    again = hf_mask(
        batch_size=2,
        q_length=1,
        kv_length=8,
        q_offset=torch.tensor(7),
        mask_function=mu.causal_mask_function,
        attention_mask=built,
    )
    assert again is built


def _meta_cases():
    meta = torch.device("meta")
    pad = torch.ones(2, 8, dtype=torch.bool, device=meta)
    packed = mu.packed_sequence_mask_function(PACKED.to(meta))
    return {
        "causal+padding": dict(
            q_length=8, kv_length=8, mask_function=mu.causal_mask_function, attention_mask=pad
        ),
        "static cache": dict(
            q_length=8,
            kv_length=12,
            q_offset=torch.tensor(0, device=meta),
            mask_function=mu.causal_mask_function,
            attention_mask=pad,
        ),
        "packed": dict(
            q_length=8, kv_length=8, mask_function=mu.and_masks(mu.causal_mask_function, packed)
        ),
    }


@pytest.mark.parametrize("case", ["causal+padding", "static cache", "packed"])
def test_hf_mask_and_attention_read_no_data(case):
    """Meta tensors carry no data: building the masks and running attention must not read any."""
    kw = _meta_cases()[case]
    out = hf_mask(batch_size=2, device="meta", **kw)
    S = kw["kv_length"]
    q = torch.empty(2, 4, 8, 16, device="meta")
    k = v = torch.empty(2, 2, S, 16, device="meta")
    o, w = attention_forward(_Module(), q, k, v, out)
    assert o.shape == (2, 8, 4, 16) and o.device.type == "meta" and w is None


def test_hf_mask_rejects_a_non_callable_mask_function():
    with pytest.raises(TypeError, match="mask_function"):
        hf_mask(batch_size=1, q_length=2, kv_length=2, mask_function=None)


# ------------------------------------------------------------------------ attention_forward


class _Module(torch.nn.Module):
    is_causal = True


def _qkv(h=4, h_kv=2, L=5, S=5, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, h, L, d, generator=g, dtype=torch.float64)
    k = torch.randn(2, h_kv, S, d, generator=g, dtype=torch.float64)
    v = torch.randn(2, h_kv, S, d, generator=g, dtype=torch.float64)
    return q, k, v


def test_gqa_is_not_repeated_and_matches_the_repeated_formula(monkeypatch):
    q, k, v = _qkv()
    mask = hf_mask(
        batch_size=2,
        q_length=5,
        kv_length=5,
        mask_function=mu.causal_mask_function,
        attention_mask=PAD[:, 3:],
    )
    seen = []
    real = attnlab.hf.bridge.attention

    def spy(q_, k_, v_, **kw):
        seen.append((k_.shape, v_.shape, kw))
        return real(q_, k_, v_, **kw)

    monkeypatch.setattr(attnlab.hf.bridge, "attention", spy)
    out, w = attention_forward(_Module(), q, k, v, mask, scaling=0.3, output_attentions=True)
    assert seen[0][0] == k.shape and seen[0][1] == v.shape  # H_kv = 2 heads, not 4
    assert seen[0][2]["scale"] == 0.3
    dense = mask.mask.to_dense(5, 5, batch=2)
    kr, vr = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    s = (q @ kr.transpose(-1, -2) * 0.3).masked_fill(~dense, float("-inf"))
    p = torch.softmax(s, -1).nan_to_num(0.0)
    torch.testing.assert_close(w, p, atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(out, (p @ vr).transpose(1, 2), atol=1e-12, rtol=1e-10)
    assert out.is_contiguous()


def test_a_static_cache_call_never_reads_the_unused_buffer():
    """A static cache's call (tensor q_offset, a buffer longer than the tokens seen) runs on the
    keys up to the last query's position: NaN in the unused buffer never reaches the output,
    which equals transformers' own dense mask over the whole buffer; the weights come back for
    the whole buffer (zeros past the used keys)."""
    q, k, v = _qkv(L=2, S=10)
    k[:, :, 5:], v[:, :, 5:] = float("nan"), float("nan")  # an unwritten buffer
    kw = dict(
        q_length=2,
        kv_length=10,
        q_offset=torch.tensor(3),
        attention_mask=PAD[:, :5],
        mask_function=mu.causal_mask_function,
    )
    mask = hf_mask(batch_size=2, **kw)
    assert mask.used is not None and mask.used[0] == 5
    out, w = attention_forward(_Module(), q, k, v, mask, scaling=0.3, output_attentions=True)
    dense = mu.sdpa_mask(batch_size=2, allow_is_causal_skip=False, **kw)  # (2, 1, 2, 10)
    kr, vr = k.nan_to_num(0.0).repeat_interleave(2, 1), v.nan_to_num(0.0).repeat_interleave(2, 1)
    s = (q @ kr.transpose(-1, -2) * 0.3).masked_fill(~dense, float("-inf"))
    p = torch.softmax(s, -1).nan_to_num(0.0)
    assert w.shape == (2, 4, 2, 10) and not w[..., 5:].any()
    torch.testing.assert_close(w, p, atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(out, (p @ vr).transpose(1, 2), atol=1e-12, rtol=1e-10)


@pytest.mark.parametrize("static", [False, True])
def test_a_decoding_step_runs_the_cpp_step_with_the_keys_rendered_once(static, monkeypatch):
    """A decoding step's HFMask carries its key mask (rendered once for every layer); with the C++
    step built the call runs on it directly and equals `attnlab.attention` with the mask, NaN
    in keys no row attends (left padding, a static buffer past the token) included."""
    from attnlab import _ext

    if _ext.mode() == "off" or not _ext.load("nan_rule"):
        pytest.skip(f"C++ extension unavailable: {_ext.status('nan_rule')}")
    S = 10 if static else 8
    q = torch.randn(2, 4, 1, 8)
    k, v = torch.randn(2, 2, S, 8), torch.randn(2, 2, S, 8)
    k[0, :, 1] = v[0, :, 1] = float("nan")  # item 0's left padding (PAD: its first 2 keys)
    k[:, :, 8:] = v[:, :, 8:] = float("nan")  # a static buffer's unwritten slots
    mask = hf_mask(
        batch_size=2,
        q_length=1,
        kv_length=S,
        q_offset=torch.tensor(7) if static else 7,
        mask_function=mu.causal_mask_function,
        attention_mask=PAD,
    )
    assert mask.step_keys is not None and mask.step_keys.shape == (2, 8)
    assert torch.equal(mask.step_keys, PAD.bool())
    calls = []
    real = attnlab.hf.bridge.decode_step_run
    monkeypatch.setattr(
        attnlab.hf.bridge, "decode_step_run", lambda *a: calls.append(1) or real(*a)
    )
    with torch.no_grad():
        out, _ = attention_forward(_Module(), q, k, v, mask, scaling=0.3)
        want = attnlab.attention(
            q,
            k[:, :, :8],
            v[:, :, :8],
            mask=masks.from_tensor(PAD.bool()[:, None, None]),
            scale=0.3,
        )
    assert calls == [1]
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, want.transpose(1, 2), atol=1e-6, rtol=1e-5)


def test_weights_only_when_asked():
    q, k, v = _qkv()
    mask = hf_mask(batch_size=2, q_length=5, kv_length=5, mask_function=mu.causal_mask_function)
    assert attention_forward(_Module(), q, k, v, mask)[1] is None
    assert attention_forward(_Module(), q, k, v, mask, output_attentions=True)[1].shape == (
        2,
        4,
        5,
        5,
    )


def test_user_4d_masks_are_used_as_given():
    q, k, v = _qkv()
    allowed = torch.ones(2, 1, 5, 5, dtype=torch.bool).tril()
    additive = torch.zeros(2, 1, 5, 5, dtype=torch.float64).masked_fill(~allowed, float("-inf"))
    structured = hf_mask(
        batch_size=2, q_length=5, kv_length=5, mask_function=mu.causal_mask_function
    )
    ref = attention_forward(_Module(), q, k, v, structured)[0]
    torch.testing.assert_close(attention_forward(_Module(), q, k, v, allowed)[0], ref)
    torch.testing.assert_close(attention_forward(_Module(), q, k, v, additive)[0], ref)


@pytest.mark.parametrize("name", ["position_bias", "indices", "block_indices"])
def test_unsupported_keywords_are_refused_by_name(name):
    q, k, v = _qkv()
    with pytest.raises(UnsupportedAttentionError, match=f"\\({name}") as info:
        attention_forward(_Module(), q, k, v, None, **{name: torch.zeros(4)})
    assert "_Module" in str(info.value) and "eager" in str(info.value)
    assert isinstance(info.value, ValueError)


def test_a_causal_call_without_a_mask_is_refused():
    q, k, v = _qkv()
    with pytest.raises(UnsupportedAttentionError, match="causal attention without a mask"):
        attention_forward(_Module(), q, k, v, None)
    with pytest.raises(UnsupportedAttentionError, match=r"sliding-window \(3\)"):
        attention_forward(_Module(), q, k, v, None, is_causal=False, sliding_window=3)
    # one query row: causal over all keys, which is what no mask means
    out, _ = attention_forward(_Module(), q[:, :, :1], k, v, None)
    assert out.shape == (2, 1, 4, 8)


def test_softcap_is_passed_on_or_refused(monkeypatch):
    q, k, v = _qkv()
    mask = hf_mask(batch_size=2, q_length=5, kv_length=5, mask_function=mu.causal_mask_function)
    if not attnlab.hf.bridge._has_softcap():
        with pytest.raises(UnsupportedAttentionError, match=r"soft-capping \(softcap=30.0\)"):
            attention_forward(_Module(), q, k, v, mask, softcap=30.0)
        return
    seen = []
    real = attnlab.hf.bridge.attention
    monkeypatch.setattr(
        attnlab.hf.bridge, "attention", lambda *a, **kw: seen.append(kw) or real(*a, **kw)
    )
    attention_forward(_Module(), q, k, v, mask, softcap=30.0)
    assert seen[0]["softcap"] == 30.0


# ------------------------------------------------------------------------------ dropout


def test_dropout_is_applied_in_training_only(tmp_path, monkeypatch):
    attnlab.hf.register()
    config = transformers.LlamaConfig(
        vocab_size=50,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        attention_dropout=0.5,
    )
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, attn_implementation="attnlab"
    )
    seen = []
    real = attnlab.hf.bridge.attention
    monkeypatch.setattr(
        attnlab.hf.bridge,
        "attention",
        lambda *a, **kw: seen.append(kw["dropout_p"]) or real(*a, **kw),
    )
    ids = torch.tensor([[3, 4, 5, 6, 7, 8]])
    model.eval()
    with torch.no_grad():
        ref = model(input_ids=ids).logits
    model.train()
    torch.manual_seed(1)
    a = model(input_ids=ids).logits
    torch.manual_seed(1)
    b = model(input_ids=ids).logits
    torch.manual_seed(2)
    c = model(input_ids=ids).logits
    assert seen == [0.0, 0.5, 0.5, 0.5]
    assert torch.equal(a, b)  # the dropout draws come from torch's generator
    assert not torch.allclose(a, ref) and not torch.allclose(a, c)
    a.sum().backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)


def test_the_module_example_runs():
    import doctest

    (test,) = doctest.DocTestFinder().find(attnlab.hf, "attnlab.hf")[:1]
    assert test.name == "attnlab.hf"  # the module docstring
    assert len(test.examples) >= 8
    result = doctest.DocTestRunner(optionflags=doctest.NORMALIZE_WHITESPACE).run(test)
    assert result.failed == 0 and result.attempted == len(test.examples)


def test_an_attention_registered_without_the_mask_function_is_refused(tmp_path):
    """The known trap: without a mask interface HF passes no mask and padding is ignored."""
    AttentionInterface.register("attnlab_without_mask", attention_forward)
    config = transformers.BertConfig(
        vocab_size=50,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
    )
    transformers.BertModel(config).save_pretrained(tmp_path)
    model = transformers.BertModel.from_pretrained(
        tmp_path, attn_implementation="attnlab_without_mask"
    )
    ids, mask = torch.tensor([[0, 0, 5, 6]]), torch.tensor([[0, 0, 1, 1]])
    with pytest.raises(UnsupportedAttentionError, match="padding would be silently ignored"):
        model(input_ids=ids, attention_mask=mask)
