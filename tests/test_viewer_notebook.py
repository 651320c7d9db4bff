"""The viewer in notebooks and for transformers models: `attnlab.show`, ``_repr_html_``
fragments (self-contained, per-viewer ids, scoped CSS), HF ``output_attentions`` tuples from real
tiny transformers models (BERT self-attention, BART's non-square cross-attention), and the clear
errors for bad tuples. The same pages in headless Chromium: tests/test_browser.py.
"""

from __future__ import annotations

import html.parser
import json
import math
import os
import re
from typing import ClassVar

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest
import torch

import attnlab
from attnlab.viz import AttentionView
from attnlab.viz.attention_view import (
    attention_data,
    attention_html,
    attention_text,
    check_inputs,
    entropies,
    save_attention_html,
    show,
)


def softmax_weights(*shape: int, seed: int = 0, sharp: float = 3.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.softmax(torch.randn(*shape, generator=g, dtype=torch.float64) * sharp, dim=-1)


def rounded(w: torch.Tensor, decimals: int = 4) -> list:
    return torch.round(w.double(), decimals=decimals).tolist()


class Fragment(html.parser.HTMLParser):
    """Tags with their attributes, the text of scripts and styles, and nesting errors."""

    VOID: ClassVar[set[str]] = {
        "meta",
        "link",
        "br",
        "img",
        "input",
        "hr",
        "col",
        "area",
        "base",
        "source",
        "wbr",
    }

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.tags: list[tuple[str, dict[str, str | None]]] = []
        self.stack: list[str] = []
        self.depth0: list[str] = []  # the top-level elements
        self.scripts: list[tuple[dict[str, str | None], str]] = []
        self.styles: list[str] = []
        self.errors: list[str] = []
        self._text: list[str] = []

    def handle_starttag(self, tag, attrs):
        if not self.stack:
            self.depth0.append(tag)
        self.tags.append((tag, dict(attrs)))
        if tag not in self.VOID:
            self.stack.append(tag)
        self._text = []

    def handle_endtag(self, tag):
        if not self.stack or self.stack[-1] != tag:
            self.errors.append(f"</{tag}> closes {self.stack[-1:]}")
            return
        self.stack.pop()
        if tag == "script":
            attrs = [a for t, a in self.tags if t == "script"][-1]
            self.scripts.append((attrs, "".join(self._text)))
        elif tag == "style":
            self.styles.append("".join(self._text))

    def handle_data(self, data):
        self._text.append(data)


def parse(text: str) -> Fragment:
    p = Fragment()
    p.feed(text)
    p.close()
    assert not p.errors and not p.stack, (p.errors, p.stack)
    return p


def css_selectors(css: str) -> list[str]:
    """Every selector of every rule (comma-separated parts), comments removed."""
    css = re.sub(r"/\*.*?\*/", "", css, flags=re.S)
    return [s.strip() for head in re.findall(r"([^{}]+)\{", css) for s in head.split(",")]


# ------------------------------------------------------------------------------ notebooks
def test_repr_html_is_a_self_contained_fragment_with_ids_unique_per_viewer():
    tokens = ["[CLS]", "the", "</script><b>x</b>", "cat", "[SEP]"]
    w = softmax_weights(2, 3, 5, 5)
    view = attnlab.show(tokens, w, title="nb <1>", layer=1, head=2)
    assert isinstance(view, AttentionView) and attnlab.show is show
    first, second = view._repr_html_(), view._repr_html_()
    for frag in (first, second):
        page = parse(frag)
        # One root element, no page-level markup: Jupyter inserts it into its own page.
        assert page.depth0 == ["div"]
        root = page.tags[0][1]
        uid = root["id"]
        assert root["class"] == "attnlab-viewer" and root["data-uid"] == uid
        assert re.fullmatch(r"attnlab-[0-9a-f]{12}", uid)
        names = {t for t, _ in page.tags}
        assert not names & {"html", "head", "body", "title", "meta", "link", "img", "iframe"}
        # Every id on the fragment is unique and derived from the uid.
        ids = [a["id"] for _, a in page.tags if "id" in a]
        assert len(ids) == len(set(ids)) and all(i == uid or i.startswith(uid + "-") for i in ids)
        # Inline style, data and script; nothing fetched.
        assert all("src" not in a and "href" not in a for _, a in page.tags)
        assert set(re.findall(r"https?://[^\s\"')]+", frag)) <= {"http://www.w3.org/2000/svg"}
        (data_attrs, blob), (code_attrs, code) = page.scripts
        assert data_attrs["type"] == "application/json"
        assert data_attrs["data-role"] == "attnlab-data" and data_attrs["id"] == uid + "-data"
        assert json.loads(blob) == view.data
        assert view.data["tokens"] == tokens and view.data["weights"] == rounded(w)
        assert "<b>x</b>" not in frag
        # Without scripts (an untrusted notebook) the fragment says why it is empty.
        assert "needs JavaScript" in frag and 'data-role="no-script"' in frag
        # The script starts from its own root only: no fixed ids, no document-wide queries or
        # key handlers that would reach another viewer.
        assert code_attrs == {} and code.rstrip().endswith(f'}})("{uid}");')
        assert re.findall(r"getElementById\(([^)]*)\)", code) == ["uid"]
        assert "document.querySelector" not in code and "document.addEventListener" not in code
        assert "document.body" not in code and "document.title" not in code
        # The style: every rule scoped under the viewer's class (no body/h1/svg rules leak).
        (css,) = page.styles
        selectors = css_selectors(css)
        assert len(selectors) > 40
        assert all(s == ".attnlab-viewer" or s.startswith(".attnlab-viewer ") for s in selectors)
    assert parse(first).tags[0][1]["id"] != parse(second).tags[0][1]["id"]  # shown twice: 2
    assert repr(view) == "AttentionView('nb <1>', layers=2, heads=3, T=5, S=5, mode='full')"


def test_show_page_and_save_are_the_same_viewer(tmp_path):
    tokens = list("abcdef")
    w = softmax_weights(1, 2, 6, 6, seed=4)
    view = show(tokens, w, title="t", topk=3)
    page = view.html()
    assert page == attention_html(tokens, w, title="t", topk=3)  # deterministic uid
    assert page.startswith("<!DOCTYPE html>") and page.count('class="attnlab-viewer"') == 1
    (uid,) = re.findall(r'<div class="attnlab-viewer" id="([^"]+)"', page)
    assert view.fragment(uid) in page  # the page is the fragment in a <body>
    assert view.save(tmp_path / "v.html").read_text(encoding="utf-8") == page
    out = save_attention_html(tokens, w, tmp_path / "w.html", title="t", topk=3)
    assert out.read_text(encoding="utf-8") == page
    other = attention_html(tokens, softmax_weights(1, 2, 6, 6, seed=5), title="t")
    assert re.findall(r'<div class="attnlab-viewer" id="([^"]+)"', other) != [uid]
    for bad in ("1abc", "a b", 'x"y', "", "a" * 65, 7):
        with pytest.raises(ValueError, match="uid must match"):
            view.fragment(bad)
    with pytest.raises(ValueError, match=r"path must end in \.html"):
        view.save(tmp_path / "v.png")


# ------------------------------------------------------------- sentence pairs / cross-attention
def test_sentence_b_start_is_embedded_and_checked():
    tokens = ["[CLS]", "a", "b", "[SEP]", "c", "d", "[SEP]"]
    w = softmax_weights(1, 2, 7, 7)
    assert attention_data(tokens, w, sentence_b_start=4)["sentence_b_start"] == 4
    assert attention_data(tokens, w)["sentence_b_start"] is None
    for bad in (0, 7, -1, 2.0, True):
        with pytest.raises(ValueError, match=r"sentence_b_start must be (in \[1, 6\]|an int), got"):
            attention_data(tokens, w, sentence_b_start=bad)
    with pytest.raises(ValueError, match="sentence_b_start applies to self-attention"):
        attention_data(tokens[:2], w[..., :2, :], key_tokens=tokens, sentence_b_start=1)


def test_cross_attention_data_is_non_square_with_entropy_over_the_keys():
    q_tokens, k_tokens = ["<s>", "le", "chat"], [f"k{j}" for j in range(8)]
    w = softmax_weights(2, 2, 3, 8, seed=2)
    w[1, 0, 2] = 1.0 / 8  # a uniform row: entropy log S
    key_mask = [True] * 7 + [False]
    data = attention_data(q_tokens, w, key_tokens=k_tokens, key_mask=key_mask)
    assert (data["T"], data["S"], data["cross"]) == (3, 8, True)
    assert data["key_tokens"] == k_tokens and data["key_mask"] == key_mask
    assert data["weights"] == rounded(w)
    assert data["row_entropy"][1][0][2] == round(math.log(8), 4)
    direct = [[sum(-p * math.log(p) for p in r if p > 0) for r in h] for h in w[0].tolist()]
    assert data["entropy"][0] == [round(sum(r) / 3, 4) for r in direct]
    self_data = attention_data(q_tokens, w[..., :3])
    assert self_data["cross"] is False and self_data["key_tokens"] is None
    assert self_data["key_mask"] is None and self_data["S"] == 3
    # The text report names the key tokens.
    report = attention_text(q_tokens, w, key_tokens=k_tokens, k=2, layers=[0], heads=[0])
    best = torch.sort(w[0, 0, 1], descending=True, stable=True).indices[:2].tolist()
    assert report.splitlines()[2].split(" → ")[1] == "   ".join(
        f"{k_tokens[j]} {float(w[0, 0, 1, j]):.3f}" for j in best
    )
    # Without key_tokens a non-square matrix says what is missing.
    with pytest.raises(ValueError, match=r"\(T, T\) = \(3, 3\).*pass the 8 key_tokens"):
        attention_data(q_tokens, w)
    with pytest.raises(ValueError, match=r"\(T, S\) = \(3, 7\) for 3 tokens and 7 key_tokens"):
        attention_data(q_tokens, w, key_tokens=k_tokens[:7])
    with pytest.raises(ValueError, match=r"key_mask must have shape \(8,\)"):
        attention_data(q_tokens, w, key_tokens=k_tokens, key_mask=[True] * 3)
    with pytest.raises(ValueError, match="key_mask needs key_tokens"):
        attention_data(q_tokens, w[..., :3], key_mask=[True] * 3)
    with pytest.raises(TypeError, match="key_tokens must be a sequence of str, got int"):
        attention_data(q_tokens, w, key_tokens=list(range(8)))


def test_long_cross_attention_keeps_top_k_rows_and_non_square_thumbnails():
    T, S, k = 10, 96, 5
    w = softmax_weights(1, 2, T, S, seed=8, sharp=4.0)
    data = attention_data(
        [f"q{i}" for i in range(T)],
        w,
        key_tokens=[f"k{j}" for j in range(S)],
        topk=k,
        thumb_size=16,
    )
    assert data["mode"] == "topk" and data["weights"] is None  # S = 96 > 64
    values, indices = torch.sort(w, dim=-1, descending=True, stable=True)
    assert data["top_idx"] == indices[..., :k].tolist()
    assert data["top_val"] == rounded(values[..., :k])
    # 10 rows stay, 96 columns -> 16: each pixel the max of 6 keys, stored as round(255 · w).
    assert data["thumb_shape"] == [10, 16] and data["thumb_size"] == 16
    blocks = w.reshape(1, 2, T, 16, 6).amax(dim=-1)
    assert data["thumbs"] == torch.round(blocks * 255).long().reshape(1, 2, -1).tolist()
    assert data["notes"][0].startswith(f"Long input ({T} × {S} tokens > 64)")
    assert "10×16 pixels" in data["notes"][0]
    assert data["entropy"] == rounded(entropies(w)[1])  # from every weight, not the top-k


# ------------------------------------------------------------------------------ transformers
@pytest.fixture(scope="module")
def bert_run():
    """A tiny random BertModel (from a config, saved and loaded offline), padded batch of 2."""
    transformers = pytest.importorskip("transformers")
    import tempfile

    cfg = transformers.BertConfig(
        vocab_size=50,
        hidden_size=32,
        num_hidden_layers=3,
        num_attention_heads=4,
        intermediate_size=37,
        max_position_embeddings=32,
    )
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as folder:
        transformers.BertModel(cfg).save_pretrained(folder)
        model = transformers.BertModel.from_pretrained(folder, attn_implementation="eager")
    model.eval()
    ids = torch.tensor([[2, 11, 12, 13, 14, 15, 3], [2, 21, 22, 3, 31, 32, 3]])
    attention_mask = torch.tensor([[1, 1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1, 1]])
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=attention_mask, output_attentions=True)
    return out.attentions, attention_mask


def test_hf_output_attentions_tuple_equals_the_stacked_tensor(bert_run):
    attentions, attention_mask = bert_run
    assert isinstance(attentions, tuple) and len(attentions) == 3
    assert attentions[0].shape == (2, 4, 7, 7)
    tokens = [f"t{i}" for i in range(7)]
    stacked = torch.stack(attentions)  # (layers, B, H, T, S)
    for batch in (0, 1):
        mask = attention_mask[batch].bool()
        got = show(tokens, attentions, batch=batch, mask=mask).data
        assert got == show(tokens, stacked[:, batch], mask=mask).data
        assert got == show(tokens, stacked, batch=batch, mask=mask).data  # the 5-D stack
        assert got == show(tokens, list(attentions), batch=batch, mask=mask).data
        assert got["weights"] == rounded(stacked[:, batch])
        assert (got["layers"], got["heads"], got["T"], got["S"]) == (3, 4, 7, 7)
    assert show(tokens, attentions).data == show(tokens, attentions, batch=0).data
    # Padding: item 0's padded keys get weight 0, and its padded query rows are not entropy rows.
    data = show(tokens, attentions, batch=0, mask=attention_mask[0].bool()).data
    assert all(r[5] == 0 and r[6] == 0 for h in data["weights"][0] for r in h)
    assert all(h[5] is None and h[6] is None for h in data["row_entropy"][0])
    # transformers' own attention_mask (int64 0/1, (B, T)) is accepted as it is.
    for batch in (0, 1):
        assert (
            show(tokens, attentions, batch=batch, mask=attention_mask).data
            == show(tokens, attentions, batch=batch, mask=attention_mask[batch].bool()).data
        )
    assert show(tokens, attentions, mask=attention_mask[0].tolist()).data == data
    with pytest.raises(ValueError, match=r"mask as integers must be 0/1.*got 2"):
        show(tokens, attentions, mask=attention_mask * 2)
    with pytest.raises(TypeError, match=r"mask must be booleans .* got dtype torch.float32"):
        show(tokens, attentions, mask=attention_mask.float())
    with pytest.raises(ValueError, match=r"batch for mask of shape .* must be in \[0, 0\], got 1"):
        show(tokens, attentions, batch=1, mask=attention_mask[:1])
    with pytest.raises(ValueError, match=r"mask must have shape \(7,\) or \(B, 7\).*\(2, 6\)"):
        show(tokens, attentions, mask=attention_mask[:, :6])
    # The text report and the page accept the tuple too.
    assert attention_text(tokens, attentions, batch=1) == attention_text(tokens, stacked[:, 1])
    assert attention_html(tokens, attentions, batch=1) == attention_html(tokens, stacked[:, 1])


def test_bad_hf_tuples_raise_naming_the_index(bert_run):
    attentions, _ = bert_run
    tokens = [f"t{i}" for i in range(7)]
    a = list(attentions)
    with pytest.raises(ValueError, match=r"batch for .* must be in \[0, 1\], got 2"):
        show(tokens, attentions, batch=2)
    with pytest.raises(ValueError, match=r"batch for .* must be in \[0, 1\], got -1"):
        show(tokens, torch.stack(attentions), batch=-1)
    with pytest.raises(ValueError, match=r"batch picks an item.*got batch=1.*\(3, 4, 7, 7\)"):
        show(tokens, torch.stack(attentions)[:, 0], batch=1)
    with pytest.raises(ValueError, match=r"weights must hold one \(B, H, T, S\) tensor per layer"):
        show(tokens, ())
    with pytest.raises(ValueError, match=r"weights\[1\] is None.*attn_implementation=\"eager\""):
        show(tokens, (a[0], None, a[2]))
    with pytest.raises(TypeError, match=r"weights\[2\] must be a torch.Tensor.*got ndarray"):
        show(tokens, (a[0], a[1], a[2].numpy()))
    with pytest.raises(ValueError, match=r"weights\[1\] must be \(B, H, T, S\).*\(4, 7, 7\)"):
        show(tokens, (a[0], a[1][0], a[2]))
    with pytest.raises(ValueError, match=r"weights\[2\] has shape \(2, 4, 6, 6\).*\(2, 4, 7, 7\)"):
        show(tokens, (a[0], a[1], a[2][:, :, :6, :6]))
    with pytest.raises(ValueError, match=r"must end in \(T, T\) = \(6, 6\).*\(3, 4, 7, 7\)"):
        show(tokens[:6], attentions)
    with pytest.raises(ValueError, match="weights must be finite"):
        show(tokens, (a[0], a[1] * float("nan"), a[2]))
    # generate(output_attentions=True) gives one tuple of layers per step: said, not cryptic.
    with pytest.raises(ValueError, match=r"weights\[0\] is a tuple of tensors.*generate\(\)"):
        show(tokens, (attentions, attentions))
    got = check_inputs(tokens, attentions, batch=1)
    assert got.weights.dtype == torch.float64 and got.weights.shape == (3, 4, 7, 7)


@pytest.fixture(scope="module")
def bart_run():
    """A tiny random BartModel: decoder (4 tokens) cross-attends to the encoder (9 tokens)."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.BartConfig(
        vocab_size=60,
        d_model=32,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=4,
        decoder_attention_heads=2,
        encoder_ffn_dim=40,
        decoder_ffn_dim=40,
        max_position_embeddings=32,
    )
    torch.manual_seed(1)
    model = transformers.BartModel._from_config(cfg, attn_implementation="eager").eval()
    enc = torch.tensor([[0, 10, 11, 12, 13, 14, 15, 16, 2], [0, 20, 21, 22, 2, 1, 1, 1, 1]])
    enc_mask = (enc != 1).long()
    dec = torch.tensor([[2, 0, 30, 31], [2, 0, 40, 41]])
    with torch.no_grad():
        out = model(
            input_ids=enc, attention_mask=enc_mask, decoder_input_ids=dec, output_attentions=True
        )
    return out, enc_mask


def test_bart_cross_attentions_are_shown_non_square(bart_run):
    out, enc_mask = bart_run
    cross = out.cross_attentions
    assert len(cross) == 2 and cross[0].shape == (2, 2, 4, 9)  # (B, H, T_dec, S_enc)
    q_tokens = ["</s>", "<s>", "le", "chat"]
    k_tokens = [f"e{j}" for j in range(9)]
    key_mask = enc_mask[1].bool()
    view = show(q_tokens, cross, batch=1, key_tokens=k_tokens, key_mask=key_mask)
    stacked = torch.stack(cross)[:, 1]  # (layers, H, 4, 9)
    assert view.data == show(q_tokens, stacked, key_tokens=k_tokens, key_mask=key_mask).data
    assert (view.data["T"], view.data["S"], view.data["cross"]) == (4, 9, True)
    assert view.data["weights"] == rounded(stacked)
    # Item 1's padded encoder tokens get no attention; every row sums to 1 over real keys.
    w = torch.tensor(view.data["weights"])
    assert (w[..., 5:] == 0).all() and torch.allclose(w.sum(-1), torch.ones(2, 2, 4), atol=4e-4)
    # The decoder's self-attention and the encoder's are square: the same call without keys.
    assert show(q_tokens, out.decoder_attentions, batch=1).data["S"] == 4
    assert show(k_tokens, out.encoder_attentions, batch=0).data["heads"] == 4
    with pytest.raises(ValueError, match=r"\(T, T\) = \(4, 4\).*pass the 9 key_tokens"):
        show(q_tokens, cross)


def test_top_weights_equal_a_stable_sort_including_ties():
    from attnlab import masks
    from attnlab.viz.attention_view import top_weights

    g = torch.Generator().manual_seed(11)
    T, S, k = 40, 40, 6
    w = torch.softmax(torch.randn(3, 2, T, S, generator=g, dtype=torch.float64), dim=-1)
    causal = masks.causal().to_dense(T, S)
    w[0] = torch.softmax(torch.randn(2, T, S, generator=g).masked_fill(~causal, -math.inf), -1)
    w[1, 0] = 1.0 / S  # uniform rows: every value ties
    w[1, 1, :, 10:20] = 0.5  # a tie across the k-th place, and in the middle of the row
    w[2, 0, 5] = torch.tensor([0.1, 0.3] * (S // 2), dtype=torch.float64)
    values, indices = top_weights(w, k)
    expected = torch.sort(w, dim=-1, descending=True, stable=True)
    assert torch.equal(indices, expected.indices[..., :k])
    assert torch.equal(values, expected.values[..., :k])
    assert indices[0, 0, 2, 3:].tolist() == [3, 4, 5]  # causal row 2: then the lowest zeros
    assert indices[1, 0, 7].tolist() == list(range(k))  # uniform: the lowest indices


def test_show_needs_no_matplotlib():
    """`attnlab.show` works where matplotlib cannot be imported (the viewer is HTML only)."""
    import subprocess
    import sys

    code = (
        "import sys; sys.modules['matplotlib'] = None\n"  # any import of it now fails
        "import torch, attnlab\n"
        "v = attnlab.show(['a', 'b'], torch.tensor([[[[1.0, 0.0], [0.5, 0.5]]]]))\n"
        "print(v._repr_html_().count('attnlab-viewer'))\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert int(out.stdout) > 10
