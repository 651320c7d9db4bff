"""Parameters, FLOPs and memory of multi-head attention, for the naive, tiled and linear forms.

The counts follow the shapes exactly: the score-related terms use the number of (query, key) pairs
a mask actually attends (`Mask.attended_pairs`), never a dense or "÷2" rule. A matmul of
``(m × k)·(k × n)`` costs ``2·m·k·n`` FLOPs; softmax costs ``5`` FLOPs per element it touches
(max, subtract, exp, sum, divide).

This module counts the attention layer alone; `attnlab.analysis.costs` counts whole layers and
models (projections, MLP, norms, optimizer state) for training and inference, solves for the
largest length that fits a memory budget, and holds the RNN vs self-attention table and the IO
model of tiled attention; `attnlab.analysis.advise` turns those numbers into a recommendation.

Example:
    >>> est = estimate(1024, 768, 12, batch=32, dtype="float16")
    >>> est.value("score matrix", "naive") / 2**20
    768.0
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import torch

from .._shapes import check_int
from ..masks import Mask
from ..masks import causal as _causal
from ..masks import sliding_window as _sliding_window
from ..masks.patterns import with_causal
from .table_parts import TableParts

IMPLEMENTATIONS = ("naive", "flash", "linear")
_BYTES = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2}
SOFTMAX_FLOPS_PER_ELEMENT = 5
# Tile of the tiled backend whose scores exist at one time (per batch·head): block_q × block_k.
FLASH_TILE = (128, 128)


@dataclass
class Estimate:
    """A table of quantities × implementations.

    ``print(est)`` shows the configuration and the table (`table`); ``repr(est)`` is one line.

    Attributes:
        config: the resolved configuration (B, L, S, E, H, H_kv, D, layers, dtype, pairs).
        rows: ``[(quantity, unit, {implementation: value})]`` in display order.
        measured: optional measured values, ``{implementation: {"seconds", "peak_bytes"}}``.
    """

    config: dict
    rows: list[tuple[str, str, dict[str, float]]] = field(default_factory=list)
    measured: dict[str, dict[str, float]] = field(default_factory=dict)

    def value(self, quantity: str, implementation: str) -> float:
        """The value of one quantity for one implementation."""
        for q, _, values in self.rows:
            if q == quantity:
                return values[implementation]
        raise KeyError(f"no quantity {quantity!r}; known: {[r[0] for r in self.rows]}")

    def table(self) -> str:
        """The estimate as an aligned text table (and measurements, if any)."""
        return self.table_parts().text()

    def table_parts(self) -> TableParts:
        """The table of `table` as data: a row per quantity (and measurement), a column per
        implementation, each value with its unit (``"1.50 GiB"``, ``"3.221 GFLOP"``)."""
        impls = list(self.rows[0][2]) if self.rows else []
        lines = [["quantity", *impls]]
        for q, unit, values in self.rows:
            lines.append([q, *(_fmt(values[i], unit) for i in impls)])
        for key, label in (("seconds", "measured time"), ("peak_bytes", "measured peak memory")):
            if self.measured:
                unit = "s" if key == "seconds" else "bytes"
                lines.append(
                    [
                        label,
                        *(
                            _fmt(self.measured[i][key], unit) if i in self.measured else "—"
                            for i in impls
                        ),
                    ]
                )
        return TableParts(lines[0], lines[1:], "<" * len(lines[0]))

    def _config_line(self) -> str:
        """The configuration in one line: ``"B=32, L=1024, S=1024, E=768, H=12, ..."``."""
        c = self.config
        sizes = [f"{k}={c[k]}" for k in ("B", "L", "S", "E", "H", "H_kv", "D", "layers") if k in c]
        mask = "none" if c.get("mask") is None else repr(c["mask"])
        decode = ["decode (one new query token)"] if c.get("decode") else []
        return ", ".join([*sizes, str(c.get("dtype", "?")), f"mask {mask}", *decode])

    def __str__(self) -> str:
        return f"Estimate of multi-head attention: {self._config_line()}\n{self.table()}"

    def __repr__(self) -> str:
        measured = f", measured={sorted(self.measured)}" if self.measured else ""
        return f"Estimate({self._config_line()}; {len(self.rows)} quantities{measured})"


def _fmt(x: float, unit: str) -> str:
    if unit == "bytes":
        for name, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
            if x >= size:
                return f"{x / size:,.2f} {name}"
        return f"{x:,.0f} B"
    if unit == "FLOPs":
        for name, size in (("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6)):
            if x >= size:
                return f"{x / size:,.3f} {name}"
        return f"{x:,.0f} FLOP"
    if unit == "s":
        return f"{x * 1e3:,.2f} ms"
    return f"{x:,.0f}"


def estimate(
    seq_len: int,
    d_model: int,
    num_heads: int,
    batch: int = 1,
    layers: int = 1,
    dtype: str = "float32",
    *,
    kv_heads: int | None = None,
    key_len: int | None = None,
    mask: Mask | None = None,
    decode: bool = False,
    bias: bool = True,
    causal: bool | None = None,
    window: int | None = None,
) -> Estimate:
    """Estimates parameters, FLOPs and memory of multi-head attention layers.

    Args:
        seq_len: L, the sequence length (with ``decode``, the context length after the new token).
        d_model: E. num_heads: H (``E % H == 0``, head dim ``D = E / H``).
        batch: B. layers: number of attention layers.
        dtype: "float32", "float16", "bfloat16" or "float64".
        kv_heads: H_kv for grouped-query attention (default H).
        key_len: S for cross-attention (default L).
        mask: any `attnlab.masks.Mask` (``masks.causal()``, ``masks.sliding_window(w)``, …);
            the score terms count exactly the pairs it attends over the ``(B, H)`` grid
            (`Mask.attended_pairs`; a mask that depends on the batch or the head must have
            ``batch`` items or ``num_heads`` heads).
        decode: one new query token attending to ``seq_len`` cached keys (a KV cache; causal).
        bias: whether the projections have biases.
        causal: deprecated, use ``mask=masks.causal()``.
        window: deprecated, use ``mask=masks.sliding_window(window)``.

    Returns:
        An `Estimate`; ``print(est)`` shows it. Rows are totals over ``layers``, except
        "attended pairs per head" (one head of one layer) and "score matrix" (the layers run one
        after another, so one layer's scores exist at a time).
    """
    L = check_int("seq_len", seq_len, minimum=0)
    E = check_int("d_model", d_model, minimum=1)
    H = check_int("num_heads", num_heads, minimum=1)
    B = check_int("batch", batch, minimum=1)
    layers = check_int("layers", layers, minimum=1)
    if E % H:
        raise ValueError(f"d_model={E} must be divisible by num_heads={H}")
    H_kv = H if kv_heads is None else check_int("kv_heads", kv_heads, minimum=1)
    if H % H_kv:
        raise ValueError(f"num_heads={H} must be divisible by kv_heads={H_kv}")
    if dtype not in _BYTES:
        raise ValueError(f"dtype must be one of {sorted(_BYTES)}, got {dtype!r}")
    S = L if key_len is None else check_int("key_len", key_len, minimum=0)
    Lq = 1 if decode else L
    D, nb = E // H, _BYTES[dtype]
    if mask is not None and not isinstance(mask, Mask):
        raise TypeError(f"mask must be an attnlab Mask or None, got {type(mask).__name__}")
    m = with_causal(mask, causal, where="estimate")
    if window is not None:
        warnings.warn(
            "estimate(window=...) is deprecated: pass mask=masks.sliding_window(window)",
            DeprecationWarning,
            stacklevel=2,
        )
        w = _sliding_window(check_int("window", window, minimum=1))
        m = w if m is None else m & w
    if decode:
        m = _causal() if m is None else _causal() & m
    dense = Lq * S
    pairs = dense
    if m is not None:  # per head of one batch item: the (B, H) grid's count, averaged
        total = m.attended_pairs(Lq, S, batch=B, heads=H)
        pairs = total // (B * H) if total % (B * H) == 0 else total / (B * H)
    cfg = {
        "B": B,
        "L": Lq,
        "S": S,
        "E": E,
        "H": H,
        "H_kv": H_kv,
        "D": D,
        "layers": layers,
        "dtype": dtype,
        "attended_pairs": pairs,
        "dense_pairs": dense,
        "decode": decode,
        "mask": m,
    }

    n_params = E * H * D + 2 * E * H_kv * D + H * D * E
    n_bias = (H * D + 2 * H_kv * D + E) if bias else 0
    qkv_rows = B * Lq  # tokens projected this call (decode: only the new one)
    proj = 2 * qkv_rows * E * (H + 2 * H_kv) * D + 2 * qkv_rows * H * D * E
    scores = {"naive": 2 * B * H * dense * D, "flash": 2 * B * H * pairs * D}
    softmax = {
        "naive": SOFTMAX_FLOPS_PER_ELEMENT * B * H * dense,
        "flash": SOFTMAX_FLOPS_PER_ELEMENT * B * H * pairs,
    }
    weighted = {"naive": 2 * B * H * dense * D, "flash": 2 * B * H * pairs * D}
    # Linear attention φ(Q)(φ(K)ᵀV): the state φ(K)ᵀV (D×D) and normaliser Σφ(K) replace scores.
    scores["linear"] = 2 * B * H * S * D * D + 2 * B * H * S * D  # state and normaliser
    softmax["linear"] = 2 * B * H * (Lq + S) * D  # feature map elu(x)+1
    weighted["linear"] = 2 * B * H * Lq * D * D + 2 * B * H * Lq * D  # φ(Q)·state, φ(Q)·norm

    qkv_bytes = (B * Lq * H * D + 2 * B * S * H_kv * D) * nb
    out_bytes = B * Lq * H * D * nb
    score_mem = {
        "naive": B * H * dense * nb,
        "flash": B * H * FLASH_TILE[0] * FLASH_TILE[1] * 4,
        "linear": B * H * D * D * 4,
    }
    kept = {  # activations kept for backward by the attention core
        "naive": qkv_bytes + out_bytes + B * H * dense * nb,  # + the probabilities P
        "flash": qkv_bytes + out_bytes + B * H * Lq * 4,  # + the log-sum-exp
        "linear": qkv_bytes + out_bytes + B * H * D * D * 4,  # + the state
    }
    est = Estimate(cfg)

    def row(
        name: str, unit: str, per_layer: dict[str, float] | float, *, summed: bool = True
    ) -> None:
        """Appends a row; ``summed`` rows add up over the layers, the others are one layer's."""
        values = (
            per_layer if isinstance(per_layer, dict) else dict.fromkeys(IMPLEMENTATIONS, per_layer)
        )
        n = layers if summed else 1
        est.rows.append((name, unit, {i: n * values[i] for i in IMPLEMENTATIONS}))

    row("projection weights", "params", n_params)
    row("projection weights + biases", "params", n_params + n_bias)
    row("parameter memory", "bytes", (n_params + n_bias) * nb)
    # Pairs of one head of one layer (what the name says): never multiplied by the layers.
    row(
        "attended pairs per head",
        "pairs",
        {"naive": dense, "flash": pairs, "linear": Lq * S},
        summed=False,
    )
    row("QKV + output projections", "FLOPs", proj)
    row("scores QKᵀ", "FLOPs", scores)
    row("softmax", "FLOPs", softmax)
    row("weighted sum PV", "FLOPs", weighted)
    row("total", "FLOPs", {i: proj + scores[i] + softmax[i] + weighted[i] for i in IMPLEMENTATIONS})
    row("score matrix", "bytes", score_mem, summed=False)  # one layer's at a time (transient)
    row("activations kept for backward", "bytes", kept)
    if decode:
        row("KV cache", "bytes", 2 * B * H_kv * S * D * nb)
    return est


def measure_estimate(
    est: Estimate,
    implementations: tuple[str, ...] = IMPLEMENTATIONS,
    *,
    device: torch.device | str | None = None,
) -> Estimate:
    """Runs the configuration (one layer, forward + backward) and records time and peak memory.

    Inputs are drawn on the CPU generator and moved to ``device`` (default cpu). Peak memory is
    the process's resident-set growth on cpu and ``torch.cuda.max_memory_allocated`` growth on
    cuda.
    """
    from ..functional import attention, backends
    from .measure import measure

    device = torch.device("cpu" if device is None else device)

    c = est.config
    dtype = getattr(torch, c["dtype"])
    B, L, S, H, H_kv, D = c["B"], c["L"], c["S"], c["H"], c["H_kv"], c["D"]
    mask = c["mask"]
    for impl in implementations:
        if impl == "linear":
            try:
                from ..functional.linear import linear_attention
            except ImportError:
                continue
        elif impl == "flash" and "flash" not in backends():
            continue

        def make():
            g = torch.Generator().manual_seed(0)
            return [
                torch.randn(B, n, t, D, generator=g, dtype=dtype).to(device).requires_grad_()
                for n, t in ((H, L), (H_kv, S), (H_kv, S))
            ]

        def run(impl=impl):
            q, k, v = make()
            if impl == "linear":
                out = linear_attention(
                    q, k.repeat_interleave(H // H_kv, 1), v.repeat_interleave(H // H_kv, 1)
                )
            else:
                out = attention(
                    q, k, v, mask=mask, backend="reference" if impl == "naive" else "flash"
                )
            out.sum().backward()

        run()  # warm-up
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            before = torch.cuda.memory_allocated(device)
            _, seconds, _ = measure(lambda: (run(), torch.cuda.synchronize(device)))
            peak = torch.cuda.max_memory_allocated(device) - before
        else:
            _, seconds, peak = measure(run)
        est.measured[impl] = {"seconds": seconds, "peak_bytes": float(peak)}
    return est


def cache_bytes_per_token(
    num_heads: int,
    *,
    kv_lora_rank: int,
    qk_rope_head_dim: int,
    qk_nope_head_dim: int,
    v_head_dim: int,
    dtype: str = "float32",
) -> dict[str, int]:
    """Bytes cached per token and layer: multi-head latent attention against a per-head K/V cache.

    MLA (DeepSeek-V2/V3, `attnlab.modules.LatentCache`) keeps the latent and the shared rotary
    key, ``(C + R) · b``; a per-head cache of the same attention keeps every head's key and value,
    ``H · (Dn + R + Dv) · b`` (b = bytes of ``dtype``). DeepSeek-V3 (H = 128, C = 512, R = 64,
    Dn = Dv = 128) in bfloat16: 1,152 against 81,920 bytes, 71× less.

    Returns:
        ``{"latent": ..., "per-head K/V": ...}`` in bytes.
    """
    H = check_int("num_heads", num_heads, minimum=1)
    C = check_int("kv_lora_rank", kv_lora_rank, minimum=1)
    R = check_int("qk_rope_head_dim", qk_rope_head_dim, minimum=0)
    Dn = check_int("qk_nope_head_dim", qk_nope_head_dim, minimum=0)
    Dv = check_int("v_head_dim", v_head_dim, minimum=1)
    if dtype not in _BYTES:
        raise ValueError(f"dtype must be one of {sorted(_BYTES)}, got {dtype!r}")
    nb = _BYTES[dtype]
    return {"latent": (C + R) * nb, "per-head K/V": H * (Dn + R + Dv) * nb}
