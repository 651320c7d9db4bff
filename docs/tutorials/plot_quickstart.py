r"""
Attention in one call
=====================

One call of :func:`attnlab.attention` computes scaled dot-product attention for every head and
every query at once:

.. math::

   \operatorname{Attention}(Q, K, V)
   = \operatorname{softmax}\left(\frac{Q K^\top}{\sqrt{D}}\right) V

With ``return_weights=True`` it also returns the weights it used, so we can draw what each query
looked at.
"""

# %%
# Queries, keys and values
# ------------------------
# attnlab's layout is ``(B, H, L, D)``: batch, heads, sequence length, head dimension. Here one
# sequence of 12 tokens, 2 heads of 16 dimensions; keys and values have the same length.
import matplotlib.pyplot as plt
import torch

import attnlab

torch.manual_seed(0)
B, H, L, D = 1, 2, 12, 16
q, k, v = (torch.randn(B, H, L, D) for _ in range(3))

# %%
# One call
# --------
# A causal mask lets token ``i`` attend to tokens ``0..i`` only (``True`` = may attend).
out, weights = attnlab.attention(q, k, v, mask=attnlab.masks.causal(), return_weights=True)
print("output", tuple(out.shape), "weights", tuple(weights.shape))

# %%
# Each row of weights is a probability distribution over the keys that the query may attend:
# it sums to one, and the keys in the future get exactly zero.
print("row sums:", weights.sum(-1)[0, 0])
print("weight above the diagonal:", weights[0, 0].triu(1).abs().max().item())

# %%
# The output is the weighted average of the values: the same numbers as the textbook formula.
expected = weights @ v
print("largest difference from weights @ v:", (out - expected).abs().max().item())

# %%
# Drawing the weights
# -------------------
# Row ``i`` is query ``i``, column ``j`` is key ``j``. The lower triangle is the causal mask at
# work; the colours show where each head looks.
fig, axes = plt.subplots(1, H, figsize=(8, 4), layout="constrained")
for h, ax in enumerate(axes):
    image = ax.imshow(weights[0, h], cmap="viridis", vmin=0.0, vmax=1.0)
    ax.set_title(f"head {h}")
    ax.set_xlabel("key j")
    ax.set_ylabel("query i")
fig.colorbar(image, ax=axes, shrink=0.8, label="weight")
plt.show()
