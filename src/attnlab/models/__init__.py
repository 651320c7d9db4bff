"""Models built from attnlab parts: a config, blocks, a GPT-style LM and a bidirectional encoder.

Example:
    >>> from attnlab.models import GPT, TransformerConfig
    >>> cfg = TransformerConfig(vocab_size=65, d_model=128, n_layers=4, n_heads=4, n_kv_heads=2)
    >>> model = GPT(cfg)
    >>> out = model.generate(torch.zeros(1, 1, dtype=torch.long), 100, top_k=10)
"""

from .bert import BertConfig, BertEncoder, BertOutput
from .blocks import MLPS, NORMS, GeluMLP, RMSNorm, SwiGLU, TransformerBlock
from .classifier import AttentionPooling, ClassifierConfig, TextClassifier
from .config import TransformerConfig, interleaved_layer_types
from .encoder import Encoder
from .gpt import GPT
from .minilm import MiniLM, minilm
from .rnn import RNNLM, RNNLMConfig, RNNSeq2Seq, RNNSeq2SeqConfig, build_rnn_lm, build_rnn_seq2seq
from .seq2seq import Seq2SeqConfig, Seq2SeqTransformer, build_seq2seq_transformer
from .vit import VisionTransformer, ViTConfig

__all__ = [
    "GPT",
    "MLPS",
    "NORMS",
    "RNNLM",
    "AttentionPooling",
    "BertConfig",
    "BertEncoder",
    "BertOutput",
    "ClassifierConfig",
    "Encoder",
    "GeluMLP",
    "MiniLM",
    "RMSNorm",
    "RNNLMConfig",
    "RNNSeq2Seq",
    "RNNSeq2SeqConfig",
    "Seq2SeqConfig",
    "Seq2SeqTransformer",
    "SwiGLU",
    "TextClassifier",
    "TransformerBlock",
    "TransformerConfig",
    "ViTConfig",
    "VisionTransformer",
    "build_rnn_lm",
    "build_rnn_seq2seq",
    "build_seq2seq_transformer",
    "interleaved_layer_types",
    "minilm",
]
