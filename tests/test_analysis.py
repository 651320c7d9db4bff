"""attnlab.analysis: weight statistics, head importance, the estimator and the experiments."""

from __future__ import annotations

import math

import pytest
import torch

import attnlab
from attnlab import masks
from attnlab.analysis import (
    entropy,
    estimate,
    head_diversity,
    head_entropy,
    head_importance,
    output_norm,
    scaling_experiment,
    temperature_experiment,
)
from attnlab.modules import MultiHeadAttention


# ----------------------------------------------------------------------------- entropy / diversity
def test_entropy_known_values_and_masked_rows_excluded():
    w = torch.zeros(1, 2, 3, 4, dtype=torch.float64)
    w[0, 0, 0] = torch.tensor([1.0, 0, 0, 0])  # one-hot: 0
    w[0, 0, 1] = 0.25  # uniform over 4: log 4
    w[0, 0, 2] = torch.tensor([0.5, 0.5, 0, 0])  # log 2
    w[0, 1, 0] = torch.tensor([0.5, 0.5, 0, 0])
    # head 1 rows 1, 2: fully masked (all zero)
    e = entropy(w)
    assert e.shape == (1, 2, 3)
    torch.testing.assert_close(
        e[0, 0], torch.tensor([0.0, math.log(4), math.log(2)], dtype=torch.float64)
    )
    assert torch.isnan(e[0, 1, 1:]).all()
    h = head_entropy(w)
    torch.testing.assert_close(
        h[0], torch.tensor([(math.log(4) + math.log(2)) / 3, math.log(2)], dtype=torch.float64)
    )


def test_entropy_of_real_attention_weights_matches_direct_formula():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 9, 8, generator=g, dtype=torch.float64) for _ in range(3))
    _, w = attnlab.attention(
        q, k, v, mask=masks.causal() & masks.padding([9, 0]), return_weights=True
    )
    direct = -(w * torch.log(torch.where(w > 0, w, 1.0))).sum(-1)
    e = entropy(w)
    has = w.sum(-1) > 0
    torch.testing.assert_close(e[has], direct[has])
    assert torch.isnan(e[~has]).all() and (~has).any()


def test_entropy_equals_tiled_statistics_when_available():
    if not hasattr(attnlab, "attention_stats"):
        pytest.skip("attnlab.attention_stats is not available in this build")
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, 33, 16, generator=g) for _ in range(3))
    _, w = attnlab.attention(q, k, v, mask=masks.causal(), return_weights=True)
    stats = attnlab.attention_stats(q, k, v, mask=masks.causal())
    torch.testing.assert_close(stats.entropy, entropy(w), atol=1e-5, rtol=1e-5)


def test_head_diversity():
    base = torch.softmax(torch.randn(1, 1, 5, 5, generator=torch.Generator().manual_seed(2)), -1)
    same = base.expand(1, 4, 5, 5)
    torch.testing.assert_close(head_diversity(same), torch.zeros(1))
    eye = torch.eye(5).expand(1, 1, 5, 5)
    anti = torch.eye(5).flip(-1).expand(1, 1, 5, 5)
    shifted = torch.roll(torch.eye(5), 1, dims=-1).expand(1, 1, 5, 5)
    disjoint = torch.cat([eye, shifted], dim=1)  # no overlap at all: cosine 0
    torch.testing.assert_close(head_diversity(disjoint), torch.ones(1))
    # (layers, H, L, S) works too, and the value is 1 − mean pairwise cosine
    three = torch.cat([eye, anti, eye], dim=1)
    cos_ea = float((torch.eye(5) * torch.eye(5).flip(-1)).sum() / 5)
    want = 1 - (cos_ea + 1 + cos_ea) / 3
    torch.testing.assert_close(head_diversity(three), torch.tensor([want]))
    with pytest.raises(ValueError, match=r"at least 2 heads, got H=1"):
        head_diversity(eye)
    with pytest.raises(TypeError, match=r"weights must be a float tensor"):
        entropy(torch.ones(2, 2, 2, dtype=torch.long))


# ----------------------------------------------------------------------------- importance
class TwoLayer(torch.nn.Module):
    def __init__(self, kv_heads=None):
        super().__init__()
        torch.manual_seed(3)
        self.a = MultiHeadAttention(16, 4, num_kv_heads=kv_heads).double()
        self.b = MultiHeadAttention(16, 4, num_kv_heads=kv_heads).double()
        self.head = torch.nn.Linear(16, 1).double()

    def forward(self, x):
        x = x + self.a(x, mask=masks.causal())
        x = x + self.b(x, mask=masks.causal())
        return self.head(x).squeeze(-1)


def _loss(model, batch):
    x, y = batch
    return torch.nn.functional.mse_loss(model(x), y)


@pytest.mark.parametrize("kv_heads", [None, 2])
def test_head_importance_methods(kv_heads):
    model = TwoLayer(kv_heads)
    g = torch.Generator().manual_seed(4)
    batch = (
        torch.randn(3, 7, 16, generator=g, dtype=torch.float64),
        torch.randn(3, 7, generator=g, dtype=torch.float64),
    )
    imp = head_importance(model, batch, _loss, ablation=True)
    assert (
        imp["output_norm"].shape
        == imp["head_mask_gradient"].shape
        == imp["ablation"].shape
        == (2, 4)
    )
    # output_norm is the norm of the head's columns of W_o
    w = model.a.out_proj.weight
    torch.testing.assert_close(imp["output_norm"][0, 2], w[:, 8:12].norm())
    # the gradient w.r.t. a head gate equals a finite difference of the loss in that gate
    from attnlab.analysis import head_gates

    eps = 1e-6
    for layer, h in ((0, 1), (1, 3)):
        gates = [torch.ones(4, dtype=torch.float64) for _ in range(2)]
        gates[layer][h] += eps
        with head_gates(model, gates):
            up = float(_loss(model, batch).detach())
        gates[layer][h] -= 2 * eps
        with head_gates(model, gates):
            down = float(_loss(model, batch).detach())
        assert abs(abs(up - down) / (2 * eps) - float(imp["head_mask_gradient"][layer, h])) < 1e-6
    # ablation is the exact loss change of zeroing one head, and gates are removed afterwards
    with torch.no_grad():
        base = float(_loss(model, batch))
        gates = [torch.ones(4, dtype=torch.float64), torch.ones(4, dtype=torch.float64)]
        gates[1][0] = 0.0
        with head_gates(model, gates):
            ablated = float(_loss(model, batch))
        assert abs((ablated - base) - float(imp["ablation"][1, 0])) < 1e-12
        assert float(_loss(model, batch)) == base


def test_head_importance_sees_a_dead_head():
    model = TwoLayer()
    with torch.no_grad():
        model.b.out_proj.weight[:, 4:8] = 0  # head 1 of layer b cannot contribute
    batch = (torch.randn(2, 5, 16, dtype=torch.float64), torch.randn(2, 5, dtype=torch.float64))
    imp = head_importance(model, batch, _loss, ablation=True)
    assert float(imp["output_norm"][1, 1]) == 0.0
    assert float(imp["head_mask_gradient"][1, 1]) == 0.0
    assert float(imp["ablation"][1, 1]) == 0.0
    assert float(imp["head_mask_gradient"][1, 0]) > 0


def test_output_norm_pads_pruned_modules_and_rejects_models_without_attention():
    model = TwoLayer()
    model.b.prune_heads([0, 2])
    norms = output_norm(model)
    assert (
        norms.shape == (2, 4)
        and torch.isnan(norms[1, 2:]).all()
        and torch.isfinite(norms[1, :2]).all()
    )
    with pytest.raises(ValueError, match=r"no attnlab attention modules"):
        head_importance(torch.nn.Linear(2, 2), None, lambda m, b: torch.zeros(()))


# ----------------------------------------------------------------------------- estimator
def test_estimate_reproduces_textbook_figures():
    assert estimate(4096, 64, 1).value("score matrix", "naive") == 64 * 2**20
    assert estimate(16384, 64, 1).value("score matrix", "naive") == 2**30
    e = estimate(1024, 768, 12, batch=32, dtype="float16")
    assert e.value("projection weights", "naive") == 2_359_296
    assert e.value("projection weights + biases", "naive") == 2_362_368
    assert e.value("score matrix", "naive") == 768 * 2**20


def test_estimate_counts_exactly_the_attended_pairs():
    L, w = 1000, 64
    e = estimate(L, 256, 4, mask=masks.sliding_window(w))
    exact = sum(min(i + 1, w) for i in range(L))
    assert e.value("attended pairs per head", "flash") == exact
    assert e.value("attended pairs per head", "naive") == L * L
    D = 64
    assert e.value("scores QKᵀ", "flash") == 2 * 4 * exact * D
    causal = estimate(L, 256, 4, mask=masks.causal())
    assert causal.value("attended pairs per head", "flash") == L * (L + 1) // 2  # not L²/2
    # any mask: a padded batch averages its items' pairs over the (B, H) grid
    padded = estimate(L, 256, 4, batch=2, mask=masks.causal() & masks.padding([L, L // 2]))
    half = L // 2
    want = (L * (L + 1) // 2 + half * (half + 1) // 2 + (L - half) * half) / 2
    assert padded.value("attended pairs per head", "flash") == want
    assert padded.value("scores QKᵀ", "flash") == 2 * 2 * 4 * want * D
    with pytest.raises(ValueError, match=r"expected a batch of 2 .* got batch=3"):
        estimate(L, 256, 4, batch=3, mask=masks.padding([L, 1]))
    # the former keywords still work, with a warning
    with pytest.warns(DeprecationWarning, match=r"estimate\(causal=\.\.\.\) is deprecated"):
        old = estimate(L, 256, 4, causal=True)
    assert old.value("attended pairs per head", "flash") == L * (L + 1) // 2
    with pytest.warns(DeprecationWarning, match=r"estimate\(window=\.\.\.\) is deprecated"):
        old = estimate(L, 256, 4, window=w)
    assert old.value("attended pairs per head", "flash") == exact
    # decode: one query against the cache; projections only for the new token
    d = estimate(4096, 512, 8, kv_heads=2, decode=True, dtype="float16")
    assert d.config["L"] == 1 and d.value("attended pairs per head", "flash") == 4096
    assert d.value("KV cache", "naive") == 2 * 2 * 4096 * 64 * 2
    assert d.value("projection weights", "naive") == 512 * 512 * 2 + 2 * 512 * 128
    assert "KV cache" in d.table() and "naive" in d.table()


def test_estimate_layers_scale_linearly_and_bad_input():
    one, three = estimate(512, 256, 8), estimate(512, 256, 8, layers=3)
    assert three.value("total", "flash") == 3 * one.value("total", "flash")
    with pytest.raises(ValueError, match=r"d_model=100 must be divisible by num_heads=8"):
        estimate(512, 100, 8)
    with pytest.raises(ValueError, match=r"dtype must be one of"):
        estimate(512, 256, 8, dtype="int8")


def test_estimate_per_head_pairs_and_score_matrix_are_one_layers():
    # Regression (issue 15): at 12 layers the pairs row said 50,331,648 (12 × 2048²).
    one, twelve = estimate(2048, 768, 12), estimate(2048, 768, 12, layers=12)
    for impl in ("naive", "flash", "linear"):
        assert twelve.value("attended pairs per head", impl) == 2048 * 2048 == 4_194_304
        assert twelve.value("score matrix", impl) == one.value("score matrix", impl)
        assert twelve.value("total", impl) == 12 * one.value("total", impl)
        assert twelve.value("parameter memory", impl) == 12 * one.value("parameter memory", impl)
        kept = "activations kept for backward"
        assert twelve.value(kept, impl) == 12 * one.value(kept, impl)
    causal = estimate(2048, 768, 12, layers=12, mask=masks.causal())
    assert causal.value("attended pairs per head", "flash") == 2048 * 2049 // 2
    assert "4,194,304" in twelve.table() and "50,331,648" not in twelve.table()


def test_estimate_measure_runs_and_reports(capsys):
    from attnlab import cli

    assert (
        cli.main(
            [
                "estimate",
                "--seq",
                "256",
                "--d-model",
                "64",
                "--heads",
                "2",
                "--window",
                "32",
                "--measure",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "measured peak memory" in out and "attended pairs per head" in out
    assert "7,696" in out  # 32·33/2 + (256 − 32)·32 attended pairs


# ----------------------------------------------------------------------------- experiments
def test_scaling_experiment_shows_variance_and_saturation():
    r = scaling_experiment(d_ks=(4, 64, 1024), samples=2048)
    for d, raw, scaled in zip(
        r.column("d_k"), r.column("var q·k"), r.column("var q·k/√d_k"), strict=True
    ):
        assert abs(raw / d - 1) < 0.1 and abs(scaled - 1) < 0.1
    ent = r.column("entropy")
    assert ent == sorted(ent, reverse=True)  # unscaled softmax saturates as d_k grows
    scaled_ent = r.column("entropy scaled")
    assert max(scaled_ent) - min(scaled_ent) < 0.05  # scaled stays put
    grads = r.column("grad norm")
    assert grads[-1] < 0.5 * r.column("grad norm scaled")[-1]  # vanishing gradients unscaled


def test_temperature_experiment_entropy_rises(tmp_path, capsys):
    r = temperature_experiment(samples=1024)
    ent = r.column("entropy")
    assert ent == sorted(ent) and ent[-1] < math.log(64) + 1e-9
    # the Gibbs reading: F = U − T·S per sample, hence for the means; U rises with T
    for T, S, U, F in zip(
        r.column("T"), ent, r.column("energy U"), r.column("free energy F"), strict=True
    ):
        assert abs(F - (U - T * S)) < 1e-9 * max(1.0, abs(F))
    energy = r.column("energy U")
    assert energy == sorted(energy)
    from attnlab import cli

    png = tmp_path / "t.png"
    assert cli.main(["experiment", "temperature", "--samples", "512", "--png", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    assert "entropy" in capsys.readouterr().out


def test_kernel_regression_experiment_has_a_best_bandwidth(tmp_path, capsys):
    from attnlab.analysis import kernel_regression_experiment

    r = kernel_regression_experiment()
    fit, loo = r.column("fit error"), r.column("leave-one-out error")
    pieces = r.column("pieces averaged")
    assert fit == sorted(fit) and pieces == sorted(pieces)  # more smoothing, worse fit
    best = loo.index(min(loo))
    assert 0 < best < len(loo) - 1 and min(loo) < 0.9 * loo[0]  # an interior optimum
    assert all(f < o for f, o in zip(fit, loo, strict=True))  # leaving a piece out costs
    with pytest.raises(ValueError, match=r"bandwidths must be > 0, got 0\.0"):
        kernel_regression_experiment(bandwidths=(1.0, 0.0))
    from attnlab import cli

    png = tmp_path / "k.png"
    assert cli.main(["experiment", "kernel-regression", "--png", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "leave-one-out error" in capsys.readouterr().out
