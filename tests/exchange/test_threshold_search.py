"""The threshold search on its own (no processes): every owner's split gives the same bits, the count
bound holds on adversarial magnitudes, hints only change the number of levels, status words round-trip.

Ranks are simulated by summing their local histograms here, which is all the collective does (an
exact integer SUM): the search sees only those sums, so agreement across ranks reduces to the
threshold not depending on how the entries are split among owners.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gradwire.exchange.sparse_reduce_scatter import RegionStatus, read_status_words, status_words
from gradwire.exchange.threshold_search import (
    ThresholdSearch,
    count_dtype,
    count_slack,
    fingerprints_agree,
    histogram_bits,
    key_of,
    magnitude_keys,
)


def _generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


#: name -> reduced values (all owners together)
CASES = {
    "all equal": torch.full((500,), 0.37),
    "1e-30..1e30": torch.logspace(-30, 30, 2000) * (torch.randint(0, 2, (2000,), generator=_generator(1)) * 2 - 1),
    "denormals and zeros": torch.cat([torch.arange(1, 1500) * 1.4e-45, torch.zeros(200), torch.tensor([1e-38])]),
    "one huge outlier": torch.cat([torch.randn(1000, generator=_generator(2)) * 1e-3, torch.tensor([3.0e38])]),
    "zeros": torch.zeros(64),
    "empty": torch.zeros(0),
    "gaussian": torch.randn(5000, generator=_generator(3)),
    "few distinct values": torch.tensor([1.0, 2.0, 4.0]).repeat_interleave(torch.tensor([300, 20, 5])),
}


def _search(regions: list[torch.Tensor], k: int, *, bins=None, hint=None) -> ThresholdSearch:
    """Run the search over owners holding ``regions``, their histograms summed as the AllReduce would."""
    search = ThresholdSearch.start(k, bins, hint)
    keys = [magnitude_keys(r) for r in regions]
    while not search.done:
        search = search.refine(sum(search.local_counts(kk) for kk in keys))
    return search


def _split(values: torch.Tensor, owners: int, seed: int) -> list[torch.Tensor]:
    """``values`` dealt to ``owners`` at random (some may get nothing)."""
    who = torch.randint(0, owners, (values.numel(),), generator=_generator(seed))
    return [values[who == j] for j in range(owners)]


def _check_bound(values: torch.Tensor, k: int, search: ThresholdSearch) -> None:
    t = search.threshold
    magnitudes = values.abs().double()
    kept = int((magnitudes >= t).sum())
    assert kept == search.survivors  # the count every rank knows is the true one
    n = values.numel()
    if k >= n:
        assert kept == n and t == -math.inf
    elif k == 0:
        assert kept == 0 and t == math.inf
    else:
        kth = float(torch.sort(magnitudes, descending=True).values[k - 1])
        ties = int((magnitudes == kth).sum())
        assert t <= kth  # the exact top-k survive, and every tie with the k-th
        assert k <= kept <= k + max(count_slack(k), ties - 1), (kept, k, ties)
        assert search.level <= math.ceil(31 / math.log2(search.bins)) + (search.hint_key is not None)


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("k", [0, 1, 7, 37, 300])
def test_any_split_among_owners_gives_the_same_threshold(name: str, k: int) -> None:
    values = CASES[name]
    alone = _search([values], k)
    _check_bound(values, k, alone)
    for owners, seed in [(2, 0), (3, 1), (6, 2)]:
        split = _search(_split(values, owners, seed), k)
        state = (split.threshold_key, split.survivors, split.level)
        assert state == (alone.threshold_key, alone.survivors, alone.level)
    everything_on_one = _search([torch.zeros(0), values, torch.zeros(0)], k)  # one owner holds it all
    assert everything_on_one.threshold_key == alone.threshold_key


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("scale", [1.0, 1.3, 0.7, 1e3, 1e-3])
def test_a_hint_changes_the_levels_not_the_bound(name: str, scale: float) -> None:
    values, k = CASES[name], 37
    plain = _search([values], k)
    if not math.isfinite(plain.threshold) or plain.threshold == 0:
        return
    hinted = _search(_split(values, 4, 5), k, hint=plain.threshold * scale)
    _check_bound(values, k, hinted)


def test_a_good_hint_saves_levels() -> None:
    for k, n, levels in [(37, 480, (2, 1)), (2000, 16000, (3, 2)), (47_000, 376_000, (2, 1))]:
        values = torch.randn(n, generator=_generator(k))
        plain = _search([values], k)
        following = torch.randn(n, generator=_generator(k + 1))  # the next step: other values, a similar threshold
        hinted = _search([following], k, hint=plain.threshold)
        assert (plain.level, hinted.level) == levels, (plain, hinted)


def test_unusable_hints_are_no_hint() -> None:
    for hint in (None, 0.0, -1.0, math.inf, -math.inf, math.nan):
        search = ThresholdSearch.start(37, None, hint)
        assert search.hint_key is None
        none = ThresholdSearch.start(37).fingerprint_words(torch.int32)
        assert torch.equal(search.fingerprint_words(torch.int32), none)


@settings(max_examples=150, deadline=None)
@given(parts=st.lists(st.tuples(st.sampled_from([0.0, 1.4e-45, 1e-40, 1e-30, 1e-3, 0.5, 1.0, 3.0, 1e30, 3.4e38]),
                                st.integers(0, 40)), min_size=1, max_size=6),
       noise=st.booleans(), k=st.integers(0, 150), owners=st.integers(1, 6), seed=st.integers(0, 10**6),
       hint=st.one_of(st.none(), st.floats(1e-38, 1e38)))
def test_count_bound_on_arbitrary_mixtures(parts, noise, k, owners, seed, hint) -> None:
    values = torch.cat([torch.full((n,), v) for v, n in parts])
    if noise:  # break some ties by a relative 1e-3 (downwards: 3.4e38 stays finite)
        values = values * (1 - 1e-3 * torch.rand(values.numel(), generator=_generator(seed)))
    regions = _split(values, owners, seed)
    search = _search(regions, k, hint=hint)
    _check_bound(values, k, search)
    assert search.threshold_key == _search([values], k, hint=hint).threshold_key


def test_fingerprints_tell_searches_apart() -> None:
    base = ThresholdSearch.start(100)
    others = [ThresholdSearch.start(101), ThresholdSearch.start(100, 256), ThresholdSearch.start(100, hint=0.5)]
    words = base.fingerprint_words(torch.int16)
    assert fingerprints_agree(words * 3, 3)
    for other in others:
        assert not torch.equal(other.fingerprint_words(torch.int16), words)
        assert not fingerprints_agree(words * 2 + other.fingerprint_words(torch.int16), 3)


@pytest.mark.parametrize("dtype", [torch.int16, torch.int32, torch.int64])
@pytest.mark.parametrize("world_size", [1, 2, 15, 16, 31, 32, 100])
def test_status_words_name_every_failing_rank(dtype: torch.dtype, world_size: int) -> None:
    g = _generator(world_size)
    statuses = [list(RegionStatus)[int(i)] for i in torch.randint(0, 3, (world_size,), generator=g)]
    summed = sum(status_words(s, rank, world_size, dtype) for rank, s in enumerate(statuses))
    agreed = read_status_words(summed, world_size)
    assert agreed.decode_failed == tuple(r for r, s in enumerate(statuses) if s is RegionStatus.DECODE_FAILED)
    assert agreed.nonfinite == tuple(r for r, s in enumerate(statuses) if s is RegionStatus.NONFINITE)
    assert agreed.ok == all(s is RegionStatus.OK for s in statuses)


def test_sizes() -> None:
    assert count_dtype(32767) == torch.int16 and count_dtype(32768) == torch.int32
    assert count_dtype(2**31 - 1) == torch.int32 and count_dtype(2**31) == torch.int64
    assert [1 << histogram_bits(k) for k in (0, 30, 2000, 8191, 8192, 16_384, 47_000, 112_000, 10**7)] == \
        [64, 64, 64, 64, 128, 256, 512, 1024, 2048]
    for k in (4096, 8192, 47_000, 112_000, 255_570, 10**6):  # two levels of 4-byte counts sent ~twice: <= 1/4 B
        assert 2 * 2 * 4 * (1 << histogram_bits(k)) / k <= 0.25
    assert key_of(1.0) == 0x3F800000 and magnitude_keys(torch.tensor([-1.0, 0.0, -0.0])).tolist() == [0x3F800000, 0, 0]
    with pytest.raises(ValueError, match="power of two"):
        ThresholdSearch.start(10, 100)
    with pytest.raises(ValueError, match="k="):
        ThresholdSearch.start(-1)
