"""CIFAR VGG-19 with BatchNorm and Pufferfish's three-layer classifier."""

from __future__ import annotations

import torch
from torch import Tensor, nn

#: Output channels of the 16 convs; "M" is a 2x2 max-pool.
VGG19_LAYOUT = (64, 64, "M", 128, 128, "M", 256, 256, 256, 256, "M",
                512, 512, 512, 512, "M", 512, 512, 512, 512, "M")


class VGG19(nn.Module):
    """Input (N, in_channels, 32, 32) float32 (any size works; 32x32 is CIFAR); output
    (N, num_classes) logits.

    20,560,330 parameters for 10 classes and 3 channels (convs without bias, each followed by BN
    and ReLU; classifier 512-512-512-classes with dropout). Hybrid policy (Pufferfish): the first
    ``full_rank_convs`` (9) convs and the last Linear stay full-rank.

    Args:
        num_classes: logits per example.
        in_channels: image channels.
        full_rank_convs: how many leading convs the hybrid policy keeps full-rank.
        image_size: side of :meth:`example_input`'s images.
    """

    def __init__(self, num_classes: int = 10, in_channels: int = 3, full_rank_convs: int = 9,
                 image_size: int = 32) -> None:
        super().__init__()
        self.input_shape = (in_channels, image_size, image_size)
        layers: list[nn.Module] = []
        conv_names: list[str] = []
        channels = in_channels
        for width in VGG19_LAYOUT:
            if width == "M":
                # ceil_mode: the same as floor on 32x32 (CIFAR), and keeps 28x28 or 8x8 inputs
                # from pooling down to nothing (28 -> 14 -> 7 -> 4 -> 2 -> 1).
                layers.append(nn.MaxPool2d(2, ceil_mode=True))
                continue
            conv_names.append(f"features.{len(layers)}")
            layers += [nn.Conv2d(channels, width, 3, padding=1, bias=False), nn.BatchNorm2d(width),
                       nn.ReLU(inplace=True)]
            channels = width
        self.features = nn.Sequential(*layers)
        self.classifier = nn.Sequential(
            nn.Dropout(), nn.Linear(512, 512), nn.ReLU(inplace=True),
            nn.Dropout(), nn.Linear(512, 512), nn.ReLU(inplace=True),
            nn.Linear(512, num_classes),
        )
        self.lowrank_keep_full = (*conv_names[:full_rank_convs], "classifier.6")

    def example_input(self, batch_size: int = 2) -> Tensor:
        """Random (batch_size, *input_shape) images on the model's device."""
        return torch.randn(batch_size, *self.input_shape, device=self.classifier[6].weight.device)

    def forward(self, x: Tensor) -> Tensor:
        """(N, in_channels, H, W) float32 images -> (N, num_classes) logits."""
        x = self.features(x)
        # Identity at 32x32 (the features end at 1x1); lets larger images through.
        x = nn.functional.adaptive_avg_pool2d(x, 1).flatten(1)
        return self.classifier(x)
