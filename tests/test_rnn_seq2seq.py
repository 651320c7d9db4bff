"""`RNNSeq2Seq`: Bahdanau's RNN encoder–decoder with `AdditiveAttention` (issue 17 item 2)."""

from __future__ import annotations

import random

import pytest
import torch
from torch import nn

from attnlab.models import RNNSeq2Seq, RNNSeq2SeqConfig, build_rnn_seq2seq

num2words = pytest.importorskip("num2words").num2words

PAD, BOS, EOS = 0, 1, 2


@pytest.fixture(autouse=True)
def _one_thread():
    """Small recurrent steps: one thread is ~10× faster than two when other processes load the
    cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _small(src_vocab: int = 30, tgt_vocab: int = 31, **kw) -> RNNSeq2Seq:
    torch.manual_seed(0)
    sizes = dict(d_embed=16, d_encoder=24, d_decoder=32, d_attention=20, d_output=28)
    return RNNSeq2Seq(RNNSeq2SeqConfig(src_vocab, tgt_vocab, **{**sizes, **kw}))


class Numbers:
    """English number words -> German number words (num2words), characters on both sides."""

    def __init__(self) -> None:
        self.pairs = {n: (num2words(n, lang="en"), num2words(n, lang="de")) for n in range(1000)}
        src_chars = sorted({c for a, _ in self.pairs.values() for c in a})
        tgt_chars = sorted({c for _, b in self.pairs.values() for c in b})
        self.src_index = {c: i + 1 for i, c in enumerate(src_chars)}  # 0 = padding
        self.tgt_vocab = ["<pad>", "<bos>", "<eos>", *tgt_chars]
        self.tgt_index = {c: i for i, c in enumerate(self.tgt_vocab)}

    def batch(self, numbers: list[int]) -> tuple[torch.Tensor, ...]:
        """``(src, src_mask, tgt_in, tgt_out)``, right-padded with 0."""
        srcs = [[self.src_index[c] for c in self.pairs[n][0]] for n in numbers]
        tgts = [[self.tgt_index[c] for c in self.pairs[n][1]] for n in numbers]
        S, T = max(map(len, srcs)), max(map(len, tgts)) + 1
        src = torch.zeros(len(numbers), S, dtype=torch.long)
        tgt_in = torch.zeros(len(numbers), T, dtype=torch.long)
        tgt_out = torch.zeros(len(numbers), T, dtype=torch.long)
        for r, (s, t) in enumerate(zip(srcs, tgts, strict=True)):
            src[r, : len(s)] = torch.tensor(s)
            tgt_in[r, : len(t) + 1] = torch.tensor([BOS, *t])
            tgt_out[r, : len(t) + 1] = torch.tensor([*t, EOS])
        return src, src != PAD, tgt_in, tgt_out

    def decode(self, ids: list[int]) -> str:
        ids = ids[: ids.index(EOS)] if EOS in ids else ids
        return "".join(self.tgt_vocab[i] for i in ids)


def _exact_match(model: RNNSeq2Seq, data: Numbers, numbers: list[int]) -> float:
    src, mask, _, tgt_out = data.batch(numbers)
    out = model.greedy(src, mask, max_len=tgt_out.shape[1] + 4, bos=BOS, eos=EOS)
    hits = [
        data.decode(row) == data.pairs[n][1] for row, n in zip(out.tolist(), numbers, strict=True)
    ]
    return sum(hits) / len(numbers)


def test_learns_english_to_german_numbers_in_seconds():
    data = Numbers()
    numbers = list(range(1000))
    random.Random(0).shuffle(numbers)
    held_out, train = numbers[:200], numbers[200:]
    torch.manual_seed(0)
    cfg = RNNSeq2SeqConfig(
        len(data.src_index) + 1, len(data.tgt_vocab), d_embed=32, d_encoder=64, d_decoder=64,
        d_attention=64, d_output=64,
    )  # fmt: skip
    model = RNNSeq2Seq(cfg)
    before = _exact_match(model, data, held_out)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    g = random.Random(1)
    losses = []
    for _ in range(45):
        src, mask, tgt_in, tgt_out = data.batch(g.sample(train, 32))
        logits = model(src, mask, tgt_in)
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), tgt_out.flatten(), ignore_index=0)
        opt.zero_grad()
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
    after = _exact_match(model, data, held_out)
    # the reordering ("twenty-three" -> "dreiundzwanzig") on numbers never seen in training;
    # the trivial baseline (one output for every input) gets at most 1 of the 200 right
    assert before == 0.0
    assert after >= 0.5, f"held-out exact match {after:.2f}"
    assert sum(losses[-5:]) / 5 < 0.1 * losses[0]


def test_config_round_trip_and_build():
    cfg = RNNSeq2SeqConfig(src_vocab_size=11, tgt_vocab_size=13, d_encoder=8, dropout=0.1)
    assert RNNSeq2SeqConfig.from_dict(cfg.to_dict()) == cfg
    model = build_rnn_seq2seq(cfg.to_dict())
    assert model.config == cfg
    assert model.attention.key_proj.in_features == 16  # bidirectional: 2·d_encoder
    with pytest.raises(ValueError, match=r"unknown RNNSeq2SeqConfig field.*'heads'"):
        build_rnn_seq2seq({**cfg.to_dict(), "heads": 4})
    with pytest.raises(ValueError, match="d_decoder must be >= 1, got 0"):
        RNNSeq2SeqConfig(d_decoder=0)
    with pytest.raises(TypeError, match="d_embed must be an int, got float"):
        RNNSeq2SeqConfig(d_embed=8.0)
    with pytest.raises(ValueError, match=r"dropout must be in \[0, 1\), got 1.5"):
        RNNSeq2SeqConfig(dropout=1.5)


def test_bad_inputs_are_named():
    model = _small()
    src = torch.randint(1, 30, (2, 5))
    mask = torch.ones(2, 5, dtype=torch.bool)
    tgt = torch.randint(0, 31, (2, 4))
    with pytest.raises(TypeError, match=r"src_mask must be a .* bool tensor"):
        model(src, mask.long(), tgt)
    with pytest.raises(TypeError, match=r"src must be a \(B, S\) integer tensor, got list"):
        model(src.tolist(), mask, tgt)
    with pytest.raises(ValueError, match=r"src and src_mask must both be \(B, S\)"):
        model(src, mask[:, :4], tgt)
    with pytest.raises(
        ValueError,
        match=r"tgt_in holds token ids in \[\d+, 31\], expected ids in \[0, vocab_size=31\)",
    ):
        model(src, mask, tgt + 1)
    with pytest.raises(ValueError, match="tgt_in must have the batch size of src"):
        model(src, mask, tgt[:1])
    with pytest.raises(ValueError, match="eos must be < tgt_vocab_size=31, got 31"):
        model.greedy(src, mask, max_len=3, bos=1, eos=31)
    with pytest.raises(ValueError, match="max_len must be >= 1, got 0"):
        model.greedy(src, mask, max_len=0, bos=1, eos=2)


def test_padding_anywhere_changes_nothing():
    """Each sentence alone equals the same sentence inside a padded batch (padding on the right,
    on the left and in the middle): logits, and alignment on its real columns (0 elsewhere)."""
    model = _small().eval()
    g = torch.Generator().manual_seed(1)
    lengths = [5, 3, 7]
    sents = [torch.randint(3, 30, (n,), generator=g) for n in lengths]
    tgts = torch.randint(3, 31, (3, 6), generator=g)
    tgts[:, 0] = BOS
    S = 11
    layouts = [  # where each sentence's real tokens sit in the padded batch
        torch.arange(5),  # right padding
        torch.arange(S - 3, S),  # left padding
        torch.tensor([0, 2, 3, 6, 7, 9, 10]),  # padding in between
    ]
    src = torch.randint(3, 30, (3, S), generator=g)  # padding ids are arbitrary tokens
    mask = torch.zeros(3, S, dtype=torch.bool)
    for r, (cols, s) in enumerate(zip(layouts, sents, strict=True)):
        src[r, cols] = s
        mask[r, cols] = True
    logits = model(src, mask, tgts)
    weights = model.alignment(src, mask, tgts)
    for r, (cols, s) in enumerate(zip(layouts, sents, strict=True)):
        alone = s[None]
        m1 = torch.ones_like(alone, dtype=torch.bool)
        torch.testing.assert_close(logits[r], model(alone, m1, tgts[r : r + 1])[0])
        w1 = model.alignment(alone, m1, tgts[r : r + 1])[0]  # (T, n)
        torch.testing.assert_close(weights[r][:, cols], w1)
        pad_cols = torch.ones(S, dtype=torch.bool)
        pad_cols[cols] = False
        assert torch.equal(weights[r][:, pad_cols], torch.zeros(6, int(pad_cols.sum())))


def test_alignment_rows_sum_to_one_over_real_tokens():
    model = _small()
    g = torch.Generator().manual_seed(2)
    src = torch.randint(3, 30, (4, 9), generator=g)
    mask = torch.arange(9)[None] < torch.tensor([[9], [4], [1], [6]])
    tgt = torch.randint(0, 31, (4, 7), generator=g)
    w = model.alignment(src, mask, tgt)
    assert w.shape == (4, 7, 9)
    torch.testing.assert_close(w.sum(-1), torch.ones(4, 7))
    assert torch.equal(w.masked_fill(mask[:, None, :], 0.0), torch.zeros(4, 7, 9))
    assert (w[mask[:, None, :].expand_as(w)] > 0).all()  # softmax: every real token weighs > 0
    assert torch.equal(w[2, :, 0], torch.ones(7))  # one real token takes all the weight


def test_greedy_equals_argmax_of_teacher_forcing_on_its_own_output():
    model = _small()
    with torch.no_grad():  # make EOS likely enough that some rows stop and others run on
        model.out.bias[EOS] = 2.0
    g = torch.Generator().manual_seed(3)
    src = torch.randint(3, 30, (6, 8), generator=g)
    mask = torch.arange(8)[None] < torch.tensor([[8], [2], [5], [8], [3], [6]])
    out = model.greedy(src, mask, max_len=12, bos=BOS, eos=EOS)  # (B, n)
    assert out.dim() == 2 and out.shape[0] == 6 and 1 <= out.shape[1] <= 12
    tgt_in = torch.cat([torch.full((6, 1), BOS), out[:, :-1]], dim=1)
    argmax = model(src, mask, tgt_in).argmax(-1)  # (B, n)
    is_eos = out == EOS
    stopped = is_eos.any(1)
    assert 0 < int(stopped.sum()) < 6 or out.shape[1] < 12
    for r in range(6):
        end = int(is_eos[r].nonzero()[0]) + 1 if stopped[r] else out.shape[1]
        assert torch.equal(argmax[r, :end], out[r, :end])
        assert (out[r, end:] == EOS).all()  # after a row's EOS: EOS
    if out.shape[1] < 12:  # it stopped early: then every row has its EOS
        assert stopped.all()


def test_gradients_reach_the_attention_and_not_the_padding():
    model = _small()
    g = torch.Generator().manual_seed(4)
    src = torch.randint(3, 29, (3, 6), generator=g)
    mask = torch.arange(6)[None] < torch.tensor([[6], [4], [2]])
    src = src.masked_fill(~mask, 29)  # token 29 appears only as padding
    tgt = torch.randint(0, 31, (3, 5), generator=g)
    model(src, mask, tgt).logsumexp(-1).sum().backward()
    att = model.attention
    for name, p in (("query", att.query_proj.weight), ("key", att.key_proj.weight), ("v", att.v)):
        assert p.grad is not None and p.grad.abs().sum() > 0, name
    assert model.src_emb.weight.grad[28].abs().sum() > 0
    assert torch.equal(model.src_emb.weight.grad[29], torch.zeros(16))  # padding: no gradient


def test_attend_with_projected_keys_is_the_additive_attention_module():
    """The decoder's step (keys projected once per source) computes exactly what calling its
    `AdditiveAttention` module computes, values and gradients, masks and an empty source too."""
    model = _small()
    g = torch.Generator().manual_seed(5)
    state = torch.randn(4, 32, generator=g, requires_grad=True)
    states = torch.randn(4, 7, 48, generator=g, requires_grad=True)
    keep = (torch.arange(7)[None] < torch.tensor([[7], [3], [1], [0]]))[:, None, :]  # (B, 1, S)
    ours = model.attend(state, model.project_keys(states), states, keep)
    ref_out, ref_w = model.attention(state[:, None], states, mask=keep)
    torch.testing.assert_close(ours[0], ref_out[:, 0])
    torch.testing.assert_close(ours[1], ref_w[:, 0])
    assert torch.equal(ours[1][3], torch.zeros(7)) and torch.equal(ours[0][3], torch.zeros(48))
    dout = torch.randn(4, 48, generator=g)
    grads = torch.autograd.grad((ours[0] * dout).sum(), (state, states))
    ref_grads = torch.autograd.grad((ref_out[:, 0] * dout).sum(), (state, states))
    for a, b in zip(grads, ref_grads, strict=True):
        assert a.isfinite().all()
        torch.testing.assert_close(a, b)
