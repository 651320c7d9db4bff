"""English titles of the source texts' section headings, for the rendered claims.

The claims keep each heading as the text has it (``Claim.section``); `english` gives the heading
in English (translated by hand, faithfully; numbering kept) for ``attnlab textbook``'s output,
which prints both. A heading without Chinese characters is its own English title.
"""

from __future__ import annotations

import re

#: Original section heading -> its English title.
SECTIONS_EN = {
    "1. 稀疏注意力(Sparse Attention)": "1. Sparse attention",
    "1. 背景介绍": "1. Background",
    "1.1 什么是自注意力？": "1.1 What is self-attention?",
    "1.2 数学定义": "1.2 Mathematical definition",
    "2. 线性注意力(Linear Attention)": "2. Linear attention",
    "2.2 自注意力机制的特点": "2.2 Characteristics of self-attention",
    "2.2 计算复杂度分析": "2.2 Analysis of the computational complexity",
    "2.3 并行化能力": "2.3 Parallelism",
    "3. 内存优化": "3. Memory optimization",
    "3.1 自注意力计算过程": "3.1 How self-attention is computed",
    "3.1 问题分析": "3.1 Analysis of the problem",
    "3.2 位置编码的作用": "3.2 The role of positional encoding",
    "3.2 自注意力机制的优化": "3.2 Optimizing self-attention",
    "3.3 正弦余弦位置编码": "3.3 Sine–cosine positional encoding",
    "3.4 位置编码的几何解释": "3.4 A geometric interpretation of positional encoding",
    "4.1 步骤分解": "4.1 Step by step",
    "4.2 注意力矩阵的含义": "4.2 What the attention matrix means",
    "4.3 自注意力机制的优化": "4.3 Optimizing self-attention",
    "5. 项目实践：代码实例和详细解释说明": "5. Practice: code examples with detailed explanations",
    "5.1 优势": "5.1 Advantages",
    "5.2 局限性": "5.2 Limitations",
    "6. 实际应用场景": "6. Practical applications",
    "6.1 序列长度的影响": "6.1 The effect of sequence length",
    "6.2 特征维度的选择": "6.2 Choosing the feature dimension",
    "6.3 位置编码的选择": "6.3 Choosing the positional encoding",
    "7.2 softmax的梯度特性": "7.2 The gradient of softmax",
    "8.1.1 从序列到序列的映射": "8.1.1 The mapping from sequence to sequence",
    "8.1.2 注意力分数的计算": "8.1.2 Computing the attention scores",
    "8.1.3 缩放点积注意力": "8.1.3 Scaled dot-product attention",
    "8.1.4 注意力的概率解释": "8.1.4 A probabilistic interpretation of attention",
    "8.2.1 为什么需要位置信息": "8.2.1 Why position information is needed",
    "8.2.2 正弦位置编码": "8.2.2 Sinusoidal positional encoding",
    "8.2.3 可学习位置编码": "8.2.3 Learned positional encoding",
    "8.2.4 相对位置编码": "8.2.4 Relative positional encoding",
    "8.3.1 投影与子空间": "8.3.1 Projections and subspaces",
    "8.3.2 多头机制的动机": "8.3.2 The motivation for multiple heads",
    "8.3.3 参数共享与效率": "8.3.3 Parameter sharing and efficiency",
    "8.3.4 头之间的相互作用": "8.3.4 Interactions between heads",
    "8.4.1 时间复杂度": "8.4.1 Time complexity",
    "8.4.2 空间复杂度": "8.4.2 Space complexity",
    "8.4.3 并行化优势": "8.4.3 The advantage of parallelism",
    "8.4.4 长序列的挑战": "8.4.4 The challenge of long sequences",
    "8.5 历史人物": "8.5 Historical figures",
    "8.6 Flash Attention与长上下文优化": "8.6 Flash Attention and long-context optimization",
    "8.7 本章小结": "8.7 Chapter summary",
    "8.8 练习8.1": "8.8 Exercise 8.1",
    "8.8 练习8.2": "8.8 Exercise 8.2",
    "8.8 练习8.3": "8.8 Exercise 8.3",
    "8.8 练习8.4": "8.8 Exercise 8.4",
    "8.8 练习8.5": "8.8 Exercise 8.5",
    "8.8 练习8.6": "8.8 Exercise 8.6",
    "8.8 练习8.7": "8.8 Exercise 8.7",
    "8.8 练习8.8": "8.8 Exercise 8.8",
    "8.9 常见陷阱与错误": "8.9 Common pitfalls and mistakes",
    "O(n²)问题的影响": "The consequences of the O(n²) problem",
    "三种方法对比": "The three methods compared",
    "与RNN的复杂度对比": "Complexity compared with RNNs",
    "与加性注意力的对比": "Compared with additive attention",
    "为什么需要缩放因子": "Why a scaling factor is needed",
    "位置信息的编码": "Encoding position information",
    "余弦相似度注意力(Cosine Similarity Attention)": "Cosine-similarity attention",
    "作为核回归的视角": "Attention seen as kernel regression",
    "作为统计物理分布的视角": "Attention seen as a statistical-physics distribution",
    "加性注意力(Additive Attention)": "Additive attention",
    "基本定义": "Basic definition",
    "引言": "Introduction",
    "时间复杂度详细分析": "Time complexity in detail",
    "核心代码示例": "Core code example",
    "温度参数": "The temperature parameter",
    "点积注意力(Dot-Product Attention)": "Dot-product attention",
    "空间复杂度分析": "Analysis of the space complexity",
    "统计学原理：为何需要缩放？": "The statistics: why scale?",
    "缩放点积注意力的核心机制": "The core mechanism of scaled dot-product attention",
    "自回归任务中的掩码机制": "Masking in autoregressive tasks",
    "计算效率考量": "Computational efficiency",
    "详细计算步骤": "The computation step by step",
}

_CJK = re.compile(r"[\u3000-\u303f\u3400-\u9fff\uff00-\uffef]")


def english(section: str) -> str | None:
    """The English title of the heading ``section``: itself when it has no Chinese character,
    else its entry of `SECTIONS_EN`, or None when there is none."""
    if not _CJK.search(section):
        return section
    return SECTIONS_EN.get(section)


__all__ = ["SECTIONS_EN", "english"]
