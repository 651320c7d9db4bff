"""The textbook experiments on scaling and temperature, as data (the CLI prints and plots them).

Why divide by √d_k: for q, k with independent unit-variance entries, ``q·k`` has variance d_k, so
unscaled logits grow with the head size, the softmax saturates towards one-hot, and its gradient
vanishes. Dividing by √d_k keeps the logit variance at 1.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from .._shapes import check_int, check_number
from ..utils import text_table


@dataclass
class ExperimentResult:
    """A small table: column names and rows of floats (the first column is the variable)."""

    title: str
    columns: list[str]
    rows: list[list[float]]

    def table(self) -> str:
        """An aligned text table."""
        rows = [[_num(x) for x in r] for r in self.rows]
        return f"{self.title}\n" + text_table(self.columns, rows, align=">" * len(self.columns))

    def column(self, name: str) -> list[float]:
        """One column's values."""
        i = self.columns.index(name)
        return [r[i] for r in self.rows]


def _num(x: float) -> str:
    return f"{x:.4g}" if isinstance(x, float) else str(x)


def _softmax_stats(logits: Tensor) -> tuple[float, float]:
    """Mean entropy (nats) and mean Frobenius norm of the softmax Jacobian diag(p) − ppᵀ."""
    p = torch.softmax(logits, dim=-1)  # (N, S)
    ent = -(p * p.clamp_min(1e-300).log()).sum(-1)
    # ‖diag(p) − ppᵀ‖_F² = Σ p_i² − 2 Σ p_i³ + (Σ p_i²)²
    s2, s3 = p.pow(2).sum(-1), p.pow(3).sum(-1)
    jac = (s2 - 2 * s3 + s2.pow(2)).clamp_min(0).sqrt()
    return float(ent.mean()), float(jac.mean())


def scaling_experiment(
    d_ks: tuple[int, ...] = (4, 16, 64, 256, 1024),
    samples: int = 4096,
    keys: int = 64,
    seed: int = 0,
    device: torch.device | str | None = None,
) -> ExperimentResult:
    """Variance of q·k and softmax saturation against d_k, with and without 1/√d_k.

    Returns one row per d_k: variance of unscaled and scaled logits, softmax entropy and the norm
    of the softmax Jacobian (the gradient's size) for unscaled and scaled logits over ``keys`` keys.
    The samples are drawn on the CPU generator (the same on every device) and computed on
    ``device`` (default cpu).
    """
    g = torch.Generator().manual_seed(seed)
    rows = []
    for d in d_ks:
        q = torch.randn(samples, 1, d, generator=g, dtype=torch.float64).to(device)
        k = torch.randn(samples, keys, d, generator=g, dtype=torch.float64).to(device)
        raw = (q @ k.transpose(-1, -2)).squeeze(1)  # (samples, keys)
        scaled = raw / math.sqrt(d)
        e_raw, j_raw = _softmax_stats(raw)
        e_sc, j_sc = _softmax_stats(scaled)
        rows.append([d, float(raw.var()), float(scaled.var()), e_raw, e_sc, j_raw, j_sc])
    return ExperimentResult(
        f"Scaling: logits q·k over {keys} keys, {samples} samples "
        f"(entropy in nats, uniform = {math.log(keys):.3f})",
        [
            "d_k",
            "var q·k",
            "var q·k/√d_k",
            "entropy",
            "entropy scaled",
            "grad norm",
            "grad norm scaled",
        ],
        rows,
    )


def temperature_experiment(
    temperatures: tuple[float, ...] = (0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 10.0),
    d_k: int = 64,
    samples: int = 4096,
    keys: int = 64,
    seed: int = 0,
    device: torch.device | str | None = None,
) -> ExperimentResult:
    """Softmax entropy and maximum weight of scaled logits divided by a temperature T, and the
    statistical-physics reading of the same weights (`attnlab.analysis.views.gibbs`): energies
    ``E_j = −s_j``, internal energy ``U = Σ p E`` and free energy ``F = −T log Z`` (means over the
    samples), with ``F = U − T·S`` for the entropy column S.

    The samples are drawn on the CPU generator and computed on ``device`` (default cpu).
    """
    from .views import gibbs

    g = torch.Generator().manual_seed(seed)
    q = torch.randn(samples, 1, d_k, generator=g, dtype=torch.float64).to(device)
    k = torch.randn(samples, keys, d_k, generator=g, dtype=torch.float64).to(device)
    logits = (q @ k.transpose(-1, -2)).squeeze(1) / math.sqrt(d_k)
    rows = []
    for t in temperatures:
        ent, jac = _softmax_stats(logits / t)
        top = float(torch.softmax(logits / t, -1).amax(-1).mean())
        g = gibbs(logits, t)
        rows.append([t, ent, top, jac, float(g.energy.mean()), float(g.free_energy.mean())])
    return ExperimentResult(
        f"Temperature: softmax(q·k/√d_k / T), d_k={d_k}, {keys} keys "
        f"(entropy in nats, uniform = {math.log(keys):.3f}); U, F: Gibbs energy and free energy",
        ["T", "entropy", "max weight", "grad norm", "energy U", "free energy F"],
        rows,
    )


def kernel_regression_experiment(
    bandwidths: tuple[float, ...] = (0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0),
    window: int = 250,
    device: torch.device | str | None = None,
) -> ExperimentResult:
    """Attention as Nadaraya–Watson kernel regression, on the shipped Alice text.

    Data: the book cut into ``window``-character pieces; x_i = the piece's index, y_i = the share
    of its characters that are quotation marks (' or ") — how much dialogue it holds, which
    changes from passage to passage. Gaussian-kernel regression with bandwidth h is softmax
    attention (`attnlab.analysis.views.nadaraya_watson`): ``attention(q=x, k=x_j, v=y_j,
    scale=1/h², bias=−x_j²/2h²)``. For each h the table gives the fit's mean squared error on the
    pieces themselves and leave-one-out (the same attention with a mask that hides key i from
    query i), both relative to the variance of y, and the effective number of pieces averaged
    (exp of the weights' entropy). Small h copies the nearest pieces (low training error, high
    leave-one-out error); large h averages the whole book (both errors → 1); the leave-one-out
    minimum is the bandwidth — the temperature — that generalises best.
    """
    from ..data import default_text_path
    from ..functional import attention
    from .weights import entropy

    text = default_text_path().read_text(encoding="utf-8")
    check_int("window", window, minimum=1, maximum=len(text) // 4)
    n = len(text) // window
    share = [
        sum(c in "'\"" for c in text[i * window : (i + 1) * window]) / window for i in range(n)
    ]
    y = torch.tensor(share, dtype=torch.float64, device=device).unsqueeze(-1)  # (N, 1)
    x = torch.arange(n, dtype=torch.float64, device=device).unsqueeze(-1)  # (N, 1)
    var = float(y.var(correction=0))
    others = ~torch.eye(n, dtype=torch.bool, device=device)  # leave-one-out: not key i
    rows = []
    for h in bandwidths:
        check_number("bandwidths", h, positive=True)
        bias = (-(x[:, 0] ** 2) / (2 * h * h)).expand(n, n)  # −x_j²/2h² for every query
        fit, w = attention(x[None], x[None], y[None], scale=1 / h**2, bias=bias[None],
                           return_weights=True)  # fmt: skip
        loo = attention(x[None], x[None], y[None], scale=1 / h**2, bias=bias[None], mask=others)
        neighbours = float(entropy(w[None]).exp().mean())
        rows.append(
            [
                float(h),
                float(((fit[0] - y) ** 2).mean()) / var,
                float(((loo[0] - y) ** 2).mean()) / var,
                neighbours,
            ]
        )
    return ExperimentResult(
        f"Kernel regression = attention: dialogue share of {n} Alice pieces of {window} "
        "characters against their position; errors relative to the variance",
        ["bandwidth h", "fit error", "leave-one-out error", "pieces averaged"],
        rows,
    )
