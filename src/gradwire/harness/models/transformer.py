"""A small Transformer encoder that classifies token sequences."""

from __future__ import annotations

import torch
from torch import Tensor, nn


class TransformerClassifier(nn.Module):
    """Tokens (N, T) int64, T <= max_len, and an optional padding mask (N, T) bool (True =
    padding) -> logits (N, num_classes), from the mean of the non-padding positions.

    Token + learned position embeddings, ``num_layers`` post-norm encoder layers (batch
    first), a linear head. Hybrid policy (Pufferfish keeps the first encoder layer): the first
    layer and the head stay full-rank; later layers' attention and FFN are factorized.

    Args:
        vocab_size: token ids.
        num_classes: logits per sequence.
        d_model: model width.
        nhead: attention heads.
        num_layers: encoder layers.
        dim_feedforward: FFN width.
        dropout: as ``nn.TransformerEncoderLayer``'s.
        max_len: the longest sequence (learned positions).
        seq_len: length of :meth:`example_input`'s sequences (at most ``max_len``).
    """

    lowrank_keep_full = ("encoder.layers.0", "head")

    def __init__(self, vocab_size: int = 10_000, num_classes: int = 10, d_model: int = 256, nhead: int = 4,
                 num_layers: int = 4, dim_feedforward: int = 1024, dropout: float = 0.1,
                 max_len: int = 128, seq_len: int = 64) -> None:
        super().__init__()
        self.vocab_size, self.seq_len = vocab_size, min(seq_len, max_len)
        self.embedding = nn.Embedding(vocab_size, d_model)
        self.position = nn.Embedding(max_len, d_model)
        layer = nn.TransformerEncoderLayer(d_model, nhead, dim_feedforward, dropout, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, num_layers, enable_nested_tensor=False)
        self.head = nn.Linear(d_model, num_classes)

    def example_input(self, batch_size: int = 2) -> Tensor:
        """Random (batch_size, seq_len) token ids on the model's device."""
        return torch.randint(self.vocab_size, (batch_size, self.seq_len), device=self.head.weight.device)

    def forward(self, tokens: Tensor, padding_mask: Tensor | None = None) -> Tensor:
        """(N, T) int64 tokens and an optional (N, T) bool padding mask -> (N, num_classes) logits."""
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.encoder(self.embedding(tokens) + self.position(positions), src_key_padding_mask=padding_mask)
        if padding_mask is None:
            return self.head(x.mean(dim=1))
        keep = (~padding_mask).unsqueeze(-1).to(x.dtype)
        return self.head((x * keep).sum(dim=1) / keep.sum(dim=1).clamp_min(1.0))
