"""CIFAR-style ResNet-18 (3x3 stem, no max-pool), as Pufferfish trains it."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class BasicBlock(nn.Module):
    """conv3x3-BN-ReLU-conv3x3-BN plus a shortcut (1x1 conv + BN when the shape changes)."""

    def __init__(self, in_planes: int, planes: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_planes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.shortcut = nn.Sequential()
        if stride != 1 or in_planes != planes:
            self.shortcut = nn.Sequential(nn.Conv2d(in_planes, planes, 1, stride=stride, bias=False),
                                          nn.BatchNorm2d(planes))

    def forward(self, x: Tensor) -> Tensor:
        """(N, in_planes, H, W) -> (N, planes, H / stride, W / stride)."""
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class ResNet18(nn.Module):
    """Input (N, in_channels, 32, 32) float32 (any size >= 8 works: the pool is adaptive);
    output (N, num_classes) logits.

    11,173,834 parameters for 10 classes: Pufferfish's ResNet-18 has no BatchNorm after the
    stem conv. ``stem_bn=True`` adds it, giving the common CIFAR ResNet-18 (11,173,962).
    Hybrid policy (Pufferfish): the stem conv, the first BasicBlock, the 1x1 shortcut convs and
    the classifier stay full-rank.

    Args:
        num_classes: logits per example.
        in_channels: image channels.
        stem_bn: a BatchNorm after the stem conv (the common CIFAR variant).
        image_size: side of :meth:`example_input`'s images.
    """

    lowrank_keep_full = ("conv1", "layer1.0", "*.shortcut.*", "fc")

    def __init__(self, num_classes: int = 10, in_channels: int = 3, stem_bn: bool = False,
                 image_size: int = 32) -> None:
        super().__init__()
        self.input_shape = (in_channels, image_size, image_size)
        self.conv1 = nn.Conv2d(in_channels, 64, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(64) if stem_bn else nn.Identity()
        stages, in_planes = [], 64
        for planes, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
            stages.append(nn.Sequential(BasicBlock(in_planes, planes, stride), BasicBlock(planes, planes)))
            in_planes = planes
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.fc = nn.Linear(512, num_classes)

    def example_input(self, batch_size: int = 2) -> Tensor:
        """Random (batch_size, *input_shape) images on the model's device."""
        return torch.randn(batch_size, *self.input_shape, device=self.fc.weight.device)

    def forward(self, x: Tensor) -> Tensor:
        """(N, in_channels, H, W) float32 images -> (N, num_classes) logits."""
        x = F.relu(self.bn1(self.conv1(x)))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(F.adaptive_avg_pool2d(x, 1).flatten(1))
