"""chunktopk: each chunk keeps its share of k, its own largest magnitudes."""

from __future__ import annotations

import pytest
import torch

from gradwire.sparsify import get_sparsifier
from gradwire.sparsify.chunked import chunk_quotas


@pytest.mark.parametrize("numel, k, chunk", [(10, 3, 4), (9, 9, 4), (4097, 41, 4096), (100, 1, 7), (64, 32, 64)])
def test_quotas_sum_to_k_and_never_exceed_a_chunk(numel: int, k: int, chunk: int) -> None:
    quotas = chunk_quotas(numel, k, chunk)
    lengths = [min(chunk, numel - start) for start in range(0, numel, chunk)]
    assert int(quotas.sum()) == k
    assert all(0 <= q <= length for q, length in zip(quotas.tolist(), lengths))


def test_every_chunk_keeps_its_own_largest() -> None:
    # chunk 0 holds the tensor's largest values: a plain top-2 would take both from it
    x = torch.tensor([9.0, -8.0, 1.0, 0.0, 0.1, -0.3, 0.2, 0.0])
    assert get_sparsifier("topk", k=2).select(x).tolist() == [0, 1]
    assert get_sparsifier("chunktopk", k=2, chunk=4).select(x).tolist() == [0, 5]


def test_a_short_last_chunk_and_a_chunk_larger_than_the_tensor() -> None:
    torch.manual_seed(0)
    x = torch.randn(1000)
    chosen = get_sparsifier("chunktopk", density=0.05, chunk=128).select(x)
    assert chosen.numel() == 50 and bool((chosen[1:] > chosen[:-1]).all())
    quotas = chunk_quotas(1000, 50, 128)
    for row, quota in enumerate(quotas.tolist()):  # each chunk's picks are its quota largest
        part = x[row * 128: (row + 1) * 128].abs()
        picked = chosen[(chosen >= row * 128) & (chosen < (row + 1) * 128)] - row * 128
        assert picked.numel() == quota
        if quota:
            assert float(part[picked].min()) >= float(part.topk(quota).values.min())
    whole = get_sparsifier("chunktopk", k=7, chunk=1 << 20).select(x)  # one chunk: plain top-k
    assert whole.tolist() == get_sparsifier("topk", k=7).select(x).tolist()


def test_chunk_is_validated_and_refused_where_a_sparsifier_has_none() -> None:
    from gradwire.core.config import ExchangeConfig

    with pytest.raises(ValueError, match="chunk=0 must be an integer >= 1"):
        ExchangeConfig(compressor="chunktopk", density=0.1, chunk=0)
    with pytest.raises(ValueError, match="sparsifier 'topk' has no option chunk"):
        ExchangeConfig(compressor="topk", density=0.1, chunk=64)
