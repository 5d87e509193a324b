"""blocktopk: whole chunks by falling energy, exactly k elements, and the runs rle sends cheaply."""

from __future__ import annotations

import pytest
import torch

from gradwire.codecs import get_index_codec
from gradwire.sparsify import get_sparsifier


def test_the_chunks_with_the_most_energy_are_kept_whole() -> None:
    # chunk 1 holds the largest element, chunk 2 the largest sum of squares: energy decides
    x = torch.tensor([0.1, 0.0, 0.2, 0.1, 3.0, 0.0, 0.0, 0.0, 2.0, 2.0, 2.0, 2.0])
    assert get_sparsifier("blocktopk", k=4, chunk=4).select(x).tolist() == [8, 9, 10, 11]
    assert get_sparsifier("blocktopk", k=8, chunk=4).select(x).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]


def test_the_last_chunk_taken_keeps_its_first_elements_when_k_is_not_a_multiple() -> None:
    x = torch.tensor([0.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 5.0, 5.0, 5.0, 5.0])
    assert get_sparsifier("blocktopk", k=6, chunk=4).select(x).tolist() == [4, 5, 8, 9, 10, 11]


@pytest.mark.parametrize("numel, k, chunk", [(1000, 50, 32), (1001, 999, 32), (33, 2, 32), (10, 3, 64), (97, 40, 7)])
def test_exactly_k_whole_chunks_with_a_short_last_chunk(numel: int, k: int, chunk: int) -> None:
    torch.manual_seed(0)
    x = torch.randn(numel)
    chosen = get_sparsifier("blocktopk", k=k, chunk=chunk).select(x)
    assert chosen.numel() == k and bool((chosen[1:] > chosen[:-1]).all()) and int(chosen[-1]) < numel
    width = min(chunk, numel)
    energy = torch.zeros(-(-numel // width) * width)
    energy[:numel] = x.square()
    energy = energy.view(-1, width).sum(1)
    rows, counts = torch.unique(chosen // width, return_counts=True)
    whole = [row for row, count in zip(rows.tolist(), counts.tolist())
             if count == min(width, numel - row * width)]
    assert len(rows) - len(whole) <= 1  # one chunk at most is cut
    # every chunk kept (whole or cut) has at least the energy of every chunk not touched
    untouched = torch.ones(energy.numel(), dtype=torch.bool)
    untouched[rows] = False
    if untouched.any():
        assert float(energy[rows].min()) >= float(energy[untouched].max())


def test_chunk_one_is_plain_top_k() -> None:
    torch.manual_seed(1)
    x = torch.randn(500)
    assert (get_sparsifier("blocktopk", k=37, chunk=1).select(x).tolist()
            == get_sparsifier("topk", k=37).select(x).tolist())


def test_float16_energy_does_not_overflow() -> None:
    x = torch.zeros(64, dtype=torch.float16)
    x[40:48] = 300.0  # 300**2 overflows float16
    x[0] = 1.0
    assert get_sparsifier("blocktopk", k=8, chunk=8).select(x).tolist() == list(range(40, 48))


def test_runs_cost_rle_a_fraction_of_a_bit_per_position() -> None:
    torch.manual_seed(2)
    numel = 1 << 16
    x = torch.randn(numel)
    blocks = get_sparsifier("blocktopk", density=0.1, chunk=32).select(x)
    scattered = get_sparsifier("topk", density=0.1).select(x)
    rle, rice = get_index_codec("rle"), get_index_codec("rice")
    bits_blocks = 8 * len(rle.encode(blocks.numpy(), numel).data) / blocks.numel()
    bits_scattered = 8 * len(rice.encode(scattered.numpy(), numel).data) / scattered.numel()
    assert bits_blocks < 1.0 < 4.0 < bits_scattered


def test_chunk_is_validated() -> None:
    with pytest.raises(ValueError, match="chunk=0 must be an integer >= 1"):
        get_sparsifier("blocktopk", density=0.1, chunk=0)
