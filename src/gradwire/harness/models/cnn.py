"""The project's default model: a small CNN for MNIST-5k (1x28x28) and the 8x8 digits."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class SmallCNN(nn.Module):
    """Two 3x3 conv+BN+ReLU stages and two fully connected layers; 151,402 parameters.

    Input (N, in_channels, H, W) float32 with H, W >= 2 (28x28 MNIST, 8x8 digits: an adaptive
    average pool fixes the classifier's input at 64x4x4); output (N, num_classes) logits.
    Hybrid policy: the first conv and the classifier stay full-rank. (The count is for 10
    classes and one channel.)

    Args:
        num_classes: logits per example.
        in_channels: image channels.
        image_size: side of :meth:`example_input`'s images (any size >= 2 runs).
    """

    lowrank_keep_full = ("conv1", "fc2")

    def __init__(self, num_classes: int = 10, in_channels: int = 1, image_size: int = 28) -> None:
        super().__init__()
        self.input_shape = (in_channels, image_size, image_size)
        self.conv1 = nn.Conv2d(in_channels, 32, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(32)
        self.conv2 = nn.Conv2d(32, 64, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(64)
        self.pool = nn.AdaptiveAvgPool2d(4)
        self.fc1 = nn.Linear(64 * 4 * 4, 128)
        self.fc2 = nn.Linear(128, num_classes)

    def example_input(self, batch_size: int = 2) -> Tensor:
        """Random (batch_size, *input_shape) images on the model's device."""
        return torch.randn(batch_size, *self.input_shape, device=self.fc2.weight.device)

    def forward(self, x: Tensor) -> Tensor:
        """(N, in_channels, H, W) float32 images -> (N, num_classes) logits."""
        x = F.max_pool2d(F.relu(self.bn1(self.conv1(x))), 2)
        x = self.pool(F.relu(self.bn2(self.conv2(x)))).flatten(1)
        return self.fc2(F.relu(self.fc1(x)))
