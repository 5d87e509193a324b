"""A model, its data and its loss, by name: what ``gradwire train`` and the benchmarks run.

``mlp`` (a wide MLP, :class:`~gradwire.harness.models.mlp.WideMLP`) takes ``synthetic`` vectors labelled by
a fixed random linear teacher: a communication-bound workload (many parameters, little compute).
Image models (cnn, resnet18, vgg19) take ``mnist5k``, ``digits`` or ``synthetic`` images
(CIFAR-shaped 3x32x32 by default for resnet18/vgg19). Sequence models (lstm, transformer) take
``synthetic`` token sequences or a local text file (``text=PATH``, byte-level, vocabulary 256):
the LSTM predicts every next byte, the Transformer classifies the byte after each window.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from .data import DATASETS, load
from ..errors import check_choice
from .models import MODELS, build_model

IMAGE_MODELS = ("cnn", "resnet18", "vgg19")
SEQUENCE_MODELS = ("lstm", "transformer")


@dataclass
class Workload:
    model: torch.nn.Module
    train: torch.utils.data.Dataset
    test: torch.utils.data.Dataset
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    #: fraction of correct predictions of a batch (outputs, targets) -> float
    accuracy: Callable[[torch.Tensor, torch.Tensor], float]


def _classification_loss(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(outputs.reshape(-1, outputs.shape[-1]), targets.reshape(-1))


def _accuracy(outputs: torch.Tensor, targets: torch.Tensor) -> float:
    return float((outputs.argmax(-1) == targets).float().mean())


def _token_windows(tokens: torch.Tensor, seq_len: int, next_only: bool) -> torch.utils.data.TensorDataset:
    count = (tokens.numel() - 1) // seq_len
    if count < 2:
        raise ValueError(f"text too short: need more than {2 * seq_len + 1} bytes")
    inputs = tokens[: count * seq_len].reshape(count, seq_len)
    shifted = tokens[1: count * seq_len + 1].reshape(count, seq_len)
    targets = shifted[:, -1] if next_only else shifted
    return torch.utils.data.TensorDataset(inputs, targets)


def build_workload(model_name: str, data: Optional[str] = None, *, seed: int = 0, text: Optional[str] = None,
                   synthetic_size: int = 2048, seq_len: int = 32) -> Workload:
    """Model ``model_name`` with its data: ``data`` defaults to mnist5k (cnn), synthetic images
    (resnet18, vgg19) or synthetic tokens (lstm, transformer). Same data on every rank."""
    check_choice("model", model_name, tuple(MODELS))
    torch.manual_seed(seed)
    if model_name == "mlp":
        return _mlp_workload(data, seed=seed, size=synthetic_size)
    if model_name in IMAGE_MODELS:
        data = data or ("mnist5k" if model_name == "cnn" else "synthetic")
        check_choice("data", data, DATASETS)
        train, test = load(data, seed=seed, synthetic_size=synthetic_size)
        channels, size = train.tensors[0].shape[1], train.tensors[0].shape[-1]
        model = build_model(model_name, num_classes=10, in_channels=channels, image_size=size)
        return Workload(model, train, test, _classification_loss, _accuracy)
    if text is not None:
        tokens = torch.frombuffer(bytearray(open(text, "rb").read()), dtype=torch.uint8).to(torch.int64)
        vocab = 256
    else:
        if data not in (None, "synthetic"):
            raise ValueError(f"data={data!r} is not available for {model_name}; allowed: synthetic (or text=PATH)")
        generator = torch.Generator().manual_seed(seed)
        vocab = 256
        # a learnable stream: each token is the previous plus a small random step
        steps = torch.randint(0, 4, (synthetic_size * seq_len + 1,), generator=generator)
        tokens = torch.cumsum(steps, 0) % vocab
    windows = _token_windows(tokens, seq_len, next_only=model_name == "transformer")
    split = max(1, len(windows) // 5)
    order = torch.randperm(len(windows), generator=torch.Generator().manual_seed(seed))
    test = torch.utils.data.Subset(windows, order[:split].tolist())
    train = torch.utils.data.Subset(windows, order[split:].tolist())
    if model_name == "lstm":
        model = build_model("lstm", vocab_size=vocab, embed_dim=128, hidden_size=128, seq_len=seq_len)
    else:
        model = build_model("transformer", vocab_size=vocab, num_classes=vocab, d_model=128, nhead=4,
                            num_layers=2, dim_feedforward=512, seq_len=seq_len, max_len=max(128, seq_len))
    return Workload(model, train, test, _classification_loss, _accuracy)


#: the wide MLP's input size and hidden width (4.7M parameters: a communication-bound step)
MLP_IN_FEATURES, MLP_WIDTH = 256, 2048


def _mlp_workload(data: Optional[str], *, seed: int, size: int) -> Workload:
    if data not in (None, "synthetic"):
        raise ValueError(f"data={data!r} is not available for mlp; allowed: synthetic")
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.randn(size + size // 4, MLP_IN_FEATURES, generator=generator)
    teacher = torch.randn(MLP_IN_FEATURES, 10, generator=generator)
    labels = (inputs @ teacher).argmax(-1)
    data_set = torch.utils.data.TensorDataset(inputs, labels)
    train = torch.utils.data.Subset(data_set, list(range(size)))
    test = torch.utils.data.Subset(data_set, list(range(size, len(data_set))))
    model = build_model("mlp", in_features=MLP_IN_FEATURES, width=MLP_WIDTH, depth=2, num_classes=10)
    return Workload(model, train, test, _classification_loss, _accuracy)
