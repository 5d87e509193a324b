"""A small decoder-only (GPT-style) byte-level language model."""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention in which position t sees positions <= t only.

    One ``qkv`` Linear (d_model -> 3 d_model) and an output ``proj``: plain ``nn.Linear`` layers,
    so :func:`gradwire.lowrank.factorize` can factorize both.
    """

    def __init__(self, d_model: int, n_heads: int) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)

    def forward(self, x: Tensor) -> Tensor:
        """(N, T, d_model) float -> (N, T, d_model)."""
        batch, length, width = x.shape
        # (N, T, 3, H, D) -> three (N, H, T, D)
        q, k, v = self.qkv(x).view(batch, length, 3, self.n_heads, width // self.n_heads).permute(2, 0, 3, 1, 4)
        attended = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(attended.transpose(1, 2).reshape(batch, length, width))


class Block(nn.Module):
    """Pre-norm residual block: x + attn(ln1(x)), then x + fc2(gelu(fc1(ln2(x))))."""

    def __init__(self, d_model: int, n_heads: int, d_ff: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_heads)
        self.ln2 = nn.LayerNorm(d_model)
        self.fc1 = nn.Linear(d_model, d_ff)
        self.fc2 = nn.Linear(d_ff, d_model)

    def forward(self, x: Tensor) -> Tensor:
        """(N, T, d_model) float -> (N, T, d_model)."""
        x = x + self.attn(self.ln1(x))
        return x + self.fc2(nn.functional.gelu(self.fc1(self.ln2(x))))


class ByteGPT(nn.Module):
    """Bytes (N, T) int64 in [0, vocab_size), T <= context -> next-byte logits (N, T, vocab_size) float32.

    Logit t predicts byte t + 1 from bytes 0..t (a causal mask; no padding). Token + learned
    position embeddings, ``n_layers`` pre-norm blocks (:class:`Block`), a final LayerNorm and an
    untied linear ``head``. No dropout by default: the intended runs are short and dropout would
    make replicas draw different random masks (the simulator's DDP equivalence would then hold
    only in distribution).

    The default (vocab 256, context 128, d_model 96, 4 layers, 4 heads of 24, FFN 384) has
    **509,248** parameters: embeddings 24,576 + positions 12,288 + 4 blocks x 111,840 + final
    norm 192 + head 24,832 (``tests/test_gpt.py`` checks the count).

    Initialization (GPT-2's): every Linear and Embedding weight ~ N(0, 0.02), biases 0, the
    residual projections (``attn.proj``, ``fc2``) ~ N(0, 0.02 / sqrt(2 n_layers)), LayerNorms
    (1, 0). Drawn from a generator seeded with ``seed``, so the weights do not depend on the global
    RNG state.

    Hybrid policy (Pufferfish keeps the first layer and the classifier full-rank): ``blocks.0``
    and ``head`` stay full-rank; later blocks' ``qkv``, ``proj``, ``fc1``, ``fc2`` are factorized.

    Args:
        vocab_size: number of byte values (256).
        context: the longest sequence (learned positions), in tokens.
        d_model: width of the residual stream; a multiple of ``n_heads``.
        n_layers: number of blocks.
        n_heads: attention heads per block.
        d_ff: hidden width of each block's MLP.
        seed: seed of the initialization.

    Raises:
        ValueError: a size below 1, or ``d_model`` not a multiple of ``n_heads``.
    """

    lowrank_keep_full = ("blocks.0", "head")

    def __init__(self, vocab_size: int = 256, context: int = 128, d_model: int = 96, n_layers: int = 4,
                 n_heads: int = 4, d_ff: int = 384, seed: int = 0) -> None:
        super().__init__()
        if min(vocab_size, context, d_model, n_layers, n_heads, d_ff) < 1:
            raise ValueError(f"vocab_size, context, d_model, n_layers, n_heads, d_ff must be >= 1; got "
                             f"{vocab_size}, {context}, {d_model}, {n_layers}, {n_heads}, {d_ff}")
        if d_model % n_heads:
            raise ValueError(f"d_model={d_model} must be a multiple of n_heads={n_heads}")
        self.vocab_size, self.context = vocab_size, context
        self.embedding = nn.Embedding(vocab_size, d_model)
        self.position = nn.Embedding(context, d_model)
        self.blocks = nn.ModuleList(Block(d_model, n_heads, d_ff) for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size)
        self.reset_parameters(seed)

    def reset_parameters(self, seed: int = 0) -> None:
        """Draw every parameter again from ``seed`` (see the class docstring)."""
        generator = torch.Generator().manual_seed(seed)
        residual_std = 0.02 / math.sqrt(2 * len(self.blocks))
        with torch.no_grad():
            for name, module in self.named_modules():
                if isinstance(module, (nn.Linear, nn.Embedding)):
                    std = residual_std if name.endswith(("attn.proj", "fc2")) else 0.02
                    # drawn on the CPU generator, then copied: the same numbers on any device
                    module.weight.copy_(torch.randn(module.weight.shape, generator=generator) * std)
                    if getattr(module, "bias", None) is not None:
                        module.bias.zero_()
                elif isinstance(module, nn.LayerNorm):
                    module.weight.fill_(1.0)
                    module.bias.zero_()

    def example_input(self, batch_size: int = 2) -> Tensor:
        """Random (batch_size, context) int64 bytes on the model's device."""
        return torch.randint(self.vocab_size, (batch_size, self.context), device=self.head.weight.device)

    def forward(self, tokens: Tensor) -> Tensor:
        """(N, T) int64 bytes, T <= context -> (N, T, vocab_size) float logits.

        Raises:
            ValueError: T > context.
        """
        if tokens.shape[1] > self.context:
            raise ValueError(f"sequence of {tokens.shape[1]} tokens is longer than context={self.context}")
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.embedding(tokens) + self.position(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))
