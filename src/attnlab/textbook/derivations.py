"""Independent derivations: the second computed fact behind every ``text error``.

A check may only blame the text when attnlab's value differs from the text's AND agrees with a
derivation of the same quantity that does not go through attnlab (see `attnlab.textbook.core`).
This module holds those derivations: closed forms in plain Python and the same computations in
numpy, float64. It imports nothing from attnlab — not even relatively — so a bug in the library
cannot hide in its own witness (``tests/test_textbook_verdicts.py`` parses the imports).

Every function takes and returns plain numbers or numpy arrays; the checks convert their torch
tensors with ``.numpy()``.
"""

from __future__ import annotations

import math


class _NumPy:
    """NumPy, imported on first use: `import attnlab.textbook` needs torch alone (the
    derivations need NumPy when they run: ``pip install 'attnlab[textbook]'``)."""

    def __getattr__(self, name: str) -> object:
        try:
            import numpy
        except ModuleNotFoundError as err:
            raise ModuleNotFoundError(
                "attnlab.textbook needs numpy, which is not installed: "
                'pip install "attnlab[textbook]"'
            ) from err
        return getattr(numpy, name)


np = _NumPy()

F64 = "float64"  # a dtype NumPy reads by name (no import here)


def softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    """``exp(x − max) / Σ exp(x − max)`` along ``axis``; a row of −inf only gives NaN."""
    x = np.asarray(x, dtype=F64)
    e = np.exp(x - np.max(x, axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


def attention_weights(
    q: np.ndarray, k: np.ndarray, scale: float | None = None, keep: np.ndarray | None = None
) -> np.ndarray:
    """``softmax(q kᵀ · scale + log keep)``, scale ``1/√d_k`` by default (Vaswani et al.).

    Args:
        q: (..., n, d_k). k: (..., m, d_k). scale: the logit scale. keep: (n, m) bool, True where
            a key may be attended (excluded logits get −inf).
    """
    q, k = np.asarray(q, dtype=F64), np.asarray(k, dtype=F64)
    s = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    logits = q @ np.swapaxes(k, -1, -2) * s
    if keep is not None:
        logits = np.where(np.asarray(keep, dtype=bool), logits, -np.inf)
    return softmax(logits)


def sdpa(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    scale: float | None = None,
    keep: np.ndarray | None = None,
) -> np.ndarray:
    """Scaled dot-product attention ``softmax(q kᵀ/√d_k) v`` in numpy (see `attention_weights`)."""
    return attention_weights(q, k, scale, keep) @ np.asarray(v, dtype=F64)


def causal_keep(n: int, m: int | None = None, *, bottom_right: bool = True) -> np.ndarray:
    """The causal pattern of n queries over m keys: query i sees key j iff ``j ≤ i + (m − n)``
    (queries aligned with the last keys, as in decoding), or ``j ≤ i`` if not ``bottom_right``."""
    m = n if m is None else m
    i, j = np.arange(n)[:, None], np.arange(m)[None, :]
    return j <= i + ((m - n) if bottom_right else 0)


def band_keep(n: int, window: int) -> np.ndarray:
    """A causal sliding window: query i sees key j iff ``0 ≤ i − j < window``."""
    i, j = np.arange(n)[:, None], np.arange(n)[None, :]
    return (i - j >= 0) & (i - j < window)


def span_ramp(x: np.ndarray, z: float, ramp: float) -> np.ndarray:
    """Sukhbaatar et al.'s (2019) soft span ``m_z(x) = min(max((R + z − x)/R, 0), 1)``."""
    return np.minimum(np.maximum((ramp + z - np.asarray(x, dtype=F64)) / ramp, 0.0), 1.0)


def entropy(p: np.ndarray, axis: int = -1) -> np.ndarray:
    """Shannon entropy in nats with ``0 · log 0 = 0``."""
    p = np.asarray(p, dtype=F64)
    safe = np.where(p > 0, p, 1.0)
    return -(p * np.log(safe)).sum(axis=axis)


def elu1(x: np.ndarray) -> np.ndarray:
    """``elu(x) + 1``, the feature map of Katharopoulos et al. (2020)."""
    x = np.asarray(x, dtype=F64)
    return np.where(x > 0, x + 1, np.exp(np.minimum(x, 0)))


def linear_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
    """``φ(Q)(φ(K)ᵀV) / (φ(Q)(φ(K)ᵀ1))`` with φ = elu + 1 (Katharopoulos et al. 2020, eq. 6)."""
    fq, fk = elu1(q), elu1(k)
    num = fq @ (np.swapaxes(fk, -1, -2) @ np.asarray(v, dtype=F64))
    return num / (fq @ fk.sum(-2)[..., None])


def sinusoid(n: int, d: int, base: float = 10000.0) -> np.ndarray:
    """Vaswani et al.'s table: ``PE[p, 2i] = sin(p / base^(2i/d))``, ``PE[p, 2i+1] = cos(…)``,
    by `math.sin` / `math.cos` entry by entry."""
    out = np.empty((n, d), dtype=F64)
    for p in range(n):
        for c in range(d):
            angle = p / base ** (2 * (c // 2) / d)
            out[p, c] = math.sin(angle) if c % 2 == 0 else math.cos(angle)
    return out


def sinusoid_distance(k: int, d: int, base: float = 10000.0) -> float:
    """``‖PE(p) − PE(p + k)‖`` in closed form: ``√(Σ_i 2 − 2 cos(k ω_i))``, ω_i = base^(−2i/d)
    (the same for every p)."""
    return math.sqrt(sum(2 - 2 * math.cos(k / base ** (2 * i / d)) for i in range(d // 2)))


def transformer_layer_flops(n: int, d: int, d_ff: int) -> int:
    """Matmul FLOPs of one Transformer layer on n tokens (2 per multiply-add): the Q, K, V and
    output projections 4·2nd², the FFN 2·2n·d·d_ff, the scores and the weighted sum 2·2n²d."""
    return 8 * n * d * d + 4 * n * d * d_ff + 4 * n * n * d


def decoder_forward_flops(n: int, d: int, layers: int, vocab: int) -> int:
    """Matmul FLOPs of one forward of a GPT-style decoder on n tokens with d_ff = 4d (2 per
    multiply-add): 24·n·L·d² for the projections and the FFN (12d² weights a layer), 4·L·n²·d
    for the scores and the weighted sum, 2·n·d·V for the output head."""
    return 24 * n * layers * d * d + 4 * layers * n * n * d + 2 * n * d * vocab


def additive_attention_flops(n: int, m: int, d_q: int, d_k: int, d_v: int, hidden: int) -> int:
    """Matrix-matrix FLOPs of Bahdanau attention of n queries over m keys (2 per multiply-add):
    the projections 2n·d_q·h and 2m·d_k·h and the weighted sum 2·n·m·d_v. The scores vᵀ tanh(·)
    (2·n·m·h more) are a matrix-vector product, which torch's FlopCounterMode does not count."""
    return 2 * n * d_q * hidden + 2 * m * d_k * hidden + 2 * n * m * d_v


def mha(
    x: np.ndarray,
    w_qkv: np.ndarray,
    b_qkv: np.ndarray,
    w_o: np.ndarray,
    b_o: np.ndarray,
    heads: int,
) -> np.ndarray:
    """Multi-head self-attention (Vaswani et al. 2017) in numpy: ``[Q K V] = x W_qkvᵀ + b``,
    split into ``heads`` heads of d = E/heads, `sdpa` per head, concatenated, ``· W_oᵀ + b_o``.

    Args:
        x: (n, E). w_qkv: (3E, E), rows Q then K then V. b_qkv: (3E,). w_o: (E, E). b_o: (E,).
    """
    x = np.asarray(x, dtype=F64)
    n, e = x.shape
    d = e // heads
    qkv = x @ np.asarray(w_qkv, dtype=F64).T + b_qkv
    q, k, v = (
        qkv[:, i * e : (i + 1) * e].reshape(n, heads, d).transpose(1, 0, 2) for i in range(3)
    )
    out = sdpa(q, k, v).transpose(1, 0, 2).reshape(n, e)
    return out @ np.asarray(w_o, dtype=F64).T + b_o


def fourier_mixing(x: np.ndarray) -> np.ndarray:
    """FNet's token mixing ``Re(FFT_seq(FFT_hidden(x)))`` (Lee-Thorp et al. 2021), numpy FFT."""
    return np.real(np.fft.fft(np.fft.fft(np.asarray(x, dtype=F64), axis=-1), axis=-2))


def path_laplacian_modes(n: int, count: int) -> np.ndarray:
    """The ``count`` lowest non-constant eigenvectors of the path graph's Laplacian in closed
    form, ``cos(πk(j + ½)/n)`` normalised, each with a positive first entry, (n, count)."""
    j = np.arange(n, dtype=F64)[:, None]
    k = np.arange(1, count + 1, dtype=F64)[None, :]
    modes = np.cos(math.pi * k * (j + 0.5) / n)
    return modes / np.linalg.norm(modes, axis=0)


def shift_residual(code: np.ndarray) -> float:
    """Relative residual of the best linear map ``code[p] → code[p + 1]`` (least squares)."""
    a, b = code[:-1], code[1:]
    m = np.linalg.lstsq(a, b, rcond=None)[0]
    return float(np.linalg.norm(a @ m - b) / np.linalg.norm(b))


def tiled_io(n: int, d: int, block: int) -> int:
    """Slow-memory reads + writes of FlashAttention's Algorithm 1 (Dao et al. 2022) with key
    blocks of ``block`` rows: K and V once (2nd), then per outer step Q, O and the row
    statistics of every query block (3nd + 4n)."""
    return 2 * n * d + math.ceil(n / block) * (3 * n * d + 4 * n)


def attention_kept_bytes(n: int, d_model: int, heads: int, nbytes: int, *, tiled: bool) -> int:
    """Bytes one self-attention core keeps for its backward at batch 1: Q, K, V and the output
    (4·n·d_model elements) plus the n×n probabilities per head, or a float32 log-sum-exp per row
    and head when tiled."""
    extra = heads * n * 4 if tiled else heads * n * n * nbytes
    return 4 * n * d_model * nbytes + extra


def bert_attentions(model_dir: str, text: str) -> np.ndarray:
    """The attention weights of a BERT-family checkpoint on ``text`` by Hugging Face
    transformers (eager attention), (layers, heads, T, T) — another library reading the same
    weights file."""
    import torch
    import transformers

    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    model = transformers.AutoModel.from_pretrained(model_dir, attn_implementation="eager")
    with torch.no_grad():
        out = model.eval()(**tok(text, return_tensors="pt"), output_attentions=True)
    return np.stack([a[0].double().numpy() for a in out.attentions])


def bert_pruned_cosine(model_dir: str, texts: list[str], pruned: list[tuple[int, int]]) -> float:
    """Mean cosine between the mean-pooled sentence embeddings of a BERT-family checkpoint with
    the heads ``pruned`` (layer, head) removed and without, by Hugging Face transformers: a
    forward hook zeroes a removed head's slice of its layer's self-attention output (what the
    head adds before the output projection)."""
    import torch
    import transformers

    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    model = transformers.AutoModel.from_pretrained(model_dir, attn_implementation="eager").eval()
    enc = tok(texts, return_tensors="pt", padding=True)
    d = model.config.hidden_size // model.config.num_attention_heads
    by_layer: dict[int, list[int]] = {}
    for layer, head in pruned:
        by_layer.setdefault(layer, []).append(head)

    def zero_heads(heads: list[int]):
        def hook(_module, _args, output):
            context = output[0].clone()
            for h in heads:
                context[..., h * d : (h + 1) * d] = 0.0
            return (context, *output[1:])

        return hook

    def embed(remove: bool) -> np.ndarray:
        handles = [
            model.encoder.layer[layer].attention.self.register_forward_hook(zero_heads(heads))
            for layer, heads in by_layer.items()
            if remove
        ]
        try:
            with torch.no_grad():
                hidden = model(**enc).last_hidden_state.double()
        finally:
            for h in handles:
                h.remove()
        keep = enc["attention_mask"].double()[..., None]
        return ((hidden * keep).sum(1) / keep.sum(1)).numpy()

    a, b = embed(True), embed(False)
    cos = (a * b).sum(-1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1))
    return float(cos.mean())


def close(a: np.ndarray, b: np.ndarray, tol: float = 1e-12) -> bool:
    """Same shape and max ``|a − b| ≤ tol``."""
    a, b = np.asarray(a, dtype=F64), np.asarray(b, dtype=F64)
    return a.shape == b.shape and bool(np.all(np.abs(a - b) <= tol))


__all__ = [
    "additive_attention_flops",
    "attention_kept_bytes",
    "attention_weights",
    "band_keep",
    "bert_attentions",
    "bert_pruned_cosine",
    "causal_keep",
    "close",
    "decoder_forward_flops",
    "elu1",
    "entropy",
    "fourier_mixing",
    "linear_attention",
    "mha",
    "path_laplacian_modes",
    "sdpa",
    "shift_residual",
    "sinusoid",
    "sinusoid_distance",
    "softmax",
    "span_ramp",
    "tiled_io",
    "transformer_layer_flops",
]
