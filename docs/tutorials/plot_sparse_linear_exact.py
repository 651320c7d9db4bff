"""
Sparse, linear or exact? Time, memory and error at growing lengths
==================================================================

Exact attention costs ``O(L²)`` time. Tiling (the ``flash`` backend) fixes its memory but not
its arithmetic, so long sequences push towards cheaper forms, which fall into two families:

* **sparse**: exact softmax attention over fewer pairs — a sliding window, blocks, strides
  (:mod:`attnlab.masks`), run by the same :func:`attnlab.attention`; ``O(L·w)`` for a window
  of ``w`` keys;
* **kernel ("linear") attention**: replace ``exp(q·k)`` by a product of features
  ``φ(q)·φ(k)`` and reorder the sums, ``O(L)`` time and memory —
  :func:`attnlab.linear.linear_attention` (``φ = elu + 1``, a different attention that a model
  is trained with) and :func:`attnlab.linear.favor_attention`, Performer's FAVOR+, whose random
  features estimate the softmax kernel itself.

This tutorial measures all of them on this machine — time, then memory — and then asks what
each costs in accuracy against exact attention, and on what kind of input.
"""

# %%
# The contenders
# --------------
# Non-causal self-attention (an encoder), batch 1, 4 heads of 64. ``attnlab.linear`` gathers the
# approximations; ``attnlab.attention`` with a :func:`~attnlab.masks.sliding_window` mask is the
# sparse form: ``sliding_window(256, causal=False)`` keeps the keys with ``|i − j| < 256``, and
# the tiled backend skips the empty tiles (see the masks tutorial).

import math
import time

import matplotlib.pyplot as plt
import torch

import attnlab
from attnlab import linear, masks

WINDOW, FEATURES = 256, 256
contenders = {
    "exact (attnlab.attention)": lambda q, k, v: attnlab.attention(q, k, v),
    f"sparse (|i − j| < {WINDOW})": lambda q, k, v: attnlab.attention(
        q, k, v, mask=masks.sliding_window(WINDOW, causal=False)
    ),
    "linear (elu + 1)": lambda q, k, v: linear.linear_attention(q, k, v),
    f"Performer (M = {FEATURES})": lambda q, k, v: linear.favor_attention(
        q, k, v, num_features=FEATURES, generator=torch.Generator().manual_seed(0)
    ),
}

# %%
# Time
# ----
# Forward pass, no gradient, at ``L`` from 256 to 4096. Each number is the fastest of several
# runs, measured now on this machine: the CPU decides the numbers, the slopes tell the story.


def best_seconds(fn, budget=0.3):
    """The fastest run of ``fn()`` after a warm-up: at least 3 runs, more while they fit in
    ``budget`` seconds. The fastest run is the one least disturbed by other work."""
    fn()  # warm-up
    times, spent = [], 0.0
    while len(times) < 3 or (spent < budget and len(times) < 50):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
        spent += times[-1]
    return min(times)


lengths = [256, 512, 1024, 2048, 4096]
seconds = {name: [] for name in contenders}
with torch.inference_mode():
    for L in lengths:
        q, k, v = (torch.randn(1, 4, L, 64) for _ in range(3))
        for name, fn in contenders.items():
            seconds[name].append(best_seconds(lambda fn=fn, q=q, k=k, v=v: fn(q, k, v)))

print(f"{'L':>6}" + "".join(f"{name:>28}" for name in contenders) + "   (ms)")
for i, L in enumerate(lengths):
    print(f"{L:>6}" + "".join(f"{seconds[name][i] * 1e3:>28.2f}" for name in contenders))

fig, ax = plt.subplots(figsize=(6, 4), layout="constrained")
for name in contenders:
    ax.loglog(lengths, [s * 1e3 for s in seconds[name]], "o-", label=name)
ax.set_xlabel("sequence length L")
ax.set_ylabel("forward time (ms), fastest run")
ax.set_title("B = 1, H = 4, D = 64, no mask unless named")
ax.grid(True, which="both", alpha=0.3)
ax.legend(fontsize=8)
plt.show()

# %%
# Memory
# ------
# :func:`attnlab.estimate` counts, from the shapes, what each form holds; and
# :func:`attnlab.analysis.measure_estimate` runs the configuration — one layer, forward *and*
# backward — and records the process's peak memory growth. It measures the naive exact form
# (``"naive"``: the reference, which builds the ``L × S`` weights), the tiled form
# (``"flash"``, with the estimate's mask: none for exact, the window for sparse) and linear
# attention (``"linear"``). The naive form stops at ``L = 2048`` here: at 4096 its scores alone
# take the estimate printed below, and forward and backward hold several such matrices (compare
# the estimate with the measurement at 2048).

E, H = 256, 4  # model dim and heads: D = 64, as above
memory_lengths = [512, 1024, 2048, 4096]
memory = {"naive exact": {}, "tiled exact": {}, "sparse (window)": {}, "linear": {}}
naive_scores = {}  # MiB of one layer's L × L scores, from the estimate
for L in memory_lengths:
    dense = attnlab.estimate(L, E, H)
    naive_scores[L] = dense.value("score matrix", "naive") / 2**20
    which = ("naive", "flash", "linear") if L <= 2048 else ("flash", "linear")
    measured = attnlab.analysis.measure_estimate(dense, which).measured
    window = attnlab.estimate(L, E, H, mask=masks.sliding_window(WINDOW, causal=False))
    sparse = attnlab.analysis.measure_estimate(window, ("flash",)).measured
    for label, key, source in [
        ("naive exact", "naive", measured),
        ("tiled exact", "flash", measured),
        ("sparse (window)", "flash", sparse),
        ("linear", "linear", measured),
    ]:
        if key in source:
            memory[label][L] = source[key]["peak_bytes"] / 2**20

print("MiB" + f"{'naive scores (estimate)':>26}" + "".join(f"{label:>17}" for label in memory))
for L in memory_lengths:
    cells = "".join(
        f"{memory[label][L]:>17.1f}" if L in memory[label] else f"{'-':>17}" for label in memory
    )
    print(f"{L:>4}{naive_scores[L]:>25.1f}{cells}")

fig, ax = plt.subplots(figsize=(6, 4), layout="constrained")
for label, values in memory.items():
    ax.loglog(list(values), list(values.values()), "o-", label=label)
ax.set_xlabel("sequence length L")
ax.set_ylabel("peak memory growth (MiB)")
ax.set_title("one attention layer, forward + backward (measured)")
ax.grid(True, which="both", alpha=0.3)
ax.legend(fontsize=8)
plt.show()

# %%
# Error: what does each approximation give up?
# --------------------------------------------
# The sparse form is exact on the pairs it keeps; its error is the weight exact attention puts
# *outside* the window. ``return_lse=True`` measures it without any ``L × S`` matrix: the
# in-window share of a row's weight is ``exp(lse_window − lse_full)``. Performer is an unbiased
# estimate of the softmax kernel, whose noise grows with the size of the logits. Linear
# attention with ``elu + 1`` is not an estimate of softmax at all.
#
# Which one wins depends on the input, so vary it. Take a smooth sequence (each position a
# small step from the last, like neighbouring tokens that resemble each other) as both queries
# and keys, multiplied by a *sharpness* ``s``: small ``s`` spreads each query's weight over the
# whole sequence, large ``s`` concentrates it on the nearest positions.
# :func:`attnlab.attention_stats` measures how far each query looks — the mean attention
# distance ``Σ_j p_ij |i − j|`` — again without the weights.

L = 1024
generator = torch.Generator().manual_seed(0)
steps = torch.randn(1, 4, L, 64, generator=generator)
smooth = torch.empty_like(steps)  # (B, H, L, D), unit variance, correlation 0.95 between neighbours
smooth[:, :, 0] = steps[:, :, 0]
for t in range(1, L):
    smooth[:, :, t] = 0.95 * smooth[:, :, t - 1] + math.sqrt(1 - 0.95**2) * steps[:, :, t]
v = torch.randn(1, 4, L, 64, generator=generator)


def relative_error(approx, exact):
    return ((approx - exact).norm() / exact.norm()).item()


window = masks.sliding_window(WINDOW, causal=False)
sharpness = [0.25, 0.5, 0.75, 1.0, 1.25]
errors = {"sparse": [], "Performer": [], "linear": []}
distance, inside = [], []
with torch.inference_mode():
    for s in sharpness:
        q = k = s * smooth
        exact, lse = attnlab.attention(q, k, v, return_lse=True)
        stats = attnlab.attention_stats(q, k, v, lse=lse)
        distance.append(stats.mean_distance.mean().item())
        sparse, lse_window = attnlab.attention(q, k, v, mask=window, return_lse=True)
        inside.append((lse_window - lse).exp().mean().item())
        errors["sparse"].append(relative_error(sparse, exact))
        errors["Performer"].append(
            relative_error(contenders[f"Performer (M = {FEATURES})"](q, k, v), exact)
        )
        errors["linear"].append(relative_error(linear.linear_attention(q, k, v), exact))

print(f"{'s':>5} {'mean distance':>14} {'in window':>10}" + "".join(f"{n:>11}" for n in errors))
for i, s in enumerate(sharpness):
    row = "".join(f"{errors[n][i]:>11.3f}" for n in errors)
    print(f"{s:>5} {distance[i]:>14.1f} {inside[i]:>10.1%}{row}")

# %%
# And Performer's one knob, the number of random features ``M``, at a moderate sharpness:
# more features, less noise, more time (its cost is ``O(L·M·D)``). Each error is the mean over
# three draws of the features. The dashed line falls like ``1/√M``, the rate of an average of
# ``M`` independent samples, drawn through the first point.

feature_counts = [16, 64, 256, 1024]
q = k = 0.5 * smooth
with torch.inference_mode():
    exact = attnlab.attention(q, k, v)
    performer_errors = []
    for m in feature_counts:
        draws = [
            linear.favor_attention(
                q, k, v, num_features=m, generator=torch.Generator().manual_seed(seed)
            )
            for seed in range(3)
        ]
        performer_errors.append(sum(relative_error(d, exact) for d in draws) / len(draws))
for m, e in zip(feature_counts, performer_errors, strict=True):
    print(f"M = {m:>4}: relative error {e:.3f}")

fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4), layout="constrained")
for name, values in errors.items():
    left.plot(sharpness, values, "o-", label=name)
left.set_yscale("log")
left.set_xticks(sharpness, [f"{s}\n{d:.0f}" for s, d in zip(sharpness, distance, strict=True)])
left.set_xlabel("sharpness s (top) and mean attention distance of exact attention (bottom)")
left.set_ylabel("relative error vs exact")
left.set_title(f"L = {L}, sparse: |i − j| < {WINDOW}, Performer: M = {FEATURES}")
left.grid(True, which="both", alpha=0.3)
left.legend()
right.loglog(feature_counts, performer_errors, "o-", color="C1", label="Performer (FAVOR+)")
guide = [performer_errors[0] * math.sqrt(feature_counts[0] / m) for m in feature_counts]
right.loglog(feature_counts, guide, "k--", lw=1, label="1/√M")
right.set_xlabel("random features M")
right.set_ylabel("relative error vs exact")
right.set_title(f"L = {L}, sharpness 0.5")
right.grid(True, which="both", alpha=0.3)
right.legend()
plt.show()

# %%
# What to notice
# --------------
# * **Time.** Exact attention grows like ``L²`` (slope 2 on the log-log plot); the window's
#   cost grows like ``L`` once ``L`` exceeds the window, and so do linear attention and
#   Performer, whose constant depends on the feature count.
# * **Memory.** Only the naive form grows like ``L²``; tiling already makes *exact* attention
#   linear in memory, so memory alone is no reason to approximate.
# * **Error.** The sparse error follows the weight outside the window: small when attention is
#   local, large when it is spread out. Performer behaves the other way: it estimates diffuse
#   attention better than sharp attention, and its error falls only slowly with ``M``. Linear
#   attention's ``elu + 1`` kernel is a different model: its "error" is not a defect but a
#   reminder that it is used in models trained with it, not swapped into a trained softmax model.
#
# Next: :mod:`attnlab.linear` (``linear_attention``, ``favor_attention``, the modules
# ``LinearAttention`` and ``PerformerAttention``), :mod:`attnlab.masks`,
# :func:`attnlab.estimate`, :func:`attnlab.analysis.measure_estimate`,
# :func:`attnlab.attention_stats`.
