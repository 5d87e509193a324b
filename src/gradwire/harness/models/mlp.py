"""A wide multilayer perceptron: many parameters, little compute per example.

With a small batch its step is dominated by the gradient exchange, which is what the scaling
benchmark (``gradwire bench scaling``) needs on a machine with few cores: ``in_features x width
+ (depth - 1) x width^2 + width x num_classes`` parameters (4.7M by default) but only a few
matrix-vector products per example.
"""

from __future__ import annotations

import torch
from torch import nn


class WideMLP(nn.Module):
    """``(batch, in_features)`` float32 -> ``(batch, num_classes)`` logits; ``depth`` hidden layers of ``width``.

    Args:
        in_features: input features (inputs of any shape are flattened per example).
        width: units per hidden layer.
        depth: hidden layers.
        num_classes: logits per example.

    Raises:
        ValueError: a size below 1.
    """

    def __init__(self, in_features: int = 256, width: int = 2048, depth: int = 2, num_classes: int = 10) -> None:
        super().__init__()
        if min(in_features, width, depth, num_classes) < 1:
            raise ValueError(f"in_features, width, depth, num_classes must be >= 1; got "
                             f"{in_features}, {width}, {depth}, {num_classes}")
        layers: list[nn.Module] = []
        size = in_features
        for _ in range(depth):
            layers += [nn.Linear(size, width), nn.ReLU()]
            size = width
        layers.append(nn.Linear(size, num_classes))
        self.net = nn.Sequential(*layers)
        self.in_features = in_features

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        """(batch, ...) float32, ``in_features`` values per example -> (batch, num_classes) logits."""
        return self.net(inputs.reshape(inputs.shape[0], -1))

    def example_input(self, batch_size: int = 2) -> torch.Tensor:
        """Random (batch_size, in_features) inputs on the model's device."""
        return torch.randn(batch_size, self.in_features, device=next(self.parameters()).device)

    #: the hybrid policy of :func:`gradwire.lowrank.factorize`: keep the input layer full rank
    lowrank_keep_full = ("net.0",)
