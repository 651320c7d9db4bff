"""PyTorch's own MultiheadAttention and SDPA tests, restated for attnlab (issue #38 item 8).

PyTorch's test files are not vendored. Each test here restates one of them (named in its
docstring) against the `nn.MultiheadAttention` drop-in (`attnlab.nn.MultiheadAttention`,
patched into ``torch.nn`` where torch's own Transformer classes must build it) or against
`attnlab.attention` called as torch's SDPA. torch itself is the oracle where the behaviour is meant
to be the same; where attnlab differs on purpose the test asserts the documented difference.
"""

from __future__ import annotations

from collections.abc import Callable
from unittest.mock import ANY, MagicMock

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import attnlab
from attnlab._shapes import leading_to_4d
from attnlab.modules.torch_compat import MaskDtypeError, ShapeAssertionError, ShapeRuntimeError
from attnlab.nn import MultiheadAttention

pytestmark = pytest.mark.usefixtures("fresh_dynamo")

TorchMHA = torch.nn.MultiheadAttention  # torch's class, whatever a test patches in later


def _patch_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    """``nn.MultiheadAttention`` is attnlab's drop-in for this test (and for the classes of
    ``torch.nn`` that build one: TransformerEncoderLayer / TransformerDecoderLayer)."""
    for where in (nn, nn.modules.activation, nn.modules.transformer):
        monkeypatch.setattr(where, "MultiheadAttention", MultiheadAttention)


def _pair(E: int, H: int, **kw) -> tuple[nn.Module, MultiheadAttention]:
    torch.manual_seed(0)
    theirs = TorchMHA(E, H, **kw)
    ours = MultiheadAttention(E, H, **kw)
    ours.load_state_dict(theirs.state_dict())
    return theirs, ours


# ------------------------------------------------------------------------ invalid shapes
# (name, inputs (query, key, value) -> forward kwargs, torch's message is ours too)
Case = tuple[str, Callable[[], tuple[tuple[Tensor, ...], dict]], bool]


def _r(*shape: int) -> Tensor:
    return torch.randn(*shape)


def _b(*shape: int) -> Tensor:
    return torch.rand(*shape) > 0.5


def _invalid_cases(batch_first: bool = False) -> list[Case]:
    """The cases of torch's ``_test_multihead_attn_invalid_shape_impl`` (E = H = 4, all sizes 4)
    and the remaining shape/dtype checks of torch's Python path."""
    kv3 = (3, 4, 4) if batch_first else (4, 3, 4)  # key/value with a batch of 3
    q3 = (_r(4, 4, 4), _r(4, 4, 4), _r(4, 4, 4))  # distinct: not torch's fused path
    q2 = (_r(4, 4), _r(4, 4), _r(4, 4))
    return [
        # torch's cases, batched (3-D) query
        ("3-D query, 2-D key", lambda: ((q3[0], _r(4, 4), q3[2]), {}), True),
        ("3-D query, 2-D value", lambda: ((q3[0], q3[1], _r(4, 4)), {}), True),
        ("3-D query, 1-D key_padding_mask", lambda: (q3, {"key_padding_mask": _b(4)}), True),
        ("3-D query, 1-D attn_mask", lambda: (q3, {"attn_mask": _b(4)}), True),
        # torch's cases, unbatched (2-D) query
        ("2-D query, 3-D key", lambda: ((q2[0], _r(4, 4, 4), q2[2]), {}), True),
        ("2-D query, 3-D value", lambda: ((q2[0], q2[1], _r(4, 4, 4)), {}), True),
        ("2-D query, 2-D key_padding_mask", lambda: (q2, {"key_padding_mask": _b(1, 8)}), True),
        ("2-D query, 1-D attn_mask", lambda: (q2, {"attn_mask": _b(4)}), True),
        ("2-D query, 3-D attn_mask (5, 4, 4)", lambda: (q2, {"attn_mask": _b(5, 4, 4)}), True),
        # the rest of torch's Python checks
        ("4-D query", lambda: ((_r(1, 4, 4, 4), _r(1, 4, 4, 4), _r(1, 4, 4, 4)), {}), True),
        ("embed dim 8", lambda: ((_r(4, 4, 8), _r(4, 4, 8), _r(4, 4, 8)), {}), True),
        ("key (4, 4, 4) vs value (3, 4, 4)", lambda: ((q3[0], q3[1], _r(3, 4, 4)), {}), True),
        ("key batch 3", lambda: ((q3[0], _r(*kv3), _r(*kv3)), {}), False),
        ("2-D attn_mask (3, 4)", lambda: (q3, {"attn_mask": _b(3, 4)}), True),
        ("3-D attn_mask (5, 4, 4)", lambda: (q3, {"attn_mask": _b(5, 4, 4)}), True),
        ("key_padding_mask (4, 3)", lambda: (q3, {"key_padding_mask": _b(4, 3)}), True),
        ("key_padding_mask (3, 4)", lambda: (q3, {"key_padding_mask": _b(3, 4)}), True),
        ("int attn_mask", lambda: (q3, {"attn_mask": torch.zeros(4, 4, dtype=torch.int64)}), True),
    ]


def _raised(fn: Callable[[], object]) -> BaseException:
    try:
        fn()
    except Exception as e:  # the exception is the subject of the test
        return e
    raise AssertionError("no exception raised")


def _check_invalid(
    theirs: nn.Module,
    ours: MultiheadAttention,
    cases: list[Case],
    monkeypatch: pytest.MonkeyPatch,
    **fwd,
) -> None:
    """Each case raises, in torch and in the drop-in, an exception of torch's type (the drop-in's
    is also attnlab's ValueError/TypeError) with torch's message, before any projection."""
    for name, make, same_message in cases:
        torch.manual_seed(1)
        xs, kw = make()
        want = _raised(lambda xs=xs, kw=kw: theirs(*xs, **kw, **fwd))
        calls: list[int] = []
        with monkeypatch.context() as m:
            m.setattr(F, "linear", lambda *a, calls=calls, **k: calls.append(1))
            got = _raised(lambda xs=xs, kw=kw: ours(*xs, **kw, **fwd))
        assert isinstance(got, type(want)), (name, repr(want), repr(got))
        assert isinstance(got, (ShapeAssertionError, ShapeRuntimeError, MaskDtypeError)), name
        assert isinstance(got, (ValueError, TypeError)), name
        if same_message:
            assert str(want) in str(got), (name, str(want), str(got))
        assert calls == [], name  # raised before the projections


@pytest.mark.parametrize("mode", ["train", "eval_no_grad"])
def test_multihead_attn_invalid_shape(mode, monkeypatch):
    """Restates ``test_multihead_attn_invalid_shape`` (test/nn/test_multihead_attention.py).

    torch raises AssertionError for wrong ranks of query/key/value and the masks (RuntimeError for
    an attn_mask of the wrong size): code catching torch's exceptions must catch the drop-in's.
    """
    theirs, ours = _pair(4, 4)
    if mode == "eval_no_grad":
        theirs.eval(), ours.eval()
    with torch.no_grad() if mode == "eval_no_grad" else torch.enable_grad():
        _check_invalid(theirs, ours, _invalid_cases(), monkeypatch)


def test_multihead_attn_fast_path_invalid_shape(monkeypatch):
    """Restates ``test_multihead_attn_fast_path_invalid_shape`` (test_multihead_attention.py).

    Eval mode, batch_first, no grad, need_weights=False: torch's fused-path conditions. torch's
    cases (query, key, value distinct) still go through its Python checks: AssertionError. With
    self-attention (``query is key is value``) torch takes its fused path and its C++ kernel
    raises RuntimeError; the drop-in, which never calls that kernel, raises RuntimeError there too.
    """
    theirs, ours = _pair(4, 4, batch_first=True)
    theirs.eval(), ours.eval()
    x = _r(4, 4, 4)
    self_attention: list[Case] = [
        (f"self-attention, {what}", lambda kw=kw: ((x, x, x), kw), False)
        for what, kw in [
            ("1-D key_padding_mask", {"key_padding_mask": _b(4)}),
            ("key_padding_mask (4, 3)", {"key_padding_mask": _b(4, 3)}),
            ("1-D attn_mask", {"attn_mask": _b(4)}),
            ("2-D attn_mask (3, 4)", {"attn_mask": _b(3, 4)}),
            ("3-D attn_mask (5, 4, 4)", {"attn_mask": _b(5, 4, 4)}),
        ]
    ]
    with torch.no_grad():
        _check_invalid(theirs, ours, _invalid_cases(True), monkeypatch, need_weights=False)
        _check_invalid(theirs, ours, self_attention, monkeypatch, need_weights=False)
        for _, make, _ in self_attention:  # torch really took its fused path: RuntimeError
            xs, kw = make()
            assert type(_raised(lambda xs=xs, kw=kw: theirs(*xs, **kw))) is RuntimeError


# ------------------------------------------------------------------------ is_causal in training
def test_train_with_is_causal(monkeypatch):
    """Restates ``TestTransformers.test_train_with_is_causal`` (test/test_transformers.py), the
    drop-in patched into ``torch.nn``.

    A TransformerEncoder (and a TransformerDecoder) trained with ``is_causal=True`` and the causal
    mask gives torch's outputs, gradients and updated parameters; ``is_causal`` without a mask
    raises RuntimeError; the encoder still detects a causal mask; and with the hint (no
    key_padding_mask, no weights) torch's contract replaces attn_mask by the causal mask without
    reading it, so a mask of another size (torch's test passes an (L, L) mask with a sequence
    of 1) is not refused.
    """
    S, L, E, H = 1, 2, 2, 1  # torch's sizes; batch_first: (S, L, E) is (batch, seq, embed)

    def encoder() -> nn.TransformerEncoder:
        torch.manual_seed(0)
        layer = nn.TransformerEncoderLayer(
            d_model=E, dim_feedforward=4, nhead=H, batch_first=True, activation="gelu", dropout=0
        )
        return nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)

    def decoder() -> nn.TransformerDecoder:
        torch.manual_seed(0)
        layer = nn.TransformerDecoderLayer(
            d_model=4, nhead=2, dim_feedforward=8, batch_first=True, dropout=0
        )
        return nn.TransformerDecoder(layer, 2)

    def train_step(model: nn.Module, *inputs: Tensor, **kw) -> tuple[Tensor, list[Tensor]]:
        model.train()
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        opt.zero_grad()
        out = model(*inputs, **kw)
        nn.MSELoss()(out, inputs[0]).backward()
        grads = [p.grad.clone() for p in model.parameters()]
        opt.step()
        return out.detach(), grads + [p.detach().clone() for p in model.parameters()]

    torch.manual_seed(1)
    inputs = torch.randn(S, L, E)
    mask = nn.Transformer.generate_square_subsequent_mask(L)
    tgt, memory = torch.randn(3, 5, 4), torch.randn(3, 7, 4)
    tgt_mask = nn.Transformer.generate_square_subsequent_mask(5)
    want = train_step(encoder(), inputs, mask=mask, is_causal=True)
    want_dec = train_step(decoder(), tgt, memory, tgt_mask=tgt_mask, tgt_is_causal=True)

    _patch_torch(monkeypatch)
    enc = encoder()
    assert isinstance(enc.layers[0].self_attn, MultiheadAttention)
    got = train_step(enc, inputs, mask=mask, is_causal=True)
    dec = decoder()
    assert isinstance(dec.layers[0].self_attn, MultiheadAttention)
    got_dec = train_step(dec, tgt, memory, tgt_mask=tgt_mask, tgt_is_causal=True)
    for a, b in ((got, want), (got_dec, want_dec)):
        torch.testing.assert_close(a[0], b[0], atol=1e-6, rtol=1e-5)
        assert all(torch.isfinite(g).all() for g in a[1])
        for x, y in zip(a[1], b[1], strict=True):
            torch.testing.assert_close(x, y, atol=1e-6, rtol=1e-5)

    # inference with is_causal (seq len 1: the (1, 1) causal mask)
    t_qkv = torch.randn(S, L, E)
    theirs, ours = _pair(E, H)
    one = nn.Transformer.generate_square_subsequent_mask(S)
    torch.testing.assert_close(
        ours(t_qkv, t_qkv, t_qkv, attn_mask=one, is_causal=True)[0],
        theirs(t_qkv, t_qkv, t_qkv, attn_mask=one, is_causal=True)[0],
    )
    with pytest.raises(RuntimeError, match="Need attn_mask if specifying the is_causal hint"):
        ours(t_qkv, t_qkv, t_qkv, is_causal=True)

    # the encoder detects a causal bool mask and passes is_causal=True to the next layer
    causal_mask = torch.ones(L, L, dtype=torch.bool).triu(1)
    mock_layer = MagicMock(nn.MultiheadAttention(E, H), return_value=inputs)
    enc.layers[1] = mock_layer
    enc(inputs, mask=causal_mask)
    mock_layer.assert_called_with(ANY, src_mask=ANY, is_causal=True, src_key_padding_mask=ANY)

    # torch's is_causal_kernels: all-ones weights and inputs give 16 exactly, with an (L, L) mask
    # whose size is not the (1, 1) of the call: the hint replaces it unread
    L1, E1 = 2, 4
    qkv = torch.ones(S, L1, E1)
    for mha in _pair(E1, H):
        mha.in_proj_weight = nn.Parameter(torch.ones(E1 * 3, E1))
        mha.out_proj.weight = nn.Parameter(torch.ones(E1, E1))
        mask = nn.Transformer.generate_square_subsequent_mask(L1)
        out, _ = mha(qkv, qkv, qkv, attn_mask=mask, need_weights=False, is_causal=True)
        assert torch.equal(out, torch.full((S, L1, E1), 16.0))
        # with weights asked for, the mask is read: torch and the drop-in refuse its size
        with pytest.raises(RuntimeError, match=r"The shape of the 2D attn_mask is"):
            mha(qkv, qkv, qkv, attn_mask=mask, need_weights=True, is_causal=True)


# ------------------------------------------------------------------------ torch's fused path
def test_multihead_self_attn_two_masks_never_take_torchs_fast_path(monkeypatch):
    """Restates ``test_multihead_self_attn_two_masks_fast_path_mock`` (test_multihead_attention.py)
    as its documented difference.

    torch's test mocks ``torch._native_multi_head_attention`` and asserts that self-attention with
    both masks in eval mode calls it. The drop-in never calls torch's fused kernel (it runs
    `attnlab.attention`), so that test cannot pass; instead: under the same conditions torch's
    module calls the mocked kernel, the drop-in does not, and the drop-in's output equals torch's
    real fused path on every row that may attend a key (torch's fused path gives NaN on the
    others, the drop-in zeros, i.e. ``out_proj.bias``).
    """
    E, H, N, L = 16, 8, 8, 5
    theirs, ours = _pair(E, H, batch_first=True)
    theirs.eval(), ours.eval()
    g = torch.Generator().manual_seed(0)
    x = torch.rand(N, L, E, generator=g)
    attn_mask = torch.randint(0, 2, (L, L), generator=g).bool()  # True = not allowed
    kpm = torch.randint(0, 2, (N, L), generator=g).bool()
    empty = (attn_mask[None] | kpm[:, None]).all(-1)  # (N, L) rows with no key
    assert empty.any() and not empty.all()
    with torch.no_grad():
        want, _ = theirs(x, x, x, attn_mask=attn_mask, key_padding_mask=kpm)  # torch's fused path
        fused = MagicMock(side_effect=AssertionError("torch's fused path"))
        monkeypatch.setattr(torch, "_native_multi_head_attention", fused)
        got, weights = ours(x, x, x, attn_mask=attn_mask, key_padding_mask=kpm)
        assert not fused.called
        with pytest.raises(AssertionError, match="torch's fused path"):
            theirs(x, x, x, attn_mask=attn_mask, key_padding_mask=kpm)
        assert fused.called  # the conditions were those of torch's fused path
    torch.testing.assert_close(got[~empty], want[~empty], atol=1e-6, rtol=1e-5)
    assert want[empty].isnan().all()
    assert torch.equal(got[empty], ours.out_proj.bias.expand(int(empty.sum()), E))
    assert torch.equal(weights[empty], torch.zeros_like(weights[empty]))


def test_encoder_layers_in_inference_run_with_the_drop_in(monkeypatch):
    """torch's TransformerEncoder in eval mode without grad (its fused inference path) with the
    drop-in patched into ``torch.nn``: it used to crash (no ``merge_masks``). It now runs with
    torch's results and one warning; with torch's fast path off, every layer calls the drop-in's
    ``forward`` and matches torch's module."""
    from attnlab.modules import torch_compat

    def stack() -> nn.TransformerEncoder:
        torch.manual_seed(0)
        layer = nn.TransformerEncoderLayer(16, 4, 32, dropout=0.0, batch_first=True)
        return nn.TransformerEncoder(layer, 2).eval()

    theirs = stack()
    _patch_torch(monkeypatch)
    ours = stack()
    ours.load_state_dict(theirs.state_dict())
    assert all(isinstance(m.self_attn, MultiheadAttention) for m in ours.layers)
    x = torch.randn(2, 5, 16)
    pad = torch.tensor([[False] * 5, [False] * 3 + [True] * 2])
    causal = nn.Transformer.generate_square_subsequent_mask(5)
    cases = [{}, {"src_key_padding_mask": pad}, {"mask": causal, "is_causal": True}]
    monkeypatch.setattr(torch_compat, "_warned_fused", False)
    with torch.no_grad(), pytest.warns(UserWarning, match="set_fastpath_enabled") as record:
        for kw in cases:
            torch.testing.assert_close(ours(x, **kw), theirs(x, **kw))
    assert sum("fast path" in str(w.message) for w in record) == 1
    calls = MagicMock(wraps=torch_compat.attention)
    monkeypatch.setattr(torch_compat, "attention", calls)
    monkeypatch.setattr(torch.backends.mha, "get_fastpath_enabled", lambda: False)
    with torch.no_grad():
        for kw in cases:
            torch.testing.assert_close(ours(x, **kw), theirs(x, **kw), atol=1e-6, rtol=1e-5)
    assert calls.call_count == 2 * len(cases)  # every layer ran attnlab's attention


# ------------------------------------------------------------------------ SDPA's layouts
LAYOUTS = {  # q shape, k/v leading shape (without S and the head dims)
    "(2, 3, 1, L, E)": ((2, 3, 1), (2, 3, 1)),
    "(2, 1, 3, 2, L, E)": ((2, 1, 3, 2), (2, 1, 3, 2)),
    "GQA (2, 3, 4, L, E)": ((2, 3, 4), (2, 3, 2)),
    "(L, E)": ((), ()),
}


def _sdpa_inputs(layout: str, L: int = 16, S: int = 10, seed: int = 0) -> tuple[Tensor, ...]:
    lead_q, lead_kv = LAYOUTS[layout]
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(*lead_q, L, 16, generator=g)
    k = torch.randn(*lead_kv, S, 16, generator=g)
    v = torch.randn(*lead_kv, S, 32, generator=g)  # Ev = 32 != E = 16
    return q, k, v


def _sdpa(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None) -> Tensor:
    gqa = q.dim() > 2 and q.shape[-3] != k.shape[-3]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)


@pytest.mark.parametrize("backend", ["auto", "sdpa", "reference", "flash"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_sdpa_output_shape_uses_value_head_dim(layout, backend):
    """Restates ``test_sdpa_output_shape_uses_value_head_dim`` (test/test_transformers.py).

    SDPA takes q/k ``(..., L|S, E)`` and v ``(..., S, Ev)`` with any number of leading batch
    dims (and none: ``(L, E)``) and returns ``(..., L, Ev)``. `attnlab.attention` does the same
    on every backend, with torch's values and gradients.
    """
    q, k, v = (t.requires_grad_() for t in _sdpa_inputs(layout))
    out = attnlab.attention(q, k, v, backend=backend)
    assert out.shape == (*q.shape[:-1], v.shape[-1])
    want = _sdpa(q, k, v)
    torch.testing.assert_close(out, want, atol=2e-6, rtol=1e-5)
    if backend == "flash" and layout.startswith("(L"):
        return  # flash on one 16-row block is the reference path: already covered
    dout = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), dout)
    ref = torch.autograd.grad(want, (q, k, v), dout)
    for a, b in zip(got, ref, strict=True):
        assert a.shape == b.shape
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


# every broadcast of a mask to (2, 3, 1, L, S) that SDPA accepts
MASK_SHAPES = [(10,), (16, 10), (1, 16, 1), (3, 1, 16, 10), (2, 1, 1, 16, 10), (1, 3, 1, 1, 10)]


@pytest.mark.parametrize("kind", ["bool", "float"])
def test_sdpa_leading_dims_masks_broadcast_as_in_torch(kind):
    """Masks with leading batch dims broadcast by torch's rules (restates the mask cases of
    test_transformers.py's broadcasting tests for the 5-D layout); weights and lse come back in
    the caller's layout; a mask that does not broadcast is refused naming both shapes."""
    q, k, v = _sdpa_inputs("(2, 3, 1, L, E)")
    g = torch.Generator().manual_seed(3)
    for shape in MASK_SHAPES:
        if kind == "bool":
            mask = torch.rand(*shape, generator=g) > 0.3
            mask[..., 0] = True  # no empty rows: torch's math path agrees with zeros there
        else:
            mask = torch.randn(*shape, generator=g)
        out, weights, lse = attnlab.attention(
            q, k, v, mask=mask, return_weights=True, return_lse=True
        )
        torch.testing.assert_close(out, _sdpa(q, k, v, mask), atol=2e-6, rtol=1e-5)
        logits = q @ k.transpose(-1, -2) / 4.0  # scale 1/sqrt(16)
        logits = logits.masked_fill(~mask, -torch.inf) if kind == "bool" else logits + mask
        torch.testing.assert_close(weights, logits.softmax(-1), atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(lse, logits.logsumexp(-1), atol=1e-5, rtol=1e-5)
    stats = attnlab.functional.attention_stats(q, k, v, mask=mask)
    assert stats.entropy.shape == q.shape[:-1]
    rows = attnlab.functional.attention_weights(q, k, lse, rows=[0, 5], mask=mask)
    torch.testing.assert_close(rows, weights[..., [0, 5], :], atol=1e-6, rtol=1e-5)
    with pytest.raises(ValueError, match=r"mask of shape \(3, 3, 1, 16, 10\) is not broadcast"):
        attnlab.attention(q, k, v, mask=torch.ones(3, 3, 1, 16, 10, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"share the batch dims \(2, 3\).*key \(2, 4, 1, 10, 16\)"):
        attnlab.attention(q, torch.randn(2, 4, 1, 10, 16), v)
    with pytest.raises(ValueError, match=r"query must have rank 3 .* got rank 1 with shape \(8,\)"):
        attnlab.attention(*(torch.randn(8),) * 3)


def test_leading_dims_are_views_of_the_inputs():
    """The 4-D inputs `attention` runs on are views of the caller's tensors (no copies) whenever
    the leading dims can be merged; the output is a view of the 4-D result."""
    q, k, v = _sdpa_inputs("(2, 1, 3, 2, L, E)")
    lead = leading_to_4d(q, k, v)
    assert lead is not None and lead.batch_shape == (2, 1, 3, 2)
    for a, b in ((lead.q, q), (lead.k, k), (lead.v, v)):
        assert a.data_ptr() == b.data_ptr() and a.shape == (6, *b.shape[-3:])
    q2, k2, v2 = _sdpa_inputs("(L, E)")
    lead2 = leading_to_4d(q2, k2, v2)
    assert lead2 is not None and lead2.batch_shape == () and lead2.q.data_ptr() == q2.data_ptr()
    assert leading_to_4d(q[0, 0], k[0, 0], v[0, 0]) is None  # 4-D: untouched
    out = attnlab.attention(q, k, v, backend="reference")
    assert out._base is not None


def test_leading_dims_compile_fullgraph():
    """`attention` with leading batch dims, a mask broadcast over some of them, and 2-D inputs,
    compiles with Inductor in one graph and equals eager."""
    q, k, v = _sdpa_inputs("GQA (2, 3, 4, L, E)")
    mask = torch.rand(2, 1, 1, 16, 10, generator=torch.Generator().manual_seed(4)) > 0.3
    mask[..., 0] = True
    q2, k2, v2 = _sdpa_inputs("(L, E)", seed=5)

    def fn(q, k, v, mask, q2, k2, v2):
        return attnlab.attention(q, k, v, mask=mask), attnlab.attention(q2, k2, v2)

    got = torch.compile(fn, fullgraph=True)(q, k, v, mask, q2, k2, v2)
    want = fn(q, k, v, mask, q2, k2, v2)
    for a, b in zip(got, want, strict=True):
        assert a.shape == b.shape
        torch.testing.assert_close(a, b, atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(want[0], _sdpa(q, k, v, mask), atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("backend", ["auto", "sdpa", "reference", "flash"])
def test_leading_dims_on_meta_tensors(backend):
    """`meta` inputs of SDPA's layouts give the right shapes (no host sync)."""
    for layout in LAYOUTS:
        q, k, v = (t.to("meta") for t in _sdpa_inputs(layout))
        mask = torch.ones(16, 10, dtype=torch.bool, device="meta")
        out = attnlab.attention(q, k, v, mask=mask, backend=backend)
        assert out.device.type == "meta" and out.shape == (*q.shape[:-1], 32)
    out, w, lse = attnlab.attention(q, k, v, return_weights=True, return_lse=True)
    assert (out.shape, w.shape, lse.shape) == ((16, 32), (16, 10), (16,))


# ------------------------------------------------------------------------ the NaN rule
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_non_masked_rows_nan_props(dtype):
    """Restates ``TestSDPA.test_non_masked_rows_nan_props`` (test/test_transformers.py) with its
    documented difference.

    One +inf in q (batch 0, head 1, row 2): the output is NaN — exactly in that row, as torch's;
    every other row equals torch's. torch's test also asserts NaN in q's gradient: torch's
    gradients are NaN in that q row and in all of that head's k and v. attnlab's NaN rule gives
    instead the gradients of the computation with the non-finite input read as 0 (finite), so the
    NaN row never poisons a training step's other parameters.
    """
    g = torch.Generator().manual_seed(0)
    q0, k0, v0 = (torch.randn(1, 2, 4, 16, generator=g).to(dtype) for _ in range(3))
    q0[0, 1, 2, 3] = float("inf")
    q, k, v = (t.clone().requires_grad_() for t in (q0, k0, v0))
    out = attnlab.attention(q, k, v)
    out.sum().backward()
    tq, tk, tv = (t.clone().requires_grad_() for t in (q0, k0, v0))
    want = F.scaled_dot_product_attention(tq, tk, tv)
    want.sum().backward()
    nan_rows = out.isnan().any(-1)
    assert nan_rows.nonzero().tolist() == [[0, 1, 2]] == want.isnan().any(-1).nonzero().tolist()
    assert out[0, 1, 2].isnan().all()
    tol = {"atol": 2e-3, "rtol": 2e-3} if dtype == torch.float16 else {}
    torch.testing.assert_close(out[~nan_rows], want[~nan_rows], **tol)
    # the documented difference: torch's gradients are NaN; attnlab's are those of the
    # computation on q with the +inf read as 0 (a constant 0: its own gradient entry is 0)
    assert tq.grad[0, 1, 2].isnan().any() and tk.grad[0, 1].isnan().all()
    clean = [t.clone().requires_grad_() for t in (q0.nan_to_num(0, 0, 0), k0, v0)]
    F.scaled_dot_product_attention(*clean).sum().backward()
    clean[0].grad[~torch.isfinite(q0)] = 0
    for got, ref in zip((q, k, v), clean, strict=True):
        assert torch.isfinite(got.grad).all()
        torch.testing.assert_close(got.grad, ref.grad, **tol)


def test_fully_masked_rows_are_zero_and_never_reach_other_rows():
    """Restates the masked counterpart, ``TestSDPA.test_fully_masked_out_rows``
    (test/test_transformers.py): every 4th row fully masked, the others attending a fixed
    pattern, with NaN in the queries of the masked rows. Masked rows output exactly 0 with zero
    q gradients; no NaN anywhere else, forward or backward; other rows equal torch's."""
    L, D = 32, 16
    g = torch.Generator().manual_seed(0)
    q0, k0, v0 = (torch.rand(1, 1, L, D, generator=g) for _ in range(3))
    idx = torch.arange(L)
    mask = (idx[:, None] % 5 == idx % 5).expand(1, 1, L, L).clone()
    mask[..., ::4, :] = False  # fully masked rows
    q0[..., ::4, :] = float("nan")  # a masked row's q never matters
    q, k, v = (t.clone().requires_grad_() for t in (q0, k0, v0))
    out = attnlab.attention(q, k, v, mask=mask)
    out.sum().backward()
    empty = ~mask.any(-1)  # (1, 1, L)
    assert torch.equal(out[empty], torch.zeros_like(out[empty]))
    assert torch.equal(q.grad[empty], torch.zeros_like(q.grad[empty]))
    for t in (out, q.grad, k.grad, v.grad):
        assert torch.isfinite(t).all()
    want = F.scaled_dot_product_attention(q0.nan_to_num(), k0, v0, attn_mask=mask)
    torch.testing.assert_close(out[~empty], want[~empty])
