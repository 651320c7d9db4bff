"""attnlab textbook, the practice rules: machine-dependent ``measured`` text stays out of
docs/textbook.md; the counts behind the length, memory and score-comparison claims are checked
against independent counters (FlopCounterMode, real tensors); the learning-rate claims (slow)."""

from __future__ import annotations

import json

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from attnlab import AdditiveAttention, attention
from attnlab.analysis.advise import advise
from attnlab.analysis.costs import model_cost
from attnlab.textbook import AGREES, Claim, Finding, Row, select_claims
from attnlab.textbook.render import as_json, as_markdown, as_text


def _row(measured: str) -> Row:
    c = Claim(
        id="000-x-a",
        section="s",
        quote="q",
        paraphrase="p",
        api="attnlab.attention",
        expected=AGREES,
        check=lambda: Finding("c", "f()", AGREES, measured=measured),
    )
    return Row(c, c.check(), 0.0)


def test_measured_text_is_printed_and_in_json_but_never_in_the_markdown():
    row = _row("dot 1.23 ms on this machine")
    assert "measured: dot 1.23 ms on this machine" in as_text([row])
    assert json.loads(as_json([row]))[0]["measured"] == "dot 1.23 ms on this machine"
    assert "1.23 ms" not in as_markdown([row])
    assert "measured:" not in as_text([_row("")])


def test_advise_ring_training_memory_splits_only_the_activations():
    """Per device the ring keeps the weights, gradients and optimizer state and 1/devices of
    the activations and logits (it used to subtract the total too and go negative)."""
    kw = dict(d_model=256, n_layers=4, n_heads=4, vocab_size=1000, train=True)
    a = advise(8192, "64GB", gflops=1e3, devices=4, **kw)
    tiled = model_cost(8192, attention="flash", **kw).memory
    split = tiled["activations"] + tiled["logits"]
    want = tiled["total"] - split + split / 4
    assert a.options["ring"]["memory"] == pytest.approx(want, rel=1e-12)
    assert 0 < a.options["ring"]["memory"] < tiled["total"]


def test_score_costs_match_the_flop_counter():
    """The matmul part of each score's FLOPs equals what FlopCounterMode counts in attnlab's
    reference attention and in AdditiveAttention (the additive vᵀ·tanh is elementwise)."""
    from attnlab.textbook.checks.costs import _score_costs

    n, d = 128, 16
    c = _score_costs(n, d)
    q = torch.randn(1, 1, n, d)
    for score in ("dot", "cosine"):
        with FlopCounterMode(display=False) as fc:
            attention(q, q, q, score=score, backend="reference")
        assert fc.get_total_flops() == c[score]["matmul"]
    with FlopCounterMode(display=False) as fc:
        AdditiveAttention(d, d, d, bias=False)(q[0], q[0], q[0])
    assert fc.get_total_flops() == c["additive"]["matmul"]
    assert c["dot"]["total"] < c["cosine"]["total"] < c["additive"]["total"]


def test_eager_saved_bytes_on_meta_match_real_tensors():
    """The meta-device count of what an eager block saves for backward (002-8.4.2-f) agrees with
    the same block on real tensors, deduplicated by storage, within 5 %."""
    from attnlab.models import TransformerBlock, TransformerConfig
    from attnlab.textbook.checks.memory import _eager_saved_per_layer

    L, E, H = 256, 96, 4
    meta, squares = _eager_saved_per_layer(L, E, H, 0.1)
    cfg = TransformerConfig(
        d_model=E, n_heads=H, d_ff=4 * E, positional=None, attn_backend="reference", dropout=0.1
    )
    torch.manual_seed(0)
    block = TransformerBlock(cfg).train()
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        storages[s.data_ptr()] = s.nbytes()
        return t

    x = torch.randn(1, L, E, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        block(x)
    real = sum(storages.values())
    assert meta == pytest.approx(real, rel=0.05)
    assert squares == 4  # scores, probabilities, dropout mask and dropped probabilities


def test_plain_attention_square_count_on_meta_matches_the_cpu():
    """Plain PyTorch attention (as the texts write it) saves as many (1, H, L, L) tensors on real
    CPU tensors as the meta-device count used by 002-8.4.2-f says."""
    from attnlab.textbook.checks.memory import _plain_squares

    L, H, D = 64, 2, 8
    q, k, v = (torch.randn(1, H, L, D, requires_grad=True) for _ in range(3))
    storages: set[int] = set()

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.numel() == H * L * L:
            storages.add(t.untyped_storage().data_ptr())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        s = torch.matmul(q, k.transpose(-2, -1)) / D**0.5
        p = torch.nn.functional.dropout(torch.softmax(s, dim=-1), 0.1, training=True)
        torch.matmul(p, v)
    assert _plain_squares(L, H, D) == len(storages) == 3


def test_length_claims_name_the_hardware_they_assume():
    for c in select_claims(["001-6.1-a", "002-8.6-i", "002-8.7-h"]):
        assert "GFLOP/s" in c.assumptions or "TFLOP/s" in c.assumptions
        assert "GB" in c.assumptions


@pytest.mark.slow
@pytest.mark.parametrize("cid", ["002-8.9-o", "002-8.7-i", "002-8.9-q"])
def test_training_claims_get_their_declared_verdicts(cid):
    (c,) = select_claims([cid], include_slow=True)
    assert c.slow
    f = c.check()
    assert f.verdict == c.expected, (f.computed, f.explanation)
