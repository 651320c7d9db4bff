"""
Why divide by √d_k?
===================

Every textbook derivation of attention stops at the same factor: the scores are
``q · k / √d_k``, not ``q · k``. The reason given is a chain of three claims:

1. for queries and keys with independent unit-variance entries, ``q · k`` has variance
   ``d_k``, so raw scores grow with the head size;
2. large scores **saturate** the softmax: nearly all the weight lands on one key;
3. a saturated softmax has a near-zero gradient, so the queries and keys stop learning.

Dividing by ``√d_k`` brings the variance back to 1 whatever the head size. This tutorial checks
each link with a few lines of torch and :func:`attnlab.attention` (whose ``scale=`` argument
turns the factor off), then runs the library's own experiment,
:func:`attnlab.analysis.scaling_experiment` (also ``attnlab experiment scaling`` on the command
line), and reads the verdicts of :mod:`attnlab.textbook`, which checks the source texts' claims
against the library.
"""

# %%
# 1. The variance of q · k grows like d_k
# ---------------------------------------
# Draw many pairs ``q, k ~ N(0, I)`` at several head sizes and look at the distribution of the
# dot product, raw and divided by ``√d_k``.

import matplotlib.pyplot as plt
import torch

import attnlab
from attnlab import textbook

generator = torch.Generator().manual_seed(0)
head_sizes = [16, 64, 256, 1024]
fig, (raw_ax, scaled_ax) = plt.subplots(1, 2, figsize=(10, 3.6), layout="constrained")
for d in head_sizes:
    q = torch.randn(20_000, d, generator=generator, dtype=torch.float64)
    k = torch.randn(20_000, d, generator=generator, dtype=torch.float64)
    dots = (q * k).sum(-1)  # (20000,): one q · k per pair
    print(
        f"d_k = {d:>4}: Var[q·k] = {dots.var():8.2f}   Var[q·k/√d_k] = {(dots / d**0.5).var():.3f}"
    )
    raw_ax.hist(dots, bins=100, histtype="step", density=True, label=f"d_k = {d}")
    scaled_ax.hist(dots / d**0.5, bins=100, histtype="step", density=True, label=f"d_k = {d}")
raw_ax.set_title("raw scores q · k")
scaled_ax.set_title("scaled scores q · k / √d_k")
for ax in (raw_ax, scaled_ax):
    ax.set_xlabel("score")
    ax.legend(fontsize=8)
raw_ax.set_ylabel("density")
plt.show()

# %%
# The raw scores spread out like ``√d_k`` (their standard deviation); the scaled ones are the
# same standard normal at every head size.
#
# 2. Large scores saturate the softmax
# ------------------------------------
# One query, 16 keys, ``d_k = 512``. :func:`attnlab.attention` divides by ``√d_k`` by default;
# ``scale=1.0`` removes the factor. ``return_weights=True`` returns the softmax weights.

d_k, keys = 512, 16
q = torch.randn(1, 1, 1, d_k, generator=generator)  # (B, H, L, D)
k = torch.randn(1, 1, keys, d_k, generator=generator)  # (B, H, S, D)
v = torch.randn(1, 1, keys, d_k, generator=generator)
_, scaled_w = attnlab.attention(q, k, v, return_weights=True)
_, raw_w = attnlab.attention(q, k, v, scale=1.0, return_weights=True)
print("max weight, raw scores:   ", f"{raw_w.max():.4f}")
print("max weight, scaled scores:", f"{scaled_w.max():.4f}")

fig, ax = plt.subplots(figsize=(7, 3.2), layout="constrained")
positions = torch.arange(keys)
ax.bar(positions - 0.2, raw_w.flatten(), width=0.4, label="softmax(q · k)")
ax.bar(positions + 0.2, scaled_w.flatten(), width=0.4, label="softmax(q · k / √d_k)")
ax.set_xlabel("key")
ax.set_ylabel("weight")
ax.set_title(f"one query over {keys} keys, d_k = {d_k}")
ax.legend()
plt.show()

# %%
# 3. A saturated softmax passes almost no gradient
# ------------------------------------------------
# The softmax Jacobian is ``diag(p) − p pᵀ``: when ``p`` is one-hot it is zero, and nothing
# flows back to the scores, hence to ``q`` and ``k``. To measure the gradient that reaches the
# scores, add a zero ``bias=`` to :func:`attnlab.attention`: the logits are ``scores + bias``, so
# the gradient with respect to the bias *is* the gradient with respect to the scores. The loss
# projects each output row on a random unit vector, so its size does not depend on ``d_k``
# (256 queries over 64 keys; the median over the queries of each row's gradient norm).


def score_gradient(d, scale):
    q = torch.randn(1, 1, 256, d, generator=generator)  # (B, H, L, D)
    k = torch.randn(1, 1, 64, d, generator=generator)  # (B, H, S, D)
    v = torch.randn(1, 1, 64, d, generator=generator)
    bias = torch.zeros(1, 1, 256, 64, requires_grad=True)  # (B, H, L, S), added to the scores
    u = torch.nn.functional.normalize(torch.randn(1, 1, 256, d, generator=generator), dim=-1)
    loss = (attnlab.attention(q, k, v, scale=scale, bias=bias) * u).sum()
    loss.backward()
    return bias.grad[0, 0].norm(dim=-1).median().item()  # |∂loss/∂scores| per query row


dims = [4, 16, 64, 256, 1024]
grad_raw = [score_gradient(d, scale=1.0) for d in dims]
grad_scaled = [score_gradient(d, scale=None) for d in dims]  # None: the default 1/√d_k
for d, a, b in zip(dims, grad_raw, grad_scaled, strict=True):
    print(f"d_k = {d:>4}: |∂loss/∂scores| raw {a:.2e}, scaled {b:.2e}")

fig, ax = plt.subplots(figsize=(5.5, 3.6), layout="constrained")
ax.loglog(dims, grad_raw, "o-", label="scale = 1 (raw q · k)")
ax.loglog(dims, grad_scaled, "s-", label="scale = 1/√d_k (default)")
ax.set_xlabel("head size d_k")
ax.set_ylabel("median |∂ loss / ∂ scores|")
ax.set_title("the gradient that reaches the scores")
ax.grid(True, which="both", alpha=0.3)
ax.legend()
plt.show()

# %%
# The library's experiment
# ------------------------
# :func:`attnlab.analysis.scaling_experiment` is the same experiment as a table (one row per
# ``d_k``): the variance of the raw and scaled logits, the softmax entropy (uniform attention
# over the keys has entropy ``log S``) and the norm of the softmax Jacobian, the gradient's
# size. :func:`attnlab.viz.experiment_figure` draws it; its figure is not registered with pyplot,
# so ``plt.figure(fig)`` hands it over for ``plt.show()``.

result = attnlab.analysis.scaling_experiment(samples=512)
print(result.table())
panels = [
    ["var q·k", "var q·k/√d_k"],
    ["entropy", "entropy scaled"],
    ["grad norm", "grad norm scaled"],
]
plt.figure(attnlab.viz.experiment_figure(result, panels))
plt.show()

# %%
# What the textbook says, checked
# -------------------------------
# :mod:`attnlab.textbook` holds the source texts' claims as data, each with a live check and a
# verdict (``agrees``, ``text error``, ``disagrees``, ``not checkable here``). The claims of
# the section on the scaling factor:

for claim in textbook.select_claims(["000"]):
    if claim.id.startswith("000-scale"):
        row = textbook.run_claim(claim)
        print(f"[{claim.id}] {claim.paraphrase}")
        print(f"    computed: {row.finding.computed}")
        print(f"    verdict:  {row.finding.verdict}")

# %%
# What to notice
# --------------
# * The variance grows exactly like ``d_k`` and the factor ``1/√d_k`` undoes it: the scaled
#   scores have the same distribution at every head size, so the softmax sees the same range of
#   logits whether a head has 16 dimensions or 1024.
# * Without the factor, the softmax entropy falls towards zero (one key takes all the weight)
#   and the gradient reaching ``q`` collapses as ``d_k`` grows; with it, both stay flat.
# * ``1/√d_k`` is a choice of temperature: ``attnlab.attention(..., temperature=T)`` divides the
#   scaled logits by ``T`` again, and :func:`attnlab.analysis.temperature_experiment` (``attnlab
#   experiment temperature``) shows the same trade-off between sharp and flat attention.
#
# Next: :func:`attnlab.attention` (``scale``, ``temperature``),
# :func:`attnlab.analysis.scaling_experiment`, :mod:`attnlab.textbook`.
