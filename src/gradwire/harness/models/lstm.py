"""A two-layer LSTM language model (the shape of PyTorch's word_language_model, smaller)."""

from __future__ import annotations

import torch
from torch import Tensor, nn


class LSTMLanguageModel(nn.Module):
    """Tokens (N, T) int64 in [0, vocab_size) -> next-token logits (N, T, vocab_size).

    Embedding -> dropout -> ``num_layers``-layer LSTM (batch first) -> dropout -> decoder.
    With ``tie_weights`` (as in Pufferfish's LM) the decoder shares the embedding matrix, which
    needs ``embed_dim == hidden_size``. Hybrid policy: the embedding and decoder stay full-rank
    (the embedding is never a candidate); the LSTM is factorized.

    Args:
        vocab_size: token ids.
        embed_dim: embedding width.
        hidden_size: LSTM width.
        num_layers: LSTM layers.
        dropout: after the embedding, between LSTM layers and before the decoder.
        tie_weights: share the embedding matrix with the decoder.
        seq_len: length of :meth:`example_input`'s sequences.

    Raises:
        ValueError: ``tie_weights`` with ``embed_dim != hidden_size``.
    """

    lowrank_keep_full = ("decoder",)

    def __init__(self, vocab_size: int = 10_000, embed_dim: int = 256, hidden_size: int = 256,
                 num_layers: int = 2, dropout: float = 0.2, tie_weights: bool = True, seq_len: int = 35) -> None:
        super().__init__()
        if tie_weights and embed_dim != hidden_size:
            raise ValueError(f"tie_weights needs embed_dim == hidden_size, got {embed_dim} and {hidden_size}")
        self.vocab_size, self.seq_len = vocab_size, seq_len
        self.embedding = nn.Embedding(vocab_size, embed_dim)
        self.dropout = nn.Dropout(dropout)
        self.lstm = nn.LSTM(embed_dim, hidden_size, num_layers, batch_first=True, dropout=dropout)
        self.decoder = nn.Linear(hidden_size, vocab_size)
        if tie_weights:
            self.decoder.weight = self.embedding.weight

    def example_input(self, batch_size: int = 2) -> Tensor:
        """Random (batch_size, seq_len) token ids on the model's device."""
        return torch.randint(self.vocab_size, (batch_size, self.seq_len), device=self.decoder.weight.device)

    def forward(self, tokens: Tensor) -> Tensor:
        """(N, T) int64 tokens -> (N, T, vocab_size) next-token logits."""
        hidden, _ = self.lstm(self.dropout(self.embedding(tokens)))
        return self.decoder(self.dropout(hidden))
