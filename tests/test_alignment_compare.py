"""Two translate models' alignments side by side (issue 17 item 2): the figure draws each
model's own weights in its own column, and ``attnlab visualize --checkpoint A --compare B``
feeds it from two checkpoints (the Transformer and the RNN encoder–decoder)."""

from __future__ import annotations

import argparse

import pytest
import torch

pytest.importorskip("matplotlib")
pytest.importorskip("num2words")

from attnlab.apps.loop import save_model
from attnlab.apps.translate import (
    ARCHITECTURES,
    KIND,
    _arch_meta,
    cross_attentions,
    default_config,
    load,
    vocab_of,
)
from attnlab.cli import main
from attnlab.data.numbers import NumberTask
from attnlab.viz.alignment import (
    alignment_comparison_figure,
    plot_alignment_comparison,
)


def _code(argv: list[str]) -> int:
    """The exit code of ``attnlab ARGV`` (parser errors exit through SystemExit)."""
    try:
        return main(argv)
    except SystemExit as e:
        return int(e.code or 0)


def _item(title: str, s: int, t: int, seed: int) -> tuple:
    g = torch.Generator().manual_seed(seed)
    w = torch.rand(t, s, generator=g).softmax(-1)
    return title, [f"s{j}" for j in range(s)], [f"t{i}" for i in range(t)], w


# ------------------------------------------------------------------------------ the figure
def test_each_column_draws_its_models_weights_rows_aligned() -> None:
    left = [_item("a", 5, 3, 0), _item("b", 7, 4, 1)]
    right = [_item("a", 5, 6, 2), _item("b", 7, 2, 3)]  # each model decodes its own output
    fig = alignment_comparison_figure([("transformer", left), ("rnn", right)])
    axes = fig.axes
    assert len(axes) == 4
    for r in range(2):
        for c, items in enumerate((left, right)):
            ax = axes[r * 2 + c]
            title, src, tgt, w = items[r]
            (image,) = ax.get_images()
            assert torch.equal(torch.as_tensor(image.get_array().data), w.float())
            assert [t.get_text() for t in ax.get_xticklabels()] == src
            assert [t.get_text() for t in ax.get_yticklabels()] == tgt
            assert ax.get_title() == f"{('transformer', 'rnn')[c]}: {title}"
        a, b = axes[r * 2].get_position(), axes[r * 2 + 1].get_position()
        assert b.x0 > a.x1  # side by side: the second model to the right of the first
    assert axes[2].get_position().y1 < axes[0].get_position().y0  # row 1 below row 0


def test_bad_columns_raise_naming_the_item(tmp_path) -> None:
    good = _item("x", 4, 3, 0)
    with pytest.raises(ValueError, match="at least one model"):
        alignment_comparison_figure([])
    with pytest.raises(ValueError, match=r"same number of items.*'b' has 2"):
        alignment_comparison_figure([("a", [good]), ("b", [good, good])])
    with pytest.raises(ValueError, match=r"columns\['b'\]\[0\].*T=3, S=4.*\(4, 3\)"):
        alignment_comparison_figure([("a", [good]), ("b", [(*good[:3], good[3].T)])])
    with pytest.raises(TypeError, match="2-D tensor"):
        alignment_comparison_figure([("a", [(*good[:3], [[0.5]])])])
    assert not list(tmp_path.iterdir())
    png = plot_alignment_comparison(tmp_path / "c.png", [("a", [good]), ("b", [good])])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ------------------------------------------------------------------ from two checkpoints (CLI)
@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory):
    """An untrained Transformer (de, fr) and an untrained RNN (de only) saved as translate
    checkpoints, as `train_translate` writes them (the comparison reads weights; it does not
    need good models)."""
    out = tmp_path_factory.mktemp("pair")
    paths = {}
    for arch, model, langs in (
        (
            "transformer",
            {"d_model": 32, "n_heads": 2, "enc_layers": 1, "dec_layers": 2},
            ("de", "fr"),
        ),
        (
            "rnn",
            {"d_embed": 16, "d_encoder": 16, "d_decoder": 32, "d_attention": 16, "d_output": 32},
            ("de",),
        ),
    ):
        task = NumberTask(max_digits=2, held_out=10, langs=langs, seed=0)
        config = default_config(arch, len(task.vocab), **model)
        torch.manual_seed(0)
        net = ARCHITECTURES[arch](config)
        paths[arch] = save_model(
            out / f"{arch}.safetensors",
            net,
            kind=KIND,
            config=config,
            extra=_arch_meta(arch, task),
        )
    return paths


def test_compare_runs_are_each_checkpoints_own_alignment(pair) -> None:
    from attnlab.cli.visualize import _compare_runs

    args = argparse.Namespace(
        checkpoint=str(pair["transformer"]),
        compare=str(pair["rnn"]),
        model=None,
        text="forty-seven",
        lang="de",
        device="cpu",
    )
    runs = _compare_runs(args)
    assert [r.part for r in runs] == ["decoder cross-attention", "rnn additive attention"]
    for run, arch in zip(runs, ("transformer", "rnn"), strict=True):
        model, ck = load(pair[arch])
        src, out, w = cross_attentions(model, vocab_of(ck), "forty-seven", "de")
        assert run.key_tokens == src and run.tokens == out
        assert torch.equal(run.weights, w)
    assert runs[0].weights.shape[:2] == (2, 2) and runs[1].weights.shape[:2] == (1, 1)
    rnn = runs[1].weights[0, 0]
    assert rnn.shape == (len(runs[1].tokens), len(runs[1].key_tokens))  # (T, S): non-square
    torch.testing.assert_close(rnn.sum(-1), torch.ones(rnn.shape[0]))


def test_cli_compare_writes_side_by_side_png_and_both_views(pair, tmp_path, capsys) -> None:
    import matplotlib.image

    html, png = tmp_path / "c.html", tmp_path / "c.png"
    argv = ["visualize", "--checkpoint", str(pair["transformer"]), "--compare", str(pair["rnn"])]
    assert main([*argv, "forty-seven", "--out", str(html), "--png", str(png)]) == 0
    out = capsys.readouterr().out
    assert "decoder cross-attention" in out and "rnn additive attention" in out
    page = html.read_text(encoding="utf-8")
    assert "attnlab-view-0" in page and "attnlab-view-1" in page
    width = matplotlib.image.imread(png).shape[1]
    # two panels side by side, each at least S = 13 cells of 0.16 in at 80 dpi (<de>, 11
    # characters, <eos>); one panel alone would be narrower than 2 × 13 cells
    assert width > 2 * 13 * 0.16 * 80
    assert main([*argv, "forty-seven", "--format", "text"]) == 0
    text = capsys.readouterr().out
    assert text.count("top-3 attended tokens per query") == 2


def test_cli_compare_errors_are_one_line(pair, tmp_path, capsys) -> None:
    other = save_model(tmp_path / "o.safetensors", torch.nn.Linear(2, 2), kind="rnn", config={})
    t, r = str(pair["transformer"]), str(pair["rnn"])
    cases = [
        (["--compare", r, "x"], "--compare needs --checkpoint"),
        (["--checkpoint", t, "--compare", str(other), "three"], "--compare must be a translate"),
        (["--checkpoint", t, "--compare", r, "--lang", "fr", "three"], "['de'] for --compare"),
    ]
    for args, needle in cases:
        assert _code(["visualize", *args, "--out", str(tmp_path / "x.html")]) == 2
        err = capsys.readouterr().err
        assert needle in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "x.html").exists()
