"""A model, its data and its loss, by name: what ``gradwire train`` and the benchmarks run.

``mlp`` (a wide MLP, :class:`~gradwire.harness.models.mlp.WideMLP`) takes ``synthetic`` vectors labelled by
a fixed random linear teacher: a communication-bound workload (many parameters, little compute).
Image models (cnn, resnet18, vgg19) take ``mnist5k``, ``digits`` or ``synthetic`` images
(CIFAR-shaped 3x32x32 by default for resnet18/vgg19). Sequence models (lstm, transformer, gpt) take
``synthetic`` token sequences, a local text file (``text=PATH``, byte-level, vocabulary 256) or
``pystdlib`` (this Python's standard-library sources, :mod:`~gradwire.harness.pystdlib`):
the LSTM and the GPT predict every next byte, the Transformer classifies the byte after each window.

``gpt`` (:class:`~gradwire.harness.models.gpt.ByteGPT`, 509,248 parameters) on ``pystdlib`` (its
default) is the language-model workload: 128-byte windows, a target at every position, and the
held-out split of whole files that training never sees. Its headline number is the held-out loss
(``Workload.metric == "loss"``: mean cross-entropy in nats per byte over the whole held-out split).
``data`` takes options like a method spec: ``pystdlib:max_bytes=1000000,held_out_bytes=65536``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from .data import DATASETS, load
from ..errors import check_choice
from .models import MODELS, build_model
from .pystdlib import pystdlib

IMAGE_MODELS = ("cnn", "resnet18", "vgg19")
SEQUENCE_MODELS = ("lstm", "transformer", "gpt")
#: options of ``data=pystdlib:...`` -> :func:`~gradwire.harness.pystdlib.pystdlib` keyword
PYSTDLIB_OPTIONS = ("max_bytes", "held_out_bytes", "held_out_every")


@dataclass
class Workload:
    """A model, its data and how to score it: what one training run needs.

    Attributes:
        model: the freshly built model (seeded: the same weights on every rank).
        train: the training split, ``(inputs, targets)`` items.
        test: the test split.
        loss: ``(outputs, targets) -> 0-dim`` mean cross-entropy.
        accuracy: fraction of correct predictions of a batch, ``(outputs, targets) -> float``.
        metric: the headline evaluation: "accuracy" (classifiers) or "loss" (language models:
            held-out mean cross-entropy, nats per predicted token — per byte for byte-level data).
        info: what the data is, for result files (e.g. pystdlib's fingerprint); JSON-ready.
    """

    model: torch.nn.Module
    train: torch.utils.data.Dataset
    test: torch.utils.data.Dataset
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    accuracy: Callable[[torch.Tensor, torch.Tensor], float]
    metric: str = "accuracy"
    info: dict[str, Any] = field(default_factory=dict)


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


class ByteWindows(torch.utils.data.Dataset):
    """Consecutive non-overlapping windows of a byte stream, with the next byte at every position.

    Item i is (inputs, targets), both int64 (seq_len,): bytes ``[i T, (i + 1) T)`` and
    ``[i T + 1, (i + 1) T + 1)``. The stream stays uint8 (an int64 copy of 8 MiB would be 64 MiB
    per rank); items are converted as they are read.

    Args:
        tokens: uint8 or int64 tensor (N,), N > seq_len.
        seq_len: window length in tokens.

    Raises:
        ValueError: fewer than ``seq_len + 1`` tokens.
    """

    def __init__(self, tokens: torch.Tensor, seq_len: int) -> None:
        count = (tokens.numel() - 1) // seq_len
        if count < 1:
            raise ValueError(f"{tokens.numel()} bytes are too few for one window of {seq_len} (+1) bytes")
        self.inputs = tokens[: count * seq_len].view(count, seq_len)
        self.targets = tokens[1: count * seq_len + 1].view(count, seq_len)

    def __len__(self) -> int:
        """Windows in the stream."""
        return self.inputs.shape[0]

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Window ``index``: (inputs, targets), int64 (seq_len,) each."""
        return self.inputs[index].long(), self.targets[index].long()


def parse_data(data: Optional[str]) -> tuple[Optional[str], dict[str, int]]:
    """Split a data spec into its name and options.

    Args:
        data: ``"pystdlib:max_bytes=1000000,held_out_bytes=65536"``, a plain name (other names
            take no options), or None.

    Returns:
        ``(name, {option: int})``, ``(None, {})`` for None.

    Raises:
        ValueError: a bad option (listing the allowed ones), or options for another name.
    """
    if data is None:
        return None, {}
    name, _, rest = data.partition(":")
    name = name.strip()
    options: dict[str, int] = {}
    for item in filter(None, (piece.strip() for piece in rest.split(","))):
        key, equals, raw = item.partition("=")
        key = key.strip()
        if name != "pystdlib":
            raise ValueError(f"data={data!r}: {name} takes no options")
        if not equals or key not in PYSTDLIB_OPTIONS:
            raise ValueError(f"data={data!r}: {item!r} is not an option; allowed: "
                             f"{', '.join(key + '=N' for key in PYSTDLIB_OPTIONS)}")
        try:
            options[key] = int(raw)
        except ValueError:
            raise ValueError(f"data={data!r}: {key}={raw.strip()!r} is not an integer") from None
    return name, options


def build_workload(model_name: str, data: Optional[str] = None, *, seed: int = 0, text: Optional[str] = None,
                   synthetic_size: int = 2048, seq_len: Optional[int] = None,
                   model_options: Optional[dict[str, Any]] = None) -> Workload:
    """Model ``model_name`` with its data. Same data and same initial weights on every rank.

    Args:
        model_name: one of ``MODELS``.
        data: the data set, optionally with options (``pystdlib:max_bytes=N``); defaults to
            mnist5k (cnn), synthetic images (resnet18, vgg19), synthetic tokens (lstm,
            transformer) or pystdlib (gpt).
        seed: seeds the weights and the synthetic data and splits.
        text: a local file read as bytes (sequence models; instead of ``data``).
        synthetic_size: examples of the synthetic data sets.
        seq_len: window length of the sequence models (default 128 for gpt, else 32).
        model_options: keywords for the model's constructor that replace the workload's defaults
            (e.g. ``{"d_model": 32, "n_layers": 1}`` for a tiny gpt).

    Returns:
        The :class:`Workload`.

    Raises:
        ValueError: an unknown model or data, a bad data option, or too little text.
    """
    check_choice("model", model_name, tuple(MODELS))
    data, data_options = parse_data(data)
    options = dict(model_options or {})
    torch.manual_seed(seed)
    if model_name == "mlp":
        return _mlp_workload(data, seed=seed, size=synthetic_size, model_options=options)
    if model_name in IMAGE_MODELS:
        data = data or ("mnist5k" if model_name == "cnn" else "synthetic")
        check_choice("data", data, DATASETS)
        train, test = load(data, seed=seed, synthetic_size=synthetic_size)
        channels, size = train.tensors[0].shape[1], train.tensors[0].shape[-1]
        model = build_model(model_name, **{"num_classes": 10, "in_channels": channels, "image_size": size, **options})
        return Workload(model, train, test, _classification_loss, _accuracy)
    seq_len = seq_len or (128 if model_name == "gpt" else 32)
    data = data or ("pystdlib" if model_name == "gpt" and text is None else None)
    if data == "pystdlib" and text is None:
        return _pystdlib_workload(model_name, seed=seed, seq_len=seq_len, data_options=data_options,
                                  model_options=options)
    if text is not None:
        tokens = torch.frombuffer(bytearray(open(text, "rb").read()), dtype=torch.uint8).to(torch.int64)
        vocab = 256
    else:
        if data not in (None, "synthetic"):
            raise ValueError(f"data={data!r} is not available for {model_name}; allowed: synthetic, pystdlib "
                             f"(or text=PATH)")
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
    model = _sequence_model(model_name, seed, seq_len, options)
    return Workload(model, train, test, _classification_loss, _accuracy, metric="loss" if model_name == "gpt" else
                    "accuracy", info={"data": "text", "path": text} if text is not None else {"data": "synthetic"})


def _sequence_model(model_name: str, seed: int, seq_len: int, options: dict[str, Any]) -> torch.nn.Module:
    if model_name == "lstm":
        defaults: dict[str, Any] = {"vocab_size": 256, "embed_dim": 128, "hidden_size": 128, "seq_len": seq_len}
    elif model_name == "gpt":
        defaults = {"vocab_size": 256, "context": seq_len, "seed": seed}
    else:
        defaults = {"vocab_size": 256, "num_classes": 256, "d_model": 128, "nhead": 4, "num_layers": 2,
                    "dim_feedforward": 512, "seq_len": seq_len, "max_len": max(128, seq_len)}
    return build_model(model_name, **{**defaults, **options})


def _pystdlib_workload(model_name: str, *, seed: int, seq_len: int, data_options: dict[str, int],
                       model_options: dict[str, Any]) -> Workload:
    """Training windows from the training files, test windows over the whole held-out split
    (:class:`ByteWindows`: every held-out byte but the first is a target, except the tail that does
    not fill a window). The Transformer classifier predicts only each window's next byte."""
    text = pystdlib(**data_options)
    train, test = ByteWindows(text.train, seq_len), ByteWindows(text.held_out, seq_len)
    if model_name == "transformer":  # a classifier: the byte after the window only
        train, test = (_token_windows(split.to(torch.int64), seq_len, next_only=True)
                       for split in (text.train, text.held_out))
    model = _sequence_model(model_name, seed, seq_len, model_options)
    return Workload(model, train, test, _classification_loss, _accuracy, metric="loss", info=text.info())


def evaluate(model: torch.nn.Module, workload: Workload, device: torch.device | str = "cpu",
             batch_size: int = 256) -> tuple[float, float]:
    """Accuracy and mean loss per prediction over the whole test split, in its order.

    Args:
        model: the trained model (or its DDP wrapper); put in eval mode for the pass, and in train
            mode after it.
        workload: supplies the test split, the loss and the accuracy.
        device: where the batches go.
        batch_size: examples per forward pass (the result does not depend on it beyond rounding).

    Returns:
        (fraction of correct predictions, mean cross-entropy per prediction in nats — per byte for
        the byte-level sequence models; exp of it is the perplexity).
    """
    model.eval()
    loader = torch.utils.data.DataLoader(workload.test, batch_size=batch_size)
    correct, total, loss_sum = 0.0, 0, 0.0
    with torch.no_grad():
        for inputs, targets in loader:
            outputs = model(inputs.to(device))
            targets = targets.to(device)
            correct += workload.accuracy(outputs, targets) * targets.numel()
            loss_sum += float(workload.loss(outputs, targets)) * targets.numel()
            total += targets.numel()
    model.train()
    return correct / max(total, 1), loss_sum / max(total, 1)


#: the wide MLP's input size and hidden width (4.7M parameters: a communication-bound step)
MLP_IN_FEATURES, MLP_WIDTH = 256, 2048


def _mlp_workload(data: Optional[str], *, seed: int, size: int, model_options: dict[str, Any]) -> Workload:
    if data not in (None, "synthetic"):
        raise ValueError(f"data={data!r} is not available for mlp; allowed: synthetic")
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.randn(size + size // 4, MLP_IN_FEATURES, generator=generator)
    teacher = torch.randn(MLP_IN_FEATURES, 10, generator=generator)
    labels = (inputs @ teacher).argmax(-1)
    data_set = torch.utils.data.TensorDataset(inputs, labels)
    train = torch.utils.data.Subset(data_set, list(range(size)))
    test = torch.utils.data.Subset(data_set, list(range(size, len(data_set))))
    model = build_model("mlp", **{"in_features": MLP_IN_FEATURES, "width": MLP_WIDTH, "depth": 2, "num_classes": 10,
                                  **model_options})
    return Workload(model, train, test, _classification_loss, _accuracy)
