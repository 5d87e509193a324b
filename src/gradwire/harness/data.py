"""Small real data sets that packages ship, so tests, examples and benchmarks need no download.

* ``mnist5k``: 5,000 MNIST digits (28x28, 10 classes, 500 each), bundled with gradwire
  (``datasets/mnist5k.u8.zst``, 723 KB; CC BY-SA 3.0, see ``datasets/README.md``).
* ``digits``: scikit-learn's 1,797 8x8 digits (10 classes), for the quickest runs (needs scikit-learn).
* ``synthetic``: Gaussian images of a given shape with labels from a fixed random linear map.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..errors import check_choice

DATASETS = ("mnist5k", "digits", "synthetic")
MNIST5K_PATH = Path(__file__).with_name("datasets") / "mnist5k.u8.zst"
_MNIST5K_COUNT, _MNIST5K_PIXELS = 5000, 28 * 28
_MNIST5K_XXH3 = "3aea6f1e3457a43d"


def mnist5k() -> tuple[torch.Tensor, torch.Tensor]:
    """The bundled MNIST-5k: uint8 images (5000, 1, 28, 28) and int64 labels (5000,).

    Raises:
        OSError: the file is missing or damaged (a checksum guards the install).
    """
    import xxhash
    import zstandard

    size = _MNIST5K_COUNT * (_MNIST5K_PIXELS + 1)
    try:
        raw = zstandard.ZstdDecompressor().decompress(MNIST5K_PATH.read_bytes(), max_output_size=size)
    except zstandard.ZstdError as error:
        raise OSError(f"{MNIST5K_PATH} is damaged ({error}); reinstall gradwire") from None
    if len(raw) != size or xxhash.xxh3_64_hexdigest(raw) != _MNIST5K_XXH3:
        raise OSError(f"{MNIST5K_PATH} is damaged (size or checksum differs); reinstall gradwire")
    pixels = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    images = pixels[: _MNIST5K_COUNT * _MNIST5K_PIXELS].reshape(_MNIST5K_COUNT, 1, 28, 28)
    return images, pixels[_MNIST5K_COUNT * _MNIST5K_PIXELS:].to(torch.int64)


#: the images' held-out share (of every image set, the synthetic one included)
DEFAULT_TEST_FRACTION = 0.2


def load(
    name: str = "mnist5k",
    *,
    test_fraction: float = DEFAULT_TEST_FRACTION,
    seed: int = 0,
    synthetic_shape: tuple[int, ...] = (3, 32, 32),
    synthetic_size: int = 2048,
    num_classes: int = 10,
) -> tuple[torch.utils.data.TensorDataset, torch.utils.data.TensorDataset]:
    """Load a data set and split it, the same way on every rank.

    Args:
        name: one of :data:`DATASETS`.
        test_fraction: the test split's share, in (0, 1).
        seed: seeds the split (a fixed permutation) and the synthetic data.
        synthetic_shape: ``synthetic``'s image shape (C, H, W).
        synthetic_size: ``synthetic``'s number of images.
        num_classes: ``synthetic``'s number of classes.

    Returns:
        (train, test) TensorDatasets of float32 images (N, C, H, W), scaled to zero mean and unit
        variance, and int64 labels (N,).

    Raises:
        ValueError: an unknown name or a bad ``test_fraction``.
        OSError: the bundled MNIST-5k is damaged.
    """
    check_choice("data", name, DATASETS)
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction={test_fraction} is not in (0, 1)")
    if name == "mnist5k":
        pixels, targets = mnist5k()
        images = pixels.to(torch.float32)
    elif name == "digits":
        from sklearn.datasets import load_digits

        bunch = load_digits()
        images = torch.as_tensor(bunch.data, dtype=torch.float32).reshape(-1, 1, 8, 8)
        targets = torch.as_tensor(bunch.target, dtype=torch.int64)
    else:
        generator = torch.Generator().manual_seed(seed)
        images = torch.randn(synthetic_size, *synthetic_shape, generator=generator)
        projection = torch.randn(images[0].numel(), num_classes, generator=generator)
        targets = (images.reshape(synthetic_size, -1) @ projection).argmax(dim=1)
    images = (images - images.mean()) / images.std().clamp_min(1e-8)
    order = torch.randperm(images.shape[0], generator=torch.Generator().manual_seed(seed))
    n_test = max(1, int(round(images.shape[0] * test_fraction)))
    test, train = order[:n_test], order[n_test:]
    dataset = torch.utils.data.TensorDataset
    return dataset(images[train], targets[train]), dataset(images[test], targets[test])


def python_source_words(vocab_size: int = 10_000, max_bytes: int = 4_000_000) -> tuple[torch.Tensor, int]:
    """A word-level token stream from this Python's own standard-library sources (no download).

    Reads the standard library's top-level ``*.py`` files in name order until ``max_bytes``,
    splits them into words and single punctuation characters, keeps the ``vocab_size - 1`` most
    frequent (ties by first appearance) and maps the rest to id ``vocab_size - 1`` (unknown).
    The text depends on the Python version, so the stream does too; within one installation it
    is fixed.

    Args:
        vocab_size: ids, >= 2 (the last one: unknown).
        max_bytes: characters read at least (whole files), unless the files run out.

    Returns:
        (token ids int64 (N,), vocab_size).

    Raises:
        ValueError: ``vocab_size`` below 2.
    """
    import collections
    import pathlib
    import re
    import sysconfig

    if vocab_size < 2:
        raise ValueError(f"vocab_size={vocab_size} must be >= 2")
    texts, size = [], 0
    for path in sorted(pathlib.Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        text = path.read_text(encoding="utf-8", errors="replace")
        texts.append(text)
        size += len(text)
        if size >= max_bytes:
            break
    words = re.findall(r"\w+|[^\w\s]", "\n".join(texts))
    ranked = [word for word, _ in collections.Counter(words).most_common(vocab_size - 1)]
    ids = {word: i for i, word in enumerate(ranked)}
    unknown = vocab_size - 1
    return torch.tensor([ids.get(word, unknown) for word in words], dtype=torch.int64), vocab_size
