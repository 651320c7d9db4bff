"""The encoder–decoder Transformer: decoding with caches equals decoding without, beam search,
cross-attention keys/values computed once per source, padding invariance, the config."""

from __future__ import annotations

import pytest
import torch

from attnlab.masks import PaddingMask
from attnlab.models import seq2seq
from attnlab.models.seq2seq import (
    Seq2SeqConfig,
    Seq2SeqTransformer,
    build_seq2seq_transformer,
)

BOS, EOS, V = 1, 2, 13


def _model(positional: str = "sinusoidal", tie: bool = True, seed: int = 0) -> Seq2SeqTransformer:
    torch.manual_seed(seed)
    cfg = Seq2SeqConfig(
        src_vocab_size=V,
        tgt_vocab_size=V if tie else V + 4,
        d_model=32,
        n_heads=4,
        enc_layers=2,
        dec_layers=2,
        positional=positional,
        tie_embeddings=tie,
    )
    model = Seq2SeqTransformer(cfg).eval()
    with torch.no_grad():  # sharper logits than the init: varied tokens, few near-ties
        for p in model.parameters():
            if p.dim() >= 2:
                p.mul_(3.0)
    return model


def _batch(B: int = 5, S: int = 9, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    src = torch.randint(3, V, (B, S), generator=g)
    lengths = torch.randint(2, S + 1, (B,), generator=g)
    lengths[0] = S
    mask = torch.arange(S)[None, :] < lengths[:, None]
    return src.masked_fill(~mask, 0), mask


@pytest.mark.parametrize(("positional", "tie"), [("sinusoidal", True), ("rope", False)])
def test_greedy_with_caches_equals_greedy_without(positional: str, tie: bool) -> None:
    model = _model(positional, tie)
    src, mask = _batch()
    a = model.greedy(src, mask, max_len=12, bos=BOS, eos=EOS, use_cache=True)
    b = model.greedy(src, mask, max_len=12, bos=BOS, eos=EOS, use_cache=False)
    assert a.shape[0] == 5 and a.shape[1] <= 12
    assert torch.equal(a, b)
    assert len(set(map(tuple, a.tolist()))) > 1  # not a degenerate constant output
    # after a row's EOS every position holds EOS
    for row in a.tolist():
        if EOS in row:
            assert all(t == EOS for t in row[row.index(EOS) :])


def test_greedy_matches_teacher_forced_argmax() -> None:
    model = _model("rope")
    src, mask = _batch()
    out = model.greedy(src, mask, max_len=8, bos=BOS, eos=EOS)
    tgt_in = torch.cat([torch.full((5, 1), BOS), out[:, :-1]], 1)
    logits = model(src, mask, tgt_in)
    first_eos = [(r.index(EOS) if EOS in r else len(r)) for r in out.tolist()]
    for b, end in enumerate(first_eos):
        assert torch.equal(logits[b, : end + 1].argmax(-1)[: out.shape[1]], out[b, : end + 1])


@pytest.mark.parametrize("positional", ["sinusoidal", "rope"])
def test_beam_with_caches_equals_beam_without(positional: str) -> None:
    model = _model(positional)
    src, mask = _batch()
    ta, sa = model.beam_search(src, mask, beam=4, max_len=10, bos=BOS, eos=EOS, use_cache=True)
    tb, sb = model.beam_search(src, mask, beam=4, max_len=10, bos=BOS, eos=EOS, use_cache=False)
    assert torch.equal(ta, tb)
    torch.testing.assert_close(sa, sb, rtol=1e-5, atol=1e-5)
    # the score is the summed log-probability of the returned hypothesis
    tgt_in = torch.cat([torch.full((5, 1), BOS), ta[:, :-1]], 1)
    logp = model(src, mask, tgt_in).log_softmax(-1).gather(-1, ta[..., None])[..., 0]
    for b, row in enumerate(ta.tolist()):
        end = row.index(EOS) + 1 if EOS in row else len(row)
        torch.testing.assert_close(logp[b, :end].sum(), sa[b], rtol=1e-4, atol=1e-4)


def test_beam_finds_a_score_at_least_greedys() -> None:
    model = _model()
    src, mask = _batch()
    _, s1 = model.beam_search(src, mask, beam=1, max_len=10, bos=BOS, eos=EOS)
    _, s5 = model.beam_search(src, mask, beam=5, max_len=10, bos=BOS, eos=EOS)
    assert bool((s5 >= s1 - 1e-5).all())
    assert bool((s5 > s1 + 1e-3).any())  # the wider beam finds better hypotheses somewhere


def test_beam_one_equals_greedy() -> None:
    model = _model("rope")
    src, mask = _batch()
    greedy = model.greedy(src, mask, max_len=10, bos=BOS, eos=EOS)
    beam, _ = model.beam_search(src, mask, beam=1, max_len=10, bos=BOS, eos=EOS)
    assert torch.equal(greedy, beam)


def test_cross_attention_keys_values_are_computed_once_per_source() -> None:
    model = _model()
    src, mask = _batch()
    calls = []
    for block in model.decoder:
        block.cross_attn.kv_proj.register_forward_hook(lambda m, i, o: calls.append(i[0].shape))
    out = model.greedy(src, mask, max_len=10, bos=BOS, eos=EOS)
    assert out.shape[1] > 3  # several decoding steps ran
    assert len(calls) == len(model.decoder)  # once per layer, not once per step
    calls.clear()
    model.beam_search(src, mask, beam=3, max_len=10, bos=BOS, eos=EOS)
    assert len(calls) == len(model.decoder)
    assert calls[0][0] == src.shape[0]  # projected for the sources, before the beams expand


@pytest.mark.parametrize("positional", ["sinusoidal", "rope"])
def test_extra_source_padding_changes_nothing(positional: str) -> None:
    model = _model(positional)
    src, mask = _batch()
    padded = torch.cat([src, torch.zeros(5, 4, dtype=torch.long)], 1)
    pmask = torch.cat([mask, torch.zeros(5, 4, dtype=torch.bool)], 1)
    tgt_in = torch.randint(3, V, (5, 6))
    torch.testing.assert_close(model(src, mask, tgt_in), model(padded, pmask, tgt_in))
    a = model.greedy(src, mask, max_len=10, bos=BOS, eos=EOS)
    b = model.greedy(padded, pmask, max_len=10, bos=BOS, eos=EOS)
    assert torch.equal(a, b)
    # and the padded tokens' ids do not matter either
    garbage = padded.masked_fill(~pmask, 7)
    torch.testing.assert_close(model(garbage, pmask, tgt_in), model(src, mask, tgt_in))


def test_alignment_is_a_distribution_over_real_source_tokens() -> None:
    model = _model()
    src, mask = _batch()
    tgt_in = torch.randint(3, V, (5, 6))
    w = model.alignment(src, mask, tgt_in)
    assert w.shape == (5, 6, src.shape[1])
    torch.testing.assert_close(w.sum(-1), torch.ones(5, 6))
    assert bool((w[~mask[:, None, :].expand_as(w)] == 0).all())
    last = model.alignment(src, mask, tgt_in, layer=-1)
    assert last.shape == w.shape and not torch.allclose(last, w)


def test_tied_embeddings_share_one_matrix() -> None:
    tied, untied = _model(tie=True), _model(tie=False)
    assert tied.src_embed is tied.tgt_embed and tied.out is None
    assert untied.src_embed is not untied.tgt_embed and untied.out is not None
    n_tied = sum(p.numel() for p in tied.parameters())
    n_untied = sum(p.numel() for p in untied.parameters())
    assert n_untied - n_tied == (V + 4) * 32 * 2


def test_config_round_trip_and_errors() -> None:
    model = _model("rope", tie=False)
    again = build_seq2seq_transformer(model.config.to_dict())
    again.load_state_dict(model.state_dict())
    src, mask = _batch()
    tgt_in = torch.randint(3, V, (5, 4))
    torch.testing.assert_close(again.eval()(src, mask, tgt_in), model(src, mask, tgt_in))
    with pytest.raises(ValueError, match="tie_embeddings"):
        Seq2SeqConfig(src_vocab_size=10, tgt_vocab_size=11, tie_embeddings=True)
    with pytest.raises(ValueError, match="positional"):
        Seq2SeqConfig(positional="alibi")
    with pytest.raises(ValueError, match="unknown fields"):
        Seq2SeqConfig.from_dict({"d_model": 32, "bogus": 1})
    with pytest.raises(TypeError, match="enc_layers"):
        Seq2SeqConfig(enc_layers=1.5)  # type: ignore[arg-type]


def test_bad_inputs_are_refused() -> None:
    model = _model()
    src, mask = _batch()
    with pytest.raises(TypeError, match="src_mask"):
        model(src, mask.long(), src)
    with pytest.raises(ValueError, match="src_mask"):
        model(src, mask[:, :3], src)
    with pytest.raises(ValueError, match="tgt_in"):
        model(src, mask, src[:2])
    with pytest.raises(ValueError, match="beam"):
        model.beam_search(src, mask, beam=0, max_len=3, bos=BOS, eos=EOS)


def test_decode_backend_gives_the_same_tokens_and_is_restored() -> None:
    model = _model("rope")
    src, mask = _batch()
    auto = model.greedy(src, mask, max_len=10, bos=BOS, eos=EOS)
    model.config.decode_backend = "reference"
    ref = model.greedy(src, mask, max_len=10, bos=BOS, eos=EOS)
    assert torch.equal(auto, ref)
    assert {m.backend for m in model.modules() if hasattr(m, "backend")} == {"auto"}


def test_source_mask_is_a_padding_mask_only_for_right_padding() -> None:
    _, mask = _batch()
    m = seq2seq.source_mask(mask)
    assert isinstance(m, PaddingMask)
    assert torch.equal(m.lengths, mask.sum(-1))
    left = mask.flip(-1)  # padding first: not a prefix, stays the dense (B, 1, 1, S) tensor
    d = seq2seq.source_mask(left)
    assert isinstance(d, torch.Tensor) and torch.equal(d, left[:, None, None, :])


@pytest.mark.parametrize("positional", ["sinusoidal", "rope"])
def test_decoding_with_the_padding_mask_equals_the_dense_mask(positional, monkeypatch) -> None:
    model = _model(positional)
    src, mask = _batch()
    assert not bool(mask.all())  # some rows are padded
    greedy = model.greedy(src, mask, max_len=10, bos=BOS, eos=EOS)
    beam, scores = model.beam_search(src, mask, beam=3, max_len=10, bos=BOS, eos=EOS)
    monkeypatch.setattr(seq2seq, "source_mask", lambda m: m[:, None, None, :])
    assert torch.equal(greedy, model.greedy(src, mask, max_len=10, bos=BOS, eos=EOS))
    beam_d, scores_d = model.beam_search(src, mask, beam=3, max_len=10, bos=BOS, eos=EOS)
    assert torch.equal(beam, beam_d)
    torch.testing.assert_close(scores, scores_d, rtol=1e-5, atol=1e-5)
