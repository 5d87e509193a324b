"""The α–β–γ model: formulas, volume independent of p, and a choice never slower than dense."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gradwire.exchange.alphabeta import (
    Link,
    allgather_payloads,
    choose,
    dense_allreduce,
    hierarchical_cost,
    shared_support_allreduce,
    sparse_allreduce_cost,
)


def test_formulas() -> None:
    assert dense_allreduce(1000, 4).bytes_sent == 2 * 3 / 4 * 4000 and dense_allreduce(1000, 4).rounds == 6
    assert allgather_payloads(100, 8, 3.0, header_bytes=0, length_round=False).bytes_sent == 7 * 300
    assert allgather_payloads(100, 8, 3.0).decoded_entries == 700
    assert shared_support_allreduce(99, 2).bytes_sent == 400.0
    cost = sparse_allreduce_cost(800, 4, 8.0, summary_size=16, levels=2)
    # reduce-scatter 3/4*800*8 + counts 24; two levels of 16 int32 counts + 16 + 2 words, each sent
    # 2*3/4 times; allgather 3*200*8 + lengths 24; rounds: counts, data, 2 per level, lengths, data
    assert cost.bytes_sent == 4800 + 24 + 1.5 * 4 * (2 * 16 + 16 + 2) + 4800 + 24
    assert cost.rounds == 8 * 3 and cost.decoded_entries == 1600
    # by default one level (the hook's hint) of bins sized by k: 64 for k = 800
    default = sparse_allreduce_cost(800, 4, 8.0)
    assert default.bytes_sent == 4800 + 24 + 1.5 * 4 * (64 + 16 + 2) + 4800 + 24 and default.rounds == 6 * 3
    # two ranks sum a histogram in one exchange: 4 + 2 rounds for two levels, the same bytes as two rounds
    two = sparse_allreduce_cost(800, 2, 8.0, summary_size=16, levels=2)
    assert two.rounds == 6 and two.bytes_sent == 3200 + 8 + 4 * (2 * 16 + 16 + 2) + 3200 + 8
    assert Link.from_rate(10).beta == pytest.approx(0.8e-9)


def test_sparse_allreduce_volume_does_not_grow_with_workers() -> None:
    k, e = 250_000, 8.0  # 1% of 25M, raw entries
    for p in (2, 4, 8, 64, 1024):
        entries = sparse_allreduce_cost(k, p, e).bytes_sent / e
        # 2k(p-1)/p + one level of 2048 int32 counts (+ status), sent twice, + 16 bytes per peer
        assert entries <= 2 * (p - 1) / p * k + (2 * 4 * (2048 + 16 + 2 * 34) + 16 * (p - 1)) / e
        assert sparse_allreduce_cost(k, p, e, levels=2).bytes_sent / e <= 2.05 * k
    gather = allgather_payloads(k, 8, e).bytes_sent
    assert sparse_allreduce_cost(k, 8, e).bytes_sent <= 0.35 * gather


def test_choice_follows_the_link() -> None:
    n, k = 25_000_000, 250_000

    def costs(p: int) -> list:
        return [dense_allreduce(n, p), allgather_payloads(k, p, 3.0), sparse_allreduce_cost(k, p, 3.0)]

    slow = Link.from_rate(0.1, alpha=50e-6)
    assert choose(costs(2), slow) == "allgather"  # two workers: one round trip of payloads is cheapest
    assert choose(costs(64), slow) == "sparse-allreduce"
    assert choose([dense_allreduce(n, 8), sparse_allreduce_cost(n, 8, 8.0)], slow) == "dense"  # density 1
    # CPU per decoded entry can make the allgather lose even where its bytes win
    assert choose(costs(8), Link.from_rate(100), decode_per_entry=1e-6) in ("dense", "sparse-allreduce")
    # hierarchical pays off when the node links are much faster than the cross-node links
    hier = [dense_allreduce(n, 64), sparse_allreduce_cost(k, 64, 3.0), hierarchical_cost(n, k, 8, 8, 3.0)]
    assert choose(hier, Link.from_rate(1, alpha=1e-3), intra=Link.from_rate(2000, alpha=1e-6)) == "hierarchical"
    with pytest.raises(ValueError, match="dense"):
        choose([allgather_payloads(k, 4, 3.0)], slow)


@settings(max_examples=200, deadline=None)
@given(p=st.integers(1, 1024), n=st.integers(1, 10**9), density=st.floats(1e-4, 1.0),
       e=st.floats(1.0, 16.0), gbit=st.floats(0.01, 400.0), alpha=st.floats(0.0, 1e-2), gamma=st.floats(0.0, 1e-6))
def test_never_chooses_a_path_predicted_slower_than_dense(p, n, density, e, gbit, alpha, gamma) -> None:
    k = max(1, int(n * density))
    link = Link.from_rate(gbit, alpha)
    costs = [dense_allreduce(n, p), shared_support_allreduce(k, p), allgather_payloads(k, p, e),
             sparse_allreduce_cost(k, p, e)]
    chosen = choose(costs, link, decode_per_entry=gamma)
    times = {c.strategy: c.seconds(link, decode_per_entry=gamma) for c in costs}
    assert chosen == "dense" or times[chosen] < times["dense"]
    assert times[chosen] == min(times.values()) or chosen == "dense"
