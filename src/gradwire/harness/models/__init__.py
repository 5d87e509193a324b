"""Models for tests, examples and benchmarks, defined here (nothing is downloaded).

Every model takes ``num_classes``-style keywords of its own, has an ``example_input(batch_size)``
that returns a valid random batch on its device, and a ``lowrank_keep_full`` hybrid policy that
:func:`gradwire.lowrank.factorize` uses by default.

>>> from gradwire.harness.models import build_model
>>> model = build_model("resnet18", num_classes=10)
>>> sum(p.numel() for p in model.parameters())
11173834
"""

from __future__ import annotations

from typing import Any, Callable

from torch import nn

from ...errors import check_choice
from .cnn import SmallCNN
from .gpt import ByteGPT
from .lstm import LSTMLanguageModel
from .mlp import WideMLP
from .resnet import ResNet18
from .transformer import TransformerClassifier
from .vgg import VGG19

#: Model name -> class; keywords of ``build_model`` go to the class.
MODELS: dict[str, Callable[..., nn.Module]] = {
    "cnn": SmallCNN,
    "resnet18": ResNet18,
    "vgg19": VGG19,
    "lstm": LSTMLanguageModel,
    "transformer": TransformerClassifier,
    "mlp": WideMLP,
    "gpt": ByteGPT,
}


def build_model(name: str, **kwargs: Any) -> nn.Module:
    """Build a shipped model by name.

    Args:
        name: one of ``MODELS``.
        **kwargs: its class's keywords, e.g. ``num_classes=10, in_channels=3`` for the image
            models, ``vocab_size`` for the sequence models.

    Returns:
        The model, on the CPU.

    Raises:
        ValueError: an unknown ``name`` (naming the allowed ones), or what the class raises.
    """
    check_choice("model", name, tuple(MODELS))
    return MODELS[name](**kwargs)


__all__ = ["MODELS", "build_model", "ByteGPT", "LSTMLanguageModel", "ResNet18", "SmallCNN", "TransformerClassifier",
           "VGG19", "WideMLP"]
