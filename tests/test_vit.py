"""The Vision Transformer (#17 item 4): patches, model, rollout, training, checkpoints, CLI."""

from __future__ import annotations

import json
import re

import pytest
import torch

from attnlab import cli
from attnlab.analysis.rollout import attention_rollout, cls_attention
from attnlab.apps import load_any
from attnlab.apps import vit as app
from attnlab.apps.loop import save_model
from attnlab.checkpoint import CheckpointError
from attnlab.models.vit import (
    VisionTransformer,
    ViTConfig,
    patchify,
    sinusoidal_2d,
    unpatchify,
)
from attnlab.positional import sinusoidal
from attnlab.viz.vit import patch_map, patch_tokens

pytestmark = pytest.mark.usefixtures("one_thread")

TINY = {"d_model": 16, "n_layers": 2, "n_heads": 2, "dropout": 0.0}


@pytest.fixture(scope="module")
def split():
    return app.digits_split()


# ------------------------------------------------------------------------------------- patches
@pytest.mark.parametrize("p", [1, 2, 4, 8])
def test_patchify_round_trip_and_layout(p):
    g = torch.Generator().manual_seed(p)
    x = torch.randn(3, 2, 8, 8, generator=g)
    patches = patchify(x, p)
    G = 8 // p
    assert patches.shape == (3, G * G, 2 * p * p)
    for r, c in [(0, 0), (0, G - 1), (G - 1, 0), (G // 2, G - 1)]:
        want = x[:, :, r * p : (r + 1) * p, c * p : (c + 1) * p].reshape(3, -1)
        assert torch.equal(patches[:, r * G + c], want)  # row-major patches, (C, p, p) inside
    assert torch.equal(unpatchify(patches, p, 8), x)  # patches -> image, exactly


def test_unpatchify_non_square():
    x = torch.randn(2, 1, 4, 6)
    assert torch.equal(unpatchify(patchify(x, 2), 2, 4, 6), x)


def test_patch_errors():
    with pytest.raises(ValueError, match=r"patch_size must divide H=8 and W=8, got 3"):
        patchify(torch.zeros(1, 1, 8, 8), 3)
    with pytest.raises(ValueError, match=r"images must be \(B, C, H, W\), got \(8, 8\)"):
        patchify(torch.zeros(8, 8), 2)
    with pytest.raises(
        ValueError, match=r"patches must have shape \(B, 16, C·4\).*got \(1, 15, 4\)"
    ):
        unpatchify(torch.zeros(1, 15, 4), 2, 8)


# --------------------------------------------------------------------------------------- model
def test_default_config_has_at_least_16_patch_tokens_of_2x2_pixels():
    cfg = ViTConfig()
    assert cfg.patch_size <= 2 and cfg.num_patches >= 16 and cfg.image_size == 8


@pytest.mark.parametrize("positional", ["learned", "sinusoidal"])
def test_shapes_and_weights(positional):
    torch.manual_seed(0)
    model = VisionTransformer(ViTConfig(positional=positional, **TINY)).eval()
    x = torch.rand(5, 1, 8, 8)
    logits, weights = model(x, need_weights=True)
    assert logits.shape == (5, 10)
    assert len(weights) == 2 and all(w.shape == (5, 2, 17, 17) for w in weights)
    for w in weights:  # every token (the [CLS] row included) attends over all 17 tokens
        torch.testing.assert_close(w.sum(-1), torch.ones(5, 2, 17))
    # The weights' forward (an attention that returns them) matches the fast path.
    torch.testing.assert_close(model(x), logits, atol=2e-5, rtol=1.3e-6)


def test_image_checks_name_the_expected_shape():
    model = VisionTransformer(ViTConfig(**TINY))
    with pytest.raises(ValueError, match=r"\(B, 1, 8, 8\), got \(2, 8, 8\)"):
        model(torch.zeros(2, 8, 8))
    with pytest.raises(ValueError, match=r"\(B, 1, 8, 8\), got \(2, 3, 8, 8\)"):
        model(torch.zeros(2, 3, 8, 8))
    with pytest.raises(TypeError, match=r"floating-point tensor, got dtype torch.int64"):
        model(torch.zeros(2, 1, 8, 8, dtype=torch.long))
    with pytest.raises(TypeError, match="got ndarray"):
        model(torch.zeros(2, 1, 8, 8).numpy())


@pytest.mark.parametrize(
    ("kwargs", "error", "pattern"),
    [
        ({"patch_size": 3}, ValueError, r"patch_size must divide image_size=8, got 3"),
        ({"positional": "rope"}, ValueError, r"positional must be one of .*got 'rope'"),
        ({"positional": "sinusoidal", "d_model": 18, "n_heads": 2}, ValueError, "by 4.*got 18"),
        ({"d_model": 30, "n_heads": 4}, ValueError, "d_model=30 must be divisible by n_heads=4"),
        ({"image_size": 8.0}, TypeError, "image_size must be an int, got float 8.0"),
        ({"num_classes": 0}, ValueError, "num_classes must be >= 1, got 0"),
        ({"dropout": 1.0}, ValueError, r"dropout must be in \[0, 1\), got 1.0"),
    ],
)
def test_config_errors(kwargs, error, pattern):
    with pytest.raises(error, match=pattern):
        ViTConfig(**kwargs)


def test_config_dict_round_trip_and_unknown_keys():
    cfg = ViTConfig(positional="sinusoidal", patch_size=1, d_model=32)
    assert ViTConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ValueError, match=r"unknown ViTConfig field\(s\) \['colour'\]"):
        ViTConfig.from_dict({**cfg.to_dict(), "colour": 1})


def test_positions_are_two_dimensional():
    E, G = 16, 4
    table = sinusoidal_2d(G, E)
    rows = sinusoidal(G, E // 2)
    for r, c in [(0, 0), (1, 3), (3, 2)]:
        assert torch.equal(table[r * G + c], torch.cat((rows[r], rows[c])))
    model = VisionTransformer(ViTConfig(positional="learned", **TINY))
    pos = model.positions()  # learned: row vector + column vector
    assert torch.equal(pos[1 * G + 3], model.pos_row[1] + model.pos_col[3])


# ------------------------------------------------------------------------------------- rollout
def _maps():
    f64 = torch.float64
    layer0 = torch.tensor([[[1.0, 0.0], [0.5, 0.5]], [[0.0, 1.0], [0.5, 0.5]]], dtype=f64)
    layer1 = torch.tensor([[[0.2, 0.8], [1.0, 0.0]], [[0.2, 0.8], [1.0, 0.0]]], dtype=f64)
    return [layer0[None], layer1[None]]  # 2 × (B=1, H=2, T=2, T=2)


def test_rollout_equals_the_hand_computed_product():
    # Head means: A0 = [[.5, .5], [.5, .5]], A1 = [[.2, .8], [1, 0]].
    # Â0 = ½(A0 + I) = [[.75, .25], [.25, .75]];  Â1 = ½(A1 + I) = [[.6, .4], [.5, .5]].
    # R = Â1 · Â0 = [[.6·.75 + .4·.25, .6·.25 + .4·.75], [.5, .5]] = [[.55, .45], [.5, .5]].
    r = attention_rollout(_maps())
    want = torch.tensor([[[0.55, 0.45], [0.5, 0.5]]], dtype=torch.float64)
    torch.testing.assert_close(r, want, atol=1e-15, rtol=0)
    # Â0 · Â1 would be [[.575, .425], [.525, .475]]: the order (last layer left) matters.
    # Without the residual: A1 · A0 = [[.5, .5], [.5, .5]].
    half = torch.full((1, 2, 2), 0.5, dtype=torch.float64)
    torch.testing.assert_close(attention_rollout(_maps(), residual=0.0), half)
    # Max fusion: max(A0) = [[1, 1], [.5, .5]], ½(max + I) = [[1, .5], [.25, .75]], rows
    # renormalised to [[2/3, 1/3], [.25, .75]]; max(A1) = A1 -> Â1 as above.
    a0 = torch.tensor([[2 / 3, 1 / 3], [0.25, 0.75]], dtype=torch.float64)
    a1 = torch.tensor([[0.6, 0.4], [0.5, 0.5]], dtype=torch.float64)
    torch.testing.assert_close(attention_rollout(_maps(), head_fusion="max")[0], a1 @ a0)
    # From layer 1 on: just Â1.
    torch.testing.assert_close(attention_rollout(_maps(), start_layer=1)[0], a1)


def test_rollout_rows_sum_to_one():
    g = torch.Generator().manual_seed(0)
    maps = [torch.softmax(torch.randn(3, 4, 9, 9, generator=g), -1) for _ in range(5)]
    maps[2][0, :, 4] = 0.0  # a row that attends nothing (all heads)
    for fusion in ("mean", "max", "min"):
        r = attention_rollout(maps, head_fusion=fusion)
        assert r.shape == (3, 9, 9) and r.dtype == torch.float32 and (r >= 0).all()
        torch.testing.assert_close(r.sum(-1), torch.ones(3, 9), atol=1e-6, rtol=0)
    stacked = attention_rollout(torch.stack(maps))  # (layers, B, H, T, T) is accepted
    assert torch.equal(stacked, attention_rollout(maps))


def test_rollout_of_one_layer_is_half_attention_half_identity():
    a = torch.softmax(torch.randn(2, 3, 5, 5, dtype=torch.float64), -1)
    want = 0.5 * a.mean(1) + 0.5 * torch.eye(5, dtype=torch.float64)
    torch.testing.assert_close(attention_rollout([a]), want, atol=1e-15, rtol=0)


def test_rollout_errors():
    sq = torch.softmax(torch.randn(1, 2, 4, 4), -1)
    with pytest.raises(ValueError, match=r"square .* got \(T, S\) = \(4, 3\)"):
        attention_rollout([torch.zeros(1, 2, 4, 3)])
    with pytest.raises(
        ValueError,
        match=r"attentions\[1\] must be \(B, H, T, T\) like .*\(1, 2, 4, 4\), got \(1, 2, 5, 5\)",
    ):
        attention_rollout([sq, torch.zeros(1, 2, 5, 5)])
    with pytest.raises(ValueError, match="at least one layer"):
        attention_rollout([])
    with pytest.raises(ValueError, match=r"residual must be in \[0, 1\], got 1.5"):
        attention_rollout([sq], residual=1.5)
    with pytest.raises(ValueError, match=r"head_fusion must be one of .*got 'sum'"):
        attention_rollout([sq], head_fusion="sum")
    with pytest.raises(ValueError, match=r"start_layer must be in \[0, 0\], got 1"):
        attention_rollout([sq], start_layer=1)
    with pytest.raises(TypeError, match=r"floating point, got dtype torch.int64"):
        attention_rollout([torch.zeros(1, 2, 4, 4, dtype=torch.long)])


def test_cls_attention_is_the_cls_row_over_the_patches():
    maps = [torch.softmax(torch.randn(2, 3, 17, 17), -1) for _ in range(2)]
    assert torch.equal(cls_attention(maps), maps[1][:, :, 0, 1:])
    assert torch.equal(cls_attention(maps, layer=0), maps[0][:, :, 0, 1:])
    with pytest.raises(ValueError, match=r"layer must be in \[-2, 1\], got 2"):
        cls_attention(maps, layer=2)


def test_patch_map_and_tokens():
    m = patch_map(torch.arange(4.0), 2, 8)  # 2 × 2 patches of 4 × 4 pixels
    assert m.shape == (8, 8) and m[0, 3] == 0 and m[0, 4] == 1 and m[7, 0] == 2 and m[4, 7] == 3
    assert patch_tokens(2) == ["[CLS]", "r0c0", "r0c1", "r1c0", "r1c1"]


# ------------------------------------------------------------------------------- data, training
def test_digits_split_is_stratified_and_fixed(split):
    assert split.sizes() == {"train": 1437, "test": 360}
    assert split.x_train.shape == (1437, 1, 8, 8) and split.x_train.min() >= 0
    assert split.x_train.max() == 1.0
    counts = torch.bincount(split.y_test, minlength=10)
    assert counts.min() >= 35 and counts.max() <= 37  # 20 % of each class (174–183 images)
    again = app.digits_split()
    assert torch.equal(again.x_test, split.x_test) and torch.equal(again.y_test, split.y_test)


def test_shift_images_translates_with_zero_fill():
    x = torch.zeros(400, 1, 8, 8)
    x[:, 0, 3, 4] = 1.0
    out = app.shift_images(x, 1, torch.Generator().manual_seed(0))
    assert torch.equal(out.sum((1, 2, 3)), torch.ones(400))  # the pixel moved, nothing else
    where = out[:, 0].flatten(1).argmax(-1)
    dy, dx = where // 8 - 3, where % 8 - 4
    assert dy.abs().max() == 1 and dx.abs().max() == 1
    assert len(set(zip(dy.tolist(), dx.tolist(), strict=True))) == 9  # every offset occurs
    edge = torch.zeros(1, 1, 8, 8)
    edge[0, 0, 0, :] = 1.0  # the top row: a shift down keeps it, a shift up drops it (zero fill)
    outs = {
        float(app.shift_images(edge, 1, torch.Generator().manual_seed(s)).sum()) for s in range(40)
    }
    assert outs <= {8.0, 7.0, 0.0} and 0.0 in outs
    assert app.shift_images(x, 0, torch.Generator()) is x


def test_a_tiny_run_learns(split):
    # About one CPU-second: 150 steps of a one-block model without augmentation.
    cfg = ViTConfig(d_model=32, n_layers=1, n_heads=4, dropout=0.0)
    s = app.VitSettings(
        steps=150, batch_size=32, lr=5e-3, warmup=10, eval_every=0, time_budget=None, shift=0
    )
    result = app.train_vit(cfg, s, split, log=lambda _: None)
    losses = result.history.train_loss
    assert sum(losses[-10:]) / 10 < 0.5 * sum(losses[:10]) / 10  # the loss falls (from ln 10)
    assert result.accuracy > 0.6  # chance is 0.1 (0.86 measured)
    assert result.accuracy == app.accuracy(result.model, split.x_test, split.y_test)
    assert len(result.per_class) == 10 and min(result.per_class) >= 0.0


def test_settings_errors():
    with pytest.raises(ValueError, match="batch_size must be >= 1, got 0"):
        app.VitSettings(batch_size=0)
    with pytest.raises(ValueError, match="shift must be >= 0, got -1"):
        app.VitSettings(shift=-1)
    with pytest.raises(ValueError, match="min_lr must be <= lr"):
        app.VitSettings(lr=1e-4, min_lr=1e-3)
    with pytest.raises(ValueError, match="channels=1, image_size=8, got channels=3"):
        app.train_vit(ViTConfig(channels=3), app.VitSettings(steps=1))


def test_svm_baseline(split):
    svm = app.svm_baseline(split)
    assert 0.97 <= svm["accuracy"] <= 1.0 and svm["seconds"] < 30


# ---------------------------------------------------------------------------------- checkpoints
@pytest.mark.parametrize("positional", ["learned", "sinusoidal"])
def test_checkpoint_round_trip_through_load_any(tmp_path, positional):
    torch.manual_seed(1)
    model = VisionTransformer(ViTConfig(positional=positional, patch_size=1, **TINY)).eval()
    path = app.save(tmp_path / "v.safetensors", model, note="x")
    kind, loaded, ck = load_any(path)
    assert kind == "vit" and isinstance(loaded, VisionTransformer) and not loaded.training
    assert loaded.config == model.config
    assert json.loads(ck.metadata["vit_info"]) == {"note": "x"}
    x = torch.rand(3, 1, 8, 8)
    assert torch.equal(loaded(x), model(x))


def test_checkpoint_config_must_match_the_tensors(tmp_path):
    model = VisionTransformer(ViTConfig(**TINY))
    lying = {**model.config.to_dict(), "n_layers": 3}
    p = save_model(tmp_path / "a.safetensors", model, kind="vit", config=lying)
    with pytest.raises(CheckpointError, match="says 3 layer"):
        load_any(p)
    # A bigger image is not justified by the position tables in the file.
    for positional in ("learned", "sinusoidal"):
        m = VisionTransformer(ViTConfig(positional=positional, **TINY))
        big = {**m.config.to_dict(), "image_size": 4096}
        p = save_model(tmp_path / f"{positional}.safetensors", m, kind="vit", config=big)
        with pytest.raises(CheckpointError, match=r"do not justify|describes no buildable"):
            load_any(p)
    bad = {**model.config.to_dict(), "patch_size": 3}
    p = save_model(tmp_path / "b.safetensors", model, kind="vit", config=bad)
    with pytest.raises(CheckpointError, match="patch_size must divide image_size=8, got 3"):
        load_any(p)
    gpt_like = save_model(tmp_path / "c.safetensors", model, kind="other", config={})
    with pytest.raises(CheckpointError, match="holds a 'other' model, expected 'vit'"):
        app.load(gpt_like)


# -------------------------------------------------------------------------------------- the CLI
def _refuse(*args, **kwargs):
    raise AssertionError("the run started")


def _exit_code(argv):
    """``attnlab`` with ``argv``: its exit code (parser errors exit through SystemExit)."""
    try:
        return cli.main(argv)
    except SystemExit as e:
        return e.code


@pytest.mark.parametrize(
    ("argv", "pattern"),
    [
        (["--heads", "3"], r"argument --heads: must divide --d-model 64, got 3"),
        (["--patch-size", "3"], r"argument --patch-size: invalid choice: 3"),
        (
            ["--positional", "sinusoidal", "--d-model", "66", "--heads", "2"],
            r"argument --d-model: must be divisible by 4 with --positional sinusoidal, got 66",
        ),
        (["--steps", "0"], r"argument --steps: expected an int >= 1, got 0"),
        (["--steps", "10", "--warmup", "20"], r"argument --warmup: must be <= --steps 10, got 20"),
        (["--dropout", "1"], r"argument --dropout: expected a finite number in \[0, 1\)"),
        (["--positional", "rope"], r"argument --positional: invalid choice: 'rope'"),
    ],
)
def test_cli_errors_are_one_line_exit_2(monkeypatch, capsys, tmp_path, argv, pattern):
    monkeypatch.setattr(app, "run", _refuse)
    assert _exit_code(["train", "vit", "--out", str(tmp_path / "o"), *argv]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1
    assert err.startswith("attnlab train") and re.search(pattern, err), err
    assert not (tmp_path / "o").exists()


def test_cli_refuses_an_output_path_that_is_a_file(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(app, "run", _refuse)
    f = tmp_path / "file"
    f.write_text("x")
    assert cli.main(["train", "vit", "--out", str(f / "sub")]) == 2
    err = capsys.readouterr().err
    assert "argument --out: cannot create directory" in err and len(err.strip().splitlines()) == 1


def test_cli_defaults_are_the_library_defaults():
    parser = cli.build_parser()
    args = parser.parse_args(["train", "vit"])
    s, c = app.VitSettings(), ViTConfig()
    assert (args.steps, args.batch_size, args.lr, args.warmup, args.weight_decay) == (
        s.steps,
        s.batch_size,
        s.lr,
        s.warmup,
        s.weight_decay,
    )
    assert (
        args.shift,
        args.seed,
        args.time_budget or None,
        args.eval_every,
        args.label_smoothing,
    ) == (
        s.shift,
        s.seed,
        s.time_budget,
        s.eval_every,
        s.label_smoothing,
    )
    assert (
        args.patch_size,
        args.positional,
        args.d_model,
        args.layers,
        args.heads,
        args.dropout,
    ) == (c.patch_size, c.positional, c.d_model, c.n_layers, c.n_heads, c.dropout)
    assert args.lr / 50 == s.min_lr


def test_cli_tiny_run_writes_everything(tmp_path, capsys):
    out = tmp_path / "run"
    code = cli.main(
        [
            "train",
            "vit",
            "--out",
            str(out),
            "--steps",
            "40",
            "--warmup",
            "5",
            "--d-model",
            "16",
            "--layers",
            "1",
            "--heads",
            "2",
            "--quiet",
            "--eval-every",
            "0",
        ]
    )
    assert code == 0
    m = json.loads((out / "metrics.json").read_text())
    assert 0.0 <= m["held_out_accuracy"] <= 1.0 and m["steps"] == 40
    assert m["svm_accuracy"] >= 0.97 and m["sizes"] == {"train": 1437, "test": 360}
    assert "cpu" in m["machine"]
    assert (out / "vit_attention.png").stat().st_size > 1000
    page = (out / "attention.html").read_text()
    assert "r3c3" in page and "[CLS]" in page
    kind, model, _ = load_any(out / "ckpt.safetensors")
    assert kind == "vit" and model.config.d_model == 16
    text = capsys.readouterr().out
    assert "held-out accuracy" in text and "SVM baseline" in text
    # attnlab visualize knows the kind from the file: the digit's patches as tokens
    capsys.readouterr()
    view = tmp_path / "view.html"
    ckpt = str(out / "ckpt.safetensors")
    code = cli.main(["visualize", "--checkpoint", ckpt, "7", "--out", str(view), "--png"])
    printed = capsys.readouterr().out
    assert code == 0 and "held-out digit 7: true" in printed
    assert "r3c3" in view.read_text() and view.with_suffix(".png").stat().st_size > 1000
    code = cli.main(["visualize", "--checkpoint", ckpt, "360", "--format", "text"])
    err = capsys.readouterr().err
    assert code == 2 and "held-out image index in [0, 360)" in err and len(err.splitlines()) == 1
