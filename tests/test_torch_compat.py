"""attnlab.nn.MultiheadAttention is a drop-in for torch.nn.MultiheadAttention (side by side)."""

from __future__ import annotations

import itertools

import pytest
import torch

from attnlab.nn import MultiheadAttention

pytestmark = pytest.mark.filterwarnings("ignore:Support for mismatched key_padding_mask")

E, H = 16, 4


def _pair(seed=0, **kw):
    torch.manual_seed(seed)
    theirs = torch.nn.MultiheadAttention(E, H, **kw).eval()
    ours = MultiheadAttention(E, H, **kw).eval()
    ours.load_state_dict(theirs.state_dict())
    return theirs, ours


def _inputs(batch_first, kd, vd, N=3, L=5, S=7, unbatched=False, g=None):
    g = g or torch.Generator().manual_seed(1)
    if unbatched:
        return (
            torch.randn(L, E, generator=g),
            torch.randn(S, kd, generator=g),
            torch.randn(S, vd, generator=g),
        )
    shape = (lambda n, t, d: (n, t, d)) if batch_first else (lambda n, t, d: (t, n, d))
    return (
        torch.randn(*shape(N, L, E), generator=g),
        torch.randn(*shape(N, S, kd), generator=g),
        torch.randn(*shape(N, S, vd), generator=g),
    )


def _masks(N=3, L=5, S=7, g=None):
    g = g or torch.Generator().manual_seed(2)
    kpm = torch.rand(N, S, generator=g) > 0.6
    kpm[:, 0] = False  # keep every row non-empty: torch gives NaN for empty rows
    am2 = torch.rand(L, S, generator=g) > 0.7
    am2[:, 0] = False
    am3 = torch.rand(N * H, L, S, generator=g) > 0.7
    am3[..., 0] = False
    return {
        "none": {},
        "kpm_bool": {"key_padding_mask": kpm},
        "kpm_float": {"key_padding_mask": torch.zeros(N, S).masked_fill(kpm, -1e9)},
        "am2_bool": {"attn_mask": am2},
        "am2_float": {"attn_mask": torch.randn(L, S, generator=g)},
        "am3_bool": {"attn_mask": am3},
        "am3_float+kpm": {
            "attn_mask": torch.randn(N * H, L, S, generator=g),
            "key_padding_mask": kpm,
        },
        "causal_hint": {"attn_mask": torch.ones(L, S, dtype=torch.bool).triu(1), "is_causal": True},
    }


CONFIGS = list(
    itertools.product(
        [False, True],  # batch_first
        [True, False],  # bias
        [False, True],  # add_bias_kv
        [False, True],  # add_zero_attn
        [None, 12],  # kdim/vdim
    )
)


@pytest.mark.parametrize("batch_first,bias,add_bias_kv,add_zero_attn,kdim", CONFIGS)
def test_outputs_equal_torch_for_every_combination(
    batch_first, bias, add_bias_kv, add_zero_attn, kdim
):
    kw = dict(
        batch_first=batch_first,
        bias=bias,
        add_bias_kv=add_bias_kv,
        add_zero_attn=add_zero_attn,
        kdim=kdim,
        vdim=kdim,
    )
    theirs, ours = _pair(**kw)
    assert list(theirs.state_dict()) == list(ours.state_dict())
    q, k, v = _inputs(batch_first, kdim or E, kdim or E)
    for name, mkw in _masks().items():
        for need_weights, average in ((True, True), (True, False), (False, True)):
            a, aw = theirs(q, k, v, need_weights=need_weights, average_attn_weights=average, **mkw)
            b, bw = ours(q, k, v, need_weights=need_weights, average_attn_weights=average, **mkw)
            torch.testing.assert_close(
                b, a, atol=2e-6, rtol=1e-5, msg=lambda m, n=name: f"{n}: {m}"
            )
            if need_weights:
                torch.testing.assert_close(
                    bw, aw, atol=1e-6, rtol=1e-5, msg=lambda m, n=name: f"{n}: {m}"
                )
            else:
                assert bw is None and aw is None


def test_unbatched_inputs():
    theirs, ours = _pair()
    q, k, v = _inputs(False, E, E, unbatched=True)
    kpm = torch.tensor([False, True, False, False, True, False, False])
    for kw in ({}, {"key_padding_mask": kpm}, {"average_attn_weights": False}):
        a, aw = theirs(q, k, v, **kw)
        b, bw = ours(q, k, v, **kw)
        torch.testing.assert_close(b, a, atol=2e-6, rtol=1e-5)
        torch.testing.assert_close(bw, aw, atol=1e-6, rtol=1e-5)


def test_state_dict_loads_both_ways():
    for kdim in (None, 12):
        torch.manual_seed(3)
        ours = MultiheadAttention(E, H, kdim=kdim, vdim=kdim, add_bias_kv=True)
        theirs = torch.nn.MultiheadAttention(E, H, kdim=kdim, vdim=kdim, add_bias_kv=True)
        theirs.load_state_dict(ours.state_dict())
        q, k, v = _inputs(False, kdim or E, kdim or E)
        torch.testing.assert_close(
            ours.eval()(q, k, v)[0], theirs.eval()(q, k, v)[0], atol=2e-6, rtol=1e-5
        )


def test_training_dropout_zero_matches_and_dropout_is_applied():
    theirs, ours = _pair(dropout=0.0)
    theirs.train(), ours.train()
    q, k, v = _inputs(False, E, E)
    torch.testing.assert_close(ours(q, k, v)[0], theirs(q, k, v)[0], atol=2e-6, rtol=1e-5)
    _, dropped = _pair(dropout=0.5)
    dropped.train()
    torch.manual_seed(0)
    _, w = dropped(q, k, v, average_attn_weights=False)
    assert (w == 0).float().mean() > 0.3  # about half of the weights are dropped
    dropped.eval()
    assert (dropped(q, k, v, average_attn_weights=False)[1] > 0).all()


def test_gradients_match_torch():
    theirs, ours = _pair(seed=4, batch_first=True)
    q, k, v = _inputs(True, E, E)
    kpm = _masks()["kpm_bool"]["key_padding_mask"]
    outs = []
    for mod in (theirs, ours):
        mod.zero_grad()
        xs = [t.clone().requires_grad_() for t in (q, k, v)]
        out, _ = mod(*xs, key_padding_mask=kpm, need_weights=False)
        out.square().sum().backward()
        outs.append([x.grad for x in xs] + [p.grad for p in mod.parameters()])
    for a, b in zip(*outs, strict=True):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("need_weights", [True, False])
def test_c5_fully_padded_item_gives_zeros_not_nan(need_weights):
    _, ours = _pair()
    q, k, v = _inputs(False, E, E)
    kpm = torch.zeros(3, 7, dtype=torch.bool)
    kpm[1] = True  # every key of item 1 is padding
    qs = q.clone().requires_grad_()
    out, w = ours(qs, k, v, key_padding_mask=kpm, need_weights=need_weights)
    bias_only = ours.out_proj.bias  # zero attention output → out_proj(0) = bias
    torch.testing.assert_close(out[:, 1], bias_only.expand(5, E), atol=0, rtol=0)
    if need_weights:
        assert torch.equal(w[1], torch.zeros_like(w[1]))
    out.sum().backward()
    assert torch.isfinite(qs.grad).all()


def test_c4_and_other_errors():
    _, ours = _pair()
    q, k, v = _inputs(False, E, E)
    with pytest.raises(
        ValueError, match=r"key_padding_mask must have shape \(N, S\) = \(3, 7\), got \(3, 5\)"
    ):
        ours(q, k, v, key_padding_mask=torch.zeros(3, 5, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"attn_mask must have shape \(L, S\) = \(5, 7\)"):
        ours(q, k, v, attn_mask=torch.zeros(7, 5, dtype=torch.bool))
    with pytest.raises(RuntimeError, match=r"Need attn_mask if specifying the is_causal hint"):
        ours(q, k, v, is_causal=True)
    with pytest.raises(ValueError, match=r"embed_dim=10 must be divisible by num_heads=4"):
        MultiheadAttention(10, 4)


# ------------------------------------------------------------- is_causal with attn_mask (A7)
@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("need_weights", [True, False])
@pytest.mark.parametrize("mode", ["train_grad", "eval_no_grad"])
@pytest.mark.parametrize("self_attention", [True, False])
def test_a7_is_causal_with_a_non_causal_attn_mask_follows_torch(
    batch_first, need_weights, mode, self_attention
):
    """torch treats is_causal as a hint: which mask wins depends on the path torch takes.

    The attn_mask is deliberately NOT causal, so the two readings give different outputs; the
    assert below that they differ makes the comparison with torch meaningful.
    """
    theirs, ours = _pair(seed=5, batch_first=batch_first)
    if mode == "train_grad":
        theirs.train(), ours.train()  # dropout 0: same values, torch's non-fused path
    g = torch.Generator().manual_seed(6)
    x = torch.randn(*((3, 5, E) if batch_first else (5, 3, E)), generator=g)
    q, k, v = (x, x, x) if self_attention else (x, x.clone(), x.clone())
    am = torch.rand(5, 5, generator=g) > 0.5  # True = not allowed
    am.fill_diagonal_(False)  # no empty row (torch gives NaN there)
    kpm = torch.zeros(3, 5, dtype=torch.bool)
    kpm[1, 4] = True
    ctx = torch.no_grad() if mode == "eval_no_grad" else torch.enable_grad()
    with ctx:
        for extra in ({}, {"key_padding_mask": kpm}, {"attn_mask": am.float() * -1e4}):
            mkw = {"attn_mask": am, **extra}
            a, aw = theirs(q, k, v, need_weights=need_weights, is_causal=True, **mkw)
            b, bw = ours(q, k, v, need_weights=need_weights, is_causal=True, **mkw)
            torch.testing.assert_close(b, a, atol=2e-6, rtol=1e-5)
            if need_weights:
                torch.testing.assert_close(bw, aw, atol=1e-6, rtol=1e-5)
            else:
                assert aw is None and bw is None
        # the two readings of the hint really differ on these inputs
        plain, _ = ours(q, k, v, need_weights=need_weights, attn_mask=am)
        causal, _ = ours(
            q, k, v, need_weights=need_weights, attn_mask=torch.ones(5, 5).bool().triu(1)
        )
        assert not torch.allclose(plain, causal, atol=1e-3)


def test_a7_is_causal_without_attn_mask_follows_torch():
    """torch's fused inference path ignores is_causal even without attn_mask; the other raises."""
    theirs, ours = _pair(seed=5, batch_first=True)
    x = torch.randn(3, 5, E, generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        a, _ = theirs(x, x, x, is_causal=True, need_weights=False)
        b, _ = ours(x, x, x, is_causal=True, need_weights=False)
        torch.testing.assert_close(b, a, atol=2e-6, rtol=1e-5)
        torch.testing.assert_close(b, ours(x, x, x, need_weights=False)[0], atol=0, rtol=0)
    for mod in (theirs, ours):
        with pytest.raises(RuntimeError, match=r"Need attn_mask if specifying the is_causal hint"):
            mod(x, x, x, is_causal=True)  # grad enabled: not the fused path


@pytest.mark.parametrize("bad", ["key", "value"])
@pytest.mark.parametrize("batch_first", [True, False])
def test_key_value_rank_must_match_query_before_any_work(bad, batch_first, monkeypatch):
    _, ours = _pair(batch_first=batch_first)
    q, k, v = _inputs(batch_first, E, E)
    calls = []
    monkeypatch.setattr(torch.nn.functional, "linear", lambda *a, **kw: calls.append(1))
    args = {"key": k, "value": v}
    args[bad] = args[bad][0]  # (S, E) or (L, E): unbatched
    with pytest.raises(
        ValueError,
        match=rf"key and value must have the rank of query \(3-D\), got query "
        rf"\({', '.join(map(str, q.shape))}\), key \(.*\), value \(.*\)",
    ):
        ours(q, args["key"], args["value"])
    with pytest.raises(ValueError, match=r"must have the rank of query \(2-D\)"):
        ours(q[0], k, v[0])  # unbatched query, batched key
    assert calls == []  # raised before the projections
