r"""
From scratch to flash: attention in five lines, then tiled
==========================================================

Scaled dot-product attention is one formula,

.. math::

    \operatorname{Attention}(Q, K, V)
    = \operatorname{softmax}\left(\frac{QK^\top}{\sqrt{d_k}}\right) V,

and it fits in five lines of PyTorch. This tutorial writes those lines, checks that
:func:`attnlab.attention` computes exactly the same thing, and then asks why a library needs more
than five lines: the ``L × S`` score matrix grows quadratically, and the cure — tiling the keys
and keeping a running ("online") softmax — is what attnlab's ``flash`` backend does.
:func:`attnlab.explain` tells you which kernel runs a given call, and a small timing table puts
the naive version, attnlab and PyTorch's fused
:func:`~torch.nn.functional.scaled_dot_product_attention` side by side on this machine.

Shapes follow attnlab's letters: queries ``(B, H, L, D)``, keys and values ``(B, H, S, D)``.
"""

# %%
# Attention from scratch
# ----------------------
# Each query row scores every key (a dot product), the scores are scaled by ``1/√D`` and turned
# into weights by a softmax over the keys, and the output row is the weighted average of the
# values. A causal mask sets the scores of future keys to ``-inf`` before the softmax, so their
# weight is exactly zero.

import math
import time

import matplotlib.pyplot as plt
import torch
import torch.nn.functional as F

import attnlab
from attnlab import masks


def naive_attention(q, k, v, causal=False):
    """softmax(q kᵀ / √D) v, written out: q (B, H, L, D), k and v (B, H, S, D)."""
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])  # (B, H, L, S)
    if causal:  # query i may attend keys j <= i
        L, S = scores.shape[-2:]
        future = torch.ones(L, S, dtype=torch.bool).triu(1)  # True above the diagonal
        scores = scores.masked_fill(future, float("-inf"))
    weights = scores.softmax(dim=-1)  # (B, H, L, S), each row sums to 1
    return weights @ v, weights  # (B, H, L, D), (B, H, L, S)


torch.manual_seed(0)
B, H, L, D = 2, 4, 12, 16
q, k, v = (torch.randn(B, H, L, D) for _ in range(3))
out, weights = naive_attention(q, k, v, causal=True)
print("output", tuple(out.shape), "weights", tuple(weights.shape))
print("row sums of the weights:", weights.sum(-1)[0, 0])

# %%
# One head's weights, as a picture: row ``i`` is query ``i``, column ``j`` key ``j``. The
# upper triangle is exactly zero (the causal mask), and every row is a probability distribution.
# :func:`attnlab.viz.heatmap_figure` draws any ``(rows, cols)`` matrix; ``ax=`` puts it in an
# Axes of ours.

fig, ax = plt.subplots(figsize=(5, 4), layout="constrained")
attnlab.viz.heatmap_figure(
    weights[0, 0], ax=ax, title="causal attention weights, batch 0, head 0", vmin=0
)
plt.show()

# %%
# ``attnlab.attention`` is the same function
# ------------------------------------------
# :func:`attnlab.attention` takes the same tensors; masks are objects from :mod:`attnlab.masks`
# (``True`` = may attend). It is *defined* to equal the plain-PyTorch reference in
# ``attnlab.functional.reference``, and every backend is tested against that reference. Here it
# agrees with our five lines and with PyTorch's fused kernel to float32 rounding:

ours = attnlab.attention(q, k, v, mask=masks.causal())
sdpa = F.scaled_dot_product_attention(q, k, v, is_causal=True)
torch.testing.assert_close(ours, out)
torch.testing.assert_close(sdpa, out)
print("attnlab vs naive: max |diff| =", (ours - out).abs().max().item())
print("sdpa    vs naive: max |diff| =", (sdpa - out).abs().max().item())

# %%
# ``return_weights=True`` also returns the weights (computed by the reference), so you can look
# inside any call:

_, w = attnlab.attention(q, k, v, mask=masks.causal(), return_weights=True)
torch.testing.assert_close(w, weights)

# %%
# The quadratic wall
# ------------------
# The five lines build the whole ``(B, H, L, S)`` score matrix, then a weight matrix of the same
# size. At ``L = S`` that is ``L²`` numbers per head: doubling the sequence quadruples the
# memory. :func:`attnlab.estimate` counts it from the shapes, for the naive form and for the
# tiled ("flash") one, which holds one ``128 × 128`` tile of scores per head at a time:

lengths = [512, 1024, 2048, 4096, 8192, 16384, 32768]
E, heads = 512, 8  # model dim and heads of a small model, float32, batch 1
naive_mib = [attnlab.estimate(n, E, heads).value("score matrix", "naive") / 2**20 for n in lengths]
flash_mib = [attnlab.estimate(n, E, heads).value("score matrix", "flash") / 2**20 for n in lengths]
print(f"{'L':>6} {'naive scores (MiB)':>19} {'flash tile (MiB)':>17}")
for n, a, b in zip(lengths, naive_mib, flash_mib, strict=True):
    print(f"{n:>6} {a:>19,.1f} {b:>17,.2f}")

fig, ax = plt.subplots(figsize=(5.5, 3.8), layout="constrained")
ax.loglog(lengths, naive_mib, "o-", label="naive: the L × L score matrix")
ax.loglog(lengths, flash_mib, "s-", label="tiled: one 128 × 128 tile per head")
ax.set_xlabel("sequence length L")
ax.set_ylabel("score memory (MiB), 8 heads, float32")
ax.set_title("the score matrix grows like L²")
ax.grid(True, which="both", alpha=0.3)
ax.legend()
plt.show()

# %%
# Online softmax: the same answer, one block of keys at a time
# ------------------------------------------------------------
# The softmax needs the whole row — its maximum (for stability) and its sum — before any weight
# is known. The trick (Milakov & Gimelshein, 2018; FlashAttention, Dao et al., 2022) is to keep,
# per query row, a running maximum ``m``, a running normaliser ``l = Σ exp(s − m)`` and a running
# un-normalised output ``acc``. When a new block of keys raises the maximum from ``m`` to
# ``m'``, everything accumulated so far is rescaled by ``exp(m − m')``. After the last block,
# ``acc / l`` is exactly the softmax-weighted average and ``m + log l`` is the row's
# log-sum-exp. Only one ``L × block`` slice of scores ever exists.


def online_attention(q, k, v, block=64):
    """softmax(q kᵀ / √D) v over key blocks of ``block``, with a running max and sum."""
    scale = 1 / math.sqrt(q.shape[-1])
    m = torch.full(q.shape[:-1], float("-inf"))  # (B, H, L): running max
    l = torch.zeros(q.shape[:-1])  # (B, H, L): running Σ exp(s − m)
    acc = torch.zeros(*q.shape[:-1], v.shape[-1])  # (B, H, L, Dv)
    history = []  # (m, l) of row 0 after each block, for the picture below
    for start in range(0, k.shape[-2], block):
        s = q @ k[..., start : start + block, :].transpose(-2, -1) * scale  # (B, H, L, block)
        m_new = torch.maximum(m, s.amax(-1))
        correction = torch.exp(m - m_new)  # rescales what was summed under the old max
        p = torch.exp(s - m_new[..., None])  # (B, H, L, block)
        l = l * correction + p.sum(-1)
        acc = acc * correction[..., None] + p @ v[..., start : start + block, :]
        m = m_new
        history.append((m[0, 0, 0].item(), l[0, 0, 0].item()))
    return acc / l[..., None], m + l.log(), history


q, k, v = (torch.randn(1, 2, 256, 32) for _ in range(3))
tiled, lse, history = online_attention(q, k, v, block=32)
exact, _ = naive_attention(q, k, v)
torch.testing.assert_close(tiled, exact)
_, lse_attnlab = attnlab.attention(q, k, v, return_lse=True)
torch.testing.assert_close(lse, lse_attnlab)
print("online vs naive: max |diff| =", (tiled - exact).abs().max().item())
print("our log-sum-exp equals attnlab's (return_lse=True)")

# %%
# Watch row 0 as the key blocks stream in: the running maximum only ever rises, and each rise
# shrinks what the normaliser had summed so far; ``m + log l`` climbs to the row's
# log-sum-exp, which attnlab returns with ``return_lse=True`` (and from which
# :func:`attnlab.attention_weights` recomputes any rows' weights without the ``L × S`` matrix).

blocks = range(1, len(history) + 1)
running_m = [m for m, _ in history]
running_lse = [m + math.log(l) for m, l in history]
fig, ax = plt.subplots(figsize=(5.5, 3.8), layout="constrained")
ax.plot(blocks, running_m, "o-", label="running max m")
ax.plot(blocks, running_lse, "s-", label="running m + log l")
ax.axhline(lse_attnlab[0, 0, 0].item(), color="k", ls="--", label="final log-sum-exp (attnlab)")
ax.set_xlabel("key blocks seen (32 keys each)")
ax.set_ylabel("row 0, head 0")
ax.set_title("online softmax: one block of keys at a time")
ax.grid(True, alpha=0.3)
ax.legend()
plt.show()

# %%
# attnlab's tiled backend is this loop done properly: tiles of queries *and* keys, the
# log-sum-exp kept in float32, a backward pass that recomputes the tiles instead of storing
# weights, and masks that skip whole tiles (see the masks tutorial). Its tile sizes are knobs of
# :func:`attnlab.functional.flash_attention`; they change the work, never the answer:

q, k, v = (torch.randn(1, 4, 1000, 64) for _ in range(3))
reference = attnlab.attention(q, k, v, mask=masks.causal(), backend="reference")
for bq, bk in [(64, 64), (128, 256), (256, 128)]:
    o, _ = attnlab.functional.flash_attention(q, k, v, mask=masks.causal(), block_q=bq, block_k=bk)
    print(f"tiles {bq:>3} × {bk:<3}: max |diff| vs reference = {(o - reference).abs().max():.2e}")

# %%
# Which kernel runs? ``attnlab.explain``
# --------------------------------------
# ``backend="auto"`` (the default) picks a backend per call from the shapes, the mask and the
# machine. :func:`attnlab.explain` takes the same arguments as :func:`attnlab.attention` and
# returns an :class:`attnlab.Explanation` — which backend would run the call, why, the tiled
# backend's plan, the engines, the state of attnlab's C++ kernels — without running it. Printed,
# it is one labelled line per fact; its fields (``.backend``, ``.plan``, ...) are there for
# code. Three calls: short and unmasked, long and causal, long with a sliding window:


small = [torch.randn(1, 8, 64, 64) for _ in range(3)]
large = [torch.randn(1, 8, 2048, 64) for _ in range(3)]
print(attnlab.explain(*small), end="\n\n")
print(attnlab.explain(*large, mask=masks.causal()), end="\n\n")
print(attnlab.explain(*large, mask=masks.sliding_window(256)))

# %%
# Timing on this machine
# ----------------------
# The naive five lines, :func:`attnlab.attention` and PyTorch's fused SDPA, forward only,
# causal, batch 1, 8 heads of 64, at growing ``L``. Each number is the fastest of a few runs,
# measured now; your CPU will give other numbers, so the script prints them rather than the
# text quoting them.


def best_seconds(fn, budget=0.3):
    """The fastest run of ``fn()`` after a warm-up: at least 3 runs, more while they fit in
    ``budget`` seconds. The fastest run is the one least disturbed by other work."""
    fn()  # warm-up: first calls build caches and plans
    times, spent = [], 0.0
    while len(times) < 3 or (spent < budget and len(times) < 50):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
        spent += times[-1]
    return min(times)


contenders = {
    "naive": lambda q, k, v: naive_attention(q, k, v, causal=True)[0],
    "attnlab.attention": lambda q, k, v: attnlab.attention(q, k, v, mask=masks.causal()),
    "torch SDPA": lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
}
timing_lengths = [256, 512, 1024, 2048]
seconds = {name: [] for name in contenders}
with torch.inference_mode():
    for n in timing_lengths:
        q, k, v = (torch.randn(1, 8, n, 64) for _ in range(3))
        for name, fn in contenders.items():
            seconds[name].append(best_seconds(lambda fn=fn, q=q, k=k, v=v: fn(q, k, v)))

print(f"{'L':>6}" + "".join(f"{name:>20}" for name in contenders) + "   (ms)")
for i, n in enumerate(timing_lengths):
    print(f"{n:>6}" + "".join(f"{seconds[name][i] * 1e3:>20.2f}" for name in contenders))

fig, ax = plt.subplots(figsize=(5.5, 3.8), layout="constrained")
for name in contenders:
    ax.loglog(timing_lengths, [s * 1e3 for s in seconds[name]], "o-", label=name)
ax.set_xlabel("sequence length L")
ax.set_ylabel("forward time (ms), best run")
ax.set_title(f"causal attention, B=1, H=8, D=64 ({torch.get_num_threads()} threads)")
ax.grid(True, which="both", alpha=0.3)
ax.legend()
plt.show()

# %%
# What to notice
# --------------
# * All three compute the same numbers; they differ in *how*. The naive version writes the
#   ``L × L`` matrix to memory twice (scores, then weights) and computes the masked upper half
#   of it anyway.
# * The tiled path never holds more than a tile of scores, and under a causal mask it skips the
#   tiles above the diagonal — about half the work. PyTorch's fused kernel is tiled too; attnlab
#   adds the mask language, the planner and its own C++ kernels, and ``explain`` tells you which
#   one ran.
# * Read the log-log slopes: time grows like ``L²`` for every exact method. Tiling removes the
#   memory wall, not the quadratic arithmetic; the approximations that change the arithmetic are
#   the subject of the sparse, linear and exact tutorial.
#
# Next: :func:`attnlab.attention` for every argument (masks, biases, GQA, soft-capping),
# :mod:`attnlab.masks` for the mask language, :func:`attnlab.explain` and
# :func:`attnlab.estimate`.
