"""Whole-layer and whole-model costs: parameters, FLOPs and memory for training and inference.

One Transformer layer (pre-LN, the shape of `attnlab.models.TransformerBlock`) with B sequences of
L tokens, width E, H query heads and H_kv key/value heads of dimension D = E / H, MLP width F::

    matmul FLOPs per layer (forward) = 2·B·L·E·(H + 2·H_kv)·D      QKV projections
                                     + 2·B·L·H·D·E                output projection
                                     + 2·B·L·E·F·m                MLP (m = 2 GELU, 3 SwiGLU)
                                     + 4·B·H·P·D                  QKᵀ and PV over P pairs

(P = L·L dense, or the pairs a mask attends for the tiled form.) With H_kv = H, F = 4E and
P = L² that is the textbook ``24·B·L·E² + 4·B·L²·E``. The backward pass costs twice the forward
matmuls (one matmul for each input's gradient), so a training step costs 3×. These are exactly the
matmuls `torch.utils.flop_counter.FlopCounterMode` counts (tests/test_costs.py checks it on meta
tensors); softmax, norms and activations are listed apart as "elementwise" FLOPs.

Memory for training = parameters · (weight + gradient + optimizer + master-copy bytes) +
activations kept for backward (all layers) + the output head's logits; for inference = weights +
the live tensors of one layer at a time + logits (+ a KV cache when decoding).

Example:
    >>> c = model_cost(512, d_model=768, n_layers=12, n_heads=12, vocab_size=30522)
    >>> round(c.params / 1e6, 1)  # BERT-base without position and type tables
    108.5
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

from .._shapes import check_int
from ..masks import Mask
from .table_parts import TableParts

_BYTES = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2}
#: Bytes of optimizer state per parameter (kept in float32): AdamW's two moments, SGD momentum.
OPTIMIZER_BYTES = {"adamw": 8, "adam": 8, "sgd": 0, "sgd-momentum": 4, "none": 0}
ATTENTIONS = ("naive", "flash", "linear")
MLPS = {"gelu": 2, "swiglu": 3}
#: FLOPs per element: softmax (max, subtract, exp, sum, divide), a norm, an activation.
SOFTMAX_FLOPS, NORM_FLOPS, ACT_FLOPS = 5, 8, 8
#: Score-sized tensors the naive attention keeps per head for backward (the probabilities P).
NAIVE_SCORE_COPIES = 1
#: Tile of the tiled backend whose scores exist at once (per batch·head).
FLASH_TILE = (128, 128)
_UNITS = {
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def parse_bytes(text: str | int | float, name: str = "budget") -> int:
    """Parses a memory size: ``"12GB"`` (10⁹ B), ``"12GiB"`` (2³⁰ B), ``"512 MB"``, or a number.

    Raises:
        ValueError: naming ``name``, the expected form and the received value.
    """
    if isinstance(text, bool):
        raise TypeError(f"{name} must be a size such as '12GB' or a number, got {text!r}")
    if isinstance(text, (int, float)):
        value = float(text)
    elif isinstance(text, str):
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*", text)
        unit = m.group(2).lower() if m else ""
        if not m or (unit and unit not in _UNITS):
            raise ValueError(
                f"{name} must be a size such as '12GB', '12GiB' or '512MB' (units "
                "B/KB/MB/GB/TB/KiB/MiB/GiB/TiB), "
                f"got {text!r}"
            )
        value = float(m.group(1)) * _UNITS[unit or "b"]
    else:
        raise TypeError(f"{name} must be a size such as '12GB' or a number, got {text!r}")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a positive size, got {text!r}")
    return int(value)


def _choice(name: str, value: object, choices) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {sorted(choices)}, got {value!r}")


@dataclass
class ModelCost:
    """Costs of a whole model (or one layer with ``n_layers=1, vocab_size=0``).

    Attributes:
        config: the resolved configuration.
        params: number of parameters.
        flops: ``{"forward", "backward", "step", "elementwise forward"}`` matmul FLOPs (``step`` =
            forward + backward when training, forward for inference).
        memory: bytes by component (weights, gradients, optimizer state, master weights,
            activations, logits, transient, KV cache) and "total".
        per_layer: matmul FLOPs of one layer's forward by part (qkv, out, mlp, attention core).
    """

    config: dict
    params: int
    flops: dict[str, float] = field(default_factory=dict)
    memory: dict[str, float] = field(default_factory=dict)
    per_layer: dict[str, float] = field(default_factory=dict)

    def table(self) -> str:
        """The costs as an aligned text table."""
        return self.table_parts().text()

    def table_parts(self) -> TableParts:
        """The table of `table` as data: parameters, then each FLOP count and memory part."""
        from .estimate import _fmt

        rows = [["parameters", f"{self.params:,}"]]
        rows += [
            [f"{k} FLOPs" + ("" if k.startswith("elementwise") else " (matmul)"), _fmt(v, "FLOPs")]
            for k, v in self.flops.items()
        ]
        rows += [[f"memory: {k}", _fmt(v, "bytes")] for k, v in self.memory.items()]
        return TableParts(["quantity", "value"], rows, "<<")


def model_cost(
    seq_len: int,
    *,
    d_model: int = 768,
    n_layers: int = 12,
    n_heads: int = 12,
    kv_heads: int | None = None,
    d_ff: int | None = None,
    vocab_size: int = 0,
    batch: int = 1,
    train: bool = True,
    dtype: str = "float32",
    optimizer: str = "adamw",
    attention: str = "naive",
    mlp: str = "gelu",
    bias: bool = True,
    tie_embeddings: bool = True,
    learned_positions: int = 0,
    mask: Mask | None = None,
    decode_cache: int = 0,
) -> ModelCost:
    """Parameters, matmul FLOPs and memory of a pre-LN Transformer for training or inference.

    ``memory_train = N_params·(b_w + b_g + b_opt + b_master) + layers·A_layer + logits``, with
    b_w = b_g = bytes of ``dtype``, b_opt from `OPTIMIZER_BYTES` (AdamW: two float32 moments,
    8 B), and b_master = 4 B when ``dtype`` is 16-bit (mixed precision keeps float32 master weights;
    so AdamW mixed precision costs the classic 2 + 2 + 8 + 4 = 16 B per parameter).
    ``A_layer`` (elements, times the bytes of ``dtype``; norm statistics and the log-sum-exp in
    float32)::

        B·L·(5·E + 2·F·(m-1) + (H + 2·H_kv)·D)   the inputs of the norms, matmuls and activation
        + B·H·L·S · NAIVE_SCORE_COPIES             naive: the probabilities P
        + B·H·L·(D + 1)                            flash: the output O and the log-sum-exp
        + B·H·D·D                                  linear: the state φ(K)ᵀV

    A training step's peak adds the backward transient of one layer (naive: the gradients dP, dS
    of its scores, ``2·B·H·L·S`` elements; tiled: of one tile). The model counts what a backward
    must keep, so a real run keeps at least this much: attnlab's own blocks keep copies on top
    (heads-first q, k, v; the reference backend three L×S tensors per head); measured:
    docs/results, the lower bound checked by tests/test_costs.py.

    ``memory_infer = N_params·b_w + one layer's live tensors + logits (+ KV cache)``, the live
    tensors being ``B·L·(2·E + (H + 2·H_kv)·D + F·(m-1))`` elements plus the naive form's scores
    and probabilities (``2·B·H·L·S``) or one float32 tile per head.

    Args:
        seq_len: L (tokens per sequence). d_model: E. n_layers: layers. n_heads: H.
        kv_heads: H_kv (default H). d_ff: F (default 4·E for GELU, 8·E/3 rounded to 8 for SwiGLU).
        vocab_size: V of the token embedding and output head (0 = no embedding/head: blocks only).
        batch: B. train: training (forward + backward + optimizer) or inference (forward).
        dtype: "float32", "float16", "bfloat16" or "float64" (16-bit training = mixed precision).
        optimizer: a key of `OPTIMIZER_BYTES` (training only).
        attention: "naive" (L×S scores kept), "flash" (tiled) or "linear".
        mlp: "gelu" (two matrices) or "swiglu" (three).
        bias: biases in the linear layers and norms. tie_embeddings: the head shares the embedding.
        learned_positions: rows of a learned position table (BERT: max(512, L)); 0 = none.
        mask: any `attnlab.masks.Mask`: the tiled form's FLOPs count only the pairs it attends
            over the ``(B, H)`` grid (`Mask.attended_pairs`; ``masks.causal()``: L·(L+1)/2 per
            head); the naive form computes every score whatever the mask.
        decode_cache: inference with a KV cache of this many tokens (memory only).

    Returns:
        A `ModelCost`.
    """
    L = check_int("seq_len", seq_len, minimum=1)
    E = check_int("d_model", d_model, minimum=1)
    n_layers = check_int("n_layers", n_layers, minimum=0)
    H = check_int("n_heads", n_heads, minimum=1)
    H_kv = H if kv_heads is None else check_int("kv_heads", kv_heads, minimum=1)
    V = check_int("vocab_size", vocab_size, minimum=0)
    B = check_int("batch", batch, minimum=1)
    P_pos = check_int("learned_positions", learned_positions, minimum=0)
    cache = check_int("decode_cache", decode_cache, minimum=0)
    _choice("dtype", dtype, _BYTES)
    _choice("optimizer", optimizer, OPTIMIZER_BYTES)
    _choice("attention", attention, ATTENTIONS)
    _choice("mlp", mlp, MLPS)
    if E % H:
        raise ValueError(f"d_model={E} must be divisible by n_heads={H}")
    if H % H_kv:
        raise ValueError(f"n_heads={H} must be divisible by kv_heads={H_kv}")
    if d_ff is None:
        F = 4 * E if mlp == "gelu" else max(8, 8 * round(8 * E / 3 / 8))
    else:
        F = check_int("d_ff", d_ff, minimum=1)
    D, nb, m = E // H, _BYTES[dtype], MLPS[mlp]
    S = L
    pairs = L * S
    if mask is not None and not isinstance(mask, Mask):
        raise TypeError(f"mask must be an attnlab Mask or None, got {type(mask).__name__}")
    if mask is not None and attention == "flash":  # per head of one item: the grid, averaged
        total = mask.attended_pairs(L, S, batch=B, heads=H)
        pairs = total // (B * H) if total % (B * H) == 0 else total / (B * H)

    # Parameters.
    attn_p = E * (H + 2 * H_kv) * D + H * D * E + ((H + 2 * H_kv) * D + E if bias else 0)
    mlp_p = m * E * F + ((m - 1) * F + E if bias else 0)
    norm_p = (2 if bias else 1) * E
    layer_p = attn_p + mlp_p + 2 * norm_p
    emb_p = V * E + P_pos * E
    head_p = 0 if (tie_embeddings or V == 0) else V * E
    params = n_layers * layer_p + emb_p + head_p + (norm_p if n_layers else 0)

    # Matmul FLOPs of one layer's forward (what FlopCounterMode counts).
    per_layer = {
        "qkv projections": 2 * B * L * E * (H + 2 * H_kv) * D,
        "output projection": 2 * B * L * H * D * E,
        "mlp": 2 * B * L * E * F * m,
    }
    if attention == "linear":
        per_layer["attention core"] = 4 * B * H * L * D * D
    else:
        per_layer["attention core"] = 4 * B * H * pairs * D
    fwd = n_layers * sum(per_layer.values()) + (2 * B * L * E * V)
    elementwise = n_layers * (
        SOFTMAX_FLOPS * B * H * (pairs if attention != "linear" else 0)
        + 2 * NORM_FLOPS * B * L * E
        + ACT_FLOPS * B * L * F
    )
    flops = {"forward": float(fwd)}
    if train:
        flops["backward"] = 2.0 * fwd
    flops["step"] = 3.0 * fwd if train else float(fwd)
    flops["elementwise forward"] = float(elementwise)

    # Activations.
    kept_main = B * L * (5 * E + 2 * F * (m - 1) + (H + 2 * H_kv) * D) * nb
    kept_main += 2 * 2 * B * L * 4  # norm statistics (mean, rstd) of two norms, float32
    core = {
        "naive": B * H * L * S * NAIVE_SCORE_COPIES * nb,
        "flash": B * H * L * D * nb + B * H * L * 4,
        "linear": B * H * D * D * 4,
    }[attention]
    layer_act = kept_main + core
    logits = B * L * V * (nb + 4) if V else 0  # logits and the float32 log-softmax

    memory: dict[str, float] = {"weights": float(params * nb)}
    if train:
        master = 4 if nb < 4 else 0
        memory["gradients"] = float(params * nb)
        memory["optimizer state"] = float(params * OPTIMIZER_BYTES[optimizer])
        memory["master weights"] = float(params * master)
        memory["activations"] = float(n_layers * layer_act)
        memory["logits"] = float(logits)
        # The backward of one layer at a time: the gradients of its scores (dP and dS) for the
        # naive form, of one tile for the tiled one, plus the gradient of the MLP hidden.
        grads = {
            "naive": 2 * B * H * L * S * nb,
            "flash": 2 * B * H * FLASH_TILE[0] * FLASH_TILE[1] * 4,
            "linear": 2 * B * H * D * D * 4,
        }[attention]
        memory["backward transient (one layer)"] = float(
            grads + B * L * F * (m - 1) * nb if n_layers else 0
        )
    else:
        live_scores = {  # naive: the scores and their softmax exist together
            "naive": 2 * B * H * L * S * nb,
            "flash": B * H * FLASH_TILE[0] * FLASH_TILE[1] * 4,
            "linear": B * H * D * D * 4,
        }[attention]
        live = B * L * (2 * E + (H + 2 * H_kv) * D + F * (m - 1)) * nb + live_scores
        memory["transient (one layer)"] = float(live if n_layers else 0)
        memory["logits"] = float(B * L * V * nb)
        if cache:
            memory["KV cache"] = float(n_layers * 2 * B * H_kv * cache * D * nb)
    memory["total"] = float(sum(memory.values()))
    cfg = dict(
        B=B,
        L=L,
        E=E,
        H=H,
        H_kv=H_kv,
        D=D,
        F=F,
        V=V,
        layers=n_layers,
        dtype=dtype,
        train=train,
        optimizer=optimizer if train else None,
        attention=attention,
        mlp=mlp,
    )
    return ModelCost(cfg, params, flops, memory, {k: float(v) for k, v in per_layer.items()})


def max_seq_len(budget: str | int | float, *, limit: int = 2**31, **kwargs) -> int:
    """The largest L with ``model_cost(L, **kwargs).memory["total"] <= budget`` (0 if none fits).

    The total memory is non-decreasing in L, so a doubling search then a bisection finds the
    boundary exactly: ``total(L*) <= budget < total(L* + 1)`` (or L* = ``limit``).

    Args:
        budget: bytes, or a size string such as ``"12GB"`` / ``"12GiB"`` (see `parse_bytes`).
        limit: the largest L considered.
        **kwargs: the other arguments of `model_cost` (model, batch, precision, train/infer).
    """
    cap = parse_bytes(budget)
    check_int("limit", limit, minimum=1)

    def fits(n: int) -> bool:
        return model_cost(n, **kwargs).memory["total"] <= cap

    if not fits(1):
        return 0
    lo, hi = 1, 2
    while hi <= limit and fits(hi):
        lo, hi = hi, hi * 2
    if hi > limit:
        if fits(limit):
            return limit
        hi = limit
    while hi - lo > 1:  # fits(lo) and not fits(hi)
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def complexity_table(n: int, d: int, *, kernel: int = 3, window: int | None = None) -> list[dict]:
    """The per-layer cost table of Vaswani et al. (2017, Table 1), with its numbers at (n, d).

    ===========================  ===============  ==========  ================  =============
    layer type                   ops per layer    sequential  max path length   extra memory
    ===========================  ===============  ==========  ================  =============
    self-attention               n²·d             O(1)        O(1)              n² (weights)
    recurrent                    n·d²             O(n)        O(n)              d (state)
    convolutional (kernel k)     k·n·d²           O(1)        O(log_k n)        k·d (window)
    self-attention (window r)    r·n·d            O(1)        O(n/r)            r·n (weights)
    ===========================  ===============  ==========  ================  =============

    "Extra memory" is what a layer holds beside its n·d inputs and outputs in a forward pass (seed
    000's table: O(n²) for self-attention, O(d) for an RNN); training keeps more (`model_cost`).

    Args:
        n: sequence length. d: representation dimension. kernel: k. window: r (default √n).

    Returns:
        One dict per row: ``layer``, ``complexity`` (formula), ``ops`` (its value),
        ``sequential`` and ``path`` (as numbers at this n), ``memory`` (formula) and
        ``memory_elements`` (its value).
    """
    n = check_int("n", n, minimum=1)
    d = check_int("d", d, minimum=1)
    k = check_int("kernel", kernel, minimum=2)
    r = max(1, math.isqrt(n)) if window is None else check_int("window", window, minimum=1)
    return [
        dict(
            layer="self-attention", complexity="n²·d", ops=n * n * d, sequential=1, path=1,
            memory="n²", memory_elements=n * n,
        ),
        dict(
            layer="recurrent", complexity="n·d²", ops=n * d * d, sequential=n, path=n,
            memory="d", memory_elements=d,
        ),
        dict(
            layer=f"convolutional (k={k})", complexity="k·n·d²", ops=k * n * d * d, sequential=1,
            path=max(1, math.ceil(math.log(n, k))) if n > 1 else 1,
            memory="k·d", memory_elements=k * d,
        ),
        dict(
            layer=f"self-attention (window r={r})", complexity="r·n·d", ops=r * n * d,
            sequential=1, path=math.ceil(n / r), memory="r·n", memory_elements=r * n,
        ),
    ]  # fmt: skip


def io_naive(n: int, d: int) -> int:
    """Slow-memory (HBM/DRAM) element reads + writes of standard attention: Θ(N·d + N²).

    ``read Q, K (2Nd) + write S (N²) + read S, write P (2N²) + read P, V (N² + Nd) + write O (Nd)``
    = ``4·N·d + 4·N²``.
    """
    n, d = check_int("n", n, minimum=1), check_int("d", d, minimum=1)
    return 4 * n * d + 4 * n * n


def io_tiled(n: int, d: int, sram: int, block: int | None = None) -> int:
    """Slow-memory element reads + writes of tiled (flash) attention: Θ(N²·d²/M) for B = Θ(M/d).

    FlashAttention's loop (Dao et al. 2022, Algorithm 1): key/value blocks of ``B_c = block``
    rows (default ``⌊M/(4d)⌋``: K_j, V_j, Q_i, O_i of B·d elements fill the fast memory of M
    elements) in the outer loop; query blocks of ``B_r = min(B_c, d)`` rows inside. Each K_j, V_j is
    read once (2Nd); each of the ``T_c = ⌈N/B_c⌉`` outer steps reads Q_i, O_i, ℓ_i, m_i and writes
    O_i, ℓ_i, m_i for every query block, ``3Nd + 4N``::

        IO = 2·N·d + ⌈N/B_c⌉·(3·N·d + 4·N)  ≈ 12·N²·d²/M   (B_c = M/(4d))

    so IO ∝ M⁻¹. Exercise 8.6's B = √(M/d) gives ``T_c = N/√(M/d)``, IO ∝ N²·d^1.5/√M instead.

    Args:
        n: N. d: head dim. sram: M, fast-memory size in elements. block: B_c (default M/(4d)).
    """
    n, d, sram = (
        check_int("n", n, minimum=1),
        check_int("d", d, minimum=1),
        check_int("sram", sram, minimum=1),
    )
    bc = sram // (4 * d) if block is None else check_int("block", block, minimum=1)
    if bc < 1:
        raise ValueError(f"sram must hold at least 4·d = {4 * d} elements, got {sram}")
    return 2 * n * d + math.ceil(n / bc) * (3 * n * d + 4 * n)


def complexity_text(n: int, d: int, **kwargs) -> str:
    """`complexity_table` as an aligned text table."""
    return complexity_parts(n, d, **kwargs).text()


def complexity_parts(n: int, d: int, **kwargs) -> TableParts:
    """The table of `complexity_text` as data (arguments: `complexity_table`'s)."""
    rows = [
        [
            r["layer"],
            r["complexity"],
            f"{r['ops']:,}",
            f"{r['sequential']:,}",
            f"{r['path']:,}",
            f"{r['memory']} = {r['memory_elements']:,}",
        ]
        for r in complexity_table(n, d, **kwargs)
    ]
    header = [
        "layer type",
        "ops per layer",
        f"at n={n}, d={d}",
        "sequential ops",
        "max path length",
        "extra memory",
    ]
    return TableParts(header, rows, "<" * len(header))
