"""Top-k over many small pieces in one native call (an FSDP module's (parameter, destination) pieces,
a bucket's biases and norms): each piece gets the answer it gets alone, bit for bit, through the
kernel, the sparsifier and the core's selection, and error feedback keeps its residuals end to end
so the next round reads them without a copy."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gradwire import kernels
from gradwire.core.feedback import ErrorFeedback
from gradwire.core.group import BufferTarget, Entry, Group, ShardTarget, check_entries
from gradwire.core.selection import Selection
from gradwire.core.stats import ExchangeStats
from gradwire.sparsify import get_sparsifier, topk

pytest.importorskip("numba")
pytestmark = pytest.mark.skipif(not kernels.available(), reason="GRADWIRE_NATIVE=0")


def _piece_values(rng: np.random.Generator, numel: int, trial: int, dtype: torch.dtype) -> torch.Tensor:
    values = torch.from_numpy(rng.standard_normal(numel)).to(dtype)
    if trial % 3 == 0:
        values = torch.round(values * 2) / 2  # many ties at the k-th magnitude
    if trial % 5 == 0:
        values[torch.from_numpy(rng.integers(0, numel, 3))] = float("nan")
    if trial % 7 == 0:
        values[torch.from_numpy(rng.integers(0, numel, 2))] = float("inf")
    if trial % 11 == 0:  # the threshold's sample reads only huge values: too few pass, the fallback runs
        values[:: max(1, numel // topk.SAMPLE_SIZE)] *= 1e6
        values[:: max(1, numel // 512)] *= 1e6
    return values


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_many_pieces_in_one_call_answer_as_each_piece_alone(dtype: torch.dtype) -> None:
    rng = np.random.default_rng(5)
    for trial in range(40):
        count = int(rng.integers(2, 12))
        numels = [int(rng.choice([int(rng.integers(2, 200)), int(rng.integers(2049, topk.NATIVE_TOP_MAX_NUMEL + 1))]))
                  for _ in range(count)]
        ks = [int(rng.integers(1, max(2, n // 8))) if trial % 2 else int(rng.integers(1, n)) for n in numels]
        gaps = [int(rng.integers(0, 50)) for _ in range(count)]
        source = torch.zeros(sum(numels) + sum(gaps) + 7, dtype=dtype)
        starts, at = [], 3
        for numel, gap in zip(numels, gaps):
            source[at: at + numel] = _piece_values(rng, numel, trial, dtype)
            starts.append(at)
            at += numel + gap
        has_residual = [bool(rng.integers(0, 2)) for _ in range(count)]
        residual = torch.from_numpy(rng.standard_normal(sum(numels)) * 0.3).to(dtype)
        out = torch.full((sum(numels),), 7.0, dtype=dtype)
        answers = topk.compensated_top_pieces(source, starts=starts, numels=numels, ks=ks, residual=residual,
                                              has_residual=has_residual, out=out)
        at = 0
        for i, (start, numel, k) in enumerate(zip(starts, numels, ks)):
            grad = source[start: start + numel]
            own_residual = residual[at: at + numel] if has_residual[i] else None
            expected_out = torch.empty(numel, dtype=dtype)
            topk._compensate_into(grad, own_residual, expected_out)
            expected = topk.topk_indices(topk._magnitudes_nan_last(expected_out), k)  # the torch/numpy path
            positions, values = answers[i]
            assert torch.equal(positions, expected), (trial, i)
            np.testing.assert_array_equal(out[at: at + numel].numpy(), expected_out.numpy())
            np.testing.assert_array_equal(values.numpy(), expected_out[expected].numpy())
            at += numel


def _group(buffer: torch.Tensor, sizes: list[int]) -> Group:
    entries, offset = [], 0
    for i, size in enumerate(sizes):
        entries.append(Entry(("p", i), i, buffer[offset: offset + size], offset))
        offset += size
    return Group(BufferTarget([buffer]), entries, divisor=1)


def _round(selection: Selection, group: Group, step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    check_entries(group)
    selection.run(group, step, deferred=selection.deferrable(group))
    answers = [(entry.indices.clone(), entry.compensated.clone()) for entry in group.entries]
    for entry in group.entries:  # what the round's end does once every rank agreed: nothing was received
        if entry.indices is not None and not entry.unused and selection.feedback is not None:
            selection.feedback.update(entry.key, entry.compensated, entry.indices, entry.compensated[entry.indices])
    return answers


def test_the_core_selection_gives_every_entry_its_own_answer_and_counts_each_once(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Rounds of a bucket with small and middling tensors (and a large one, scanned apart) through the
    many-pieces path and through the per-entry loop give the same positions and compensated gradients;
    one tensor is all zeros in round 2 (unused: it keeps its residual whole)."""
    sizes = [96, 9216, 24, 2304, 40_000, 288, 6912]
    rng = np.random.default_rng(1)
    rounds = [torch.from_numpy(rng.standard_normal(sum(sizes)).astype(np.float32)) for _ in range(4)]
    rounds[1][96: 96 + 9216] = 0.0
    sparsifier = get_sparsifier("topk", density=0.1)

    calls: list[int] = []
    original = type(sparsifier).select_compensated_pieces

    def counted(self, source, **kwargs):
        calls.append(len(kwargs["numels"]))
        return original(self, source, **kwargs)

    def run(pieces: bool) -> list:
        if not pieces:
            monkeypatch.setattr(type(sparsifier), "pieces_apply", lambda self, grad: False)
        monkeypatch.setattr(type(sparsifier), "select_compensated_pieces", counted)
        stats = ExchangeStats()
        selection = Selection(sparsifier, ErrorFeedback(), "layer", stats)
        answers = [_round(selection, _group(grads.clone(), sizes), step) for step, grads in enumerate(rounds)]
        monkeypatch.undo()
        return answers, stats.total["count_selections"], stats.total["count_compensations"]

    with_pieces, selections, compensations = run(True)
    # one call a round for the six small and middling tensors (five in round 2, where one is unused)
    assert calls == [6, 5, 6, 6]
    per_entry, _, _ = run(False)
    assert len(calls) == 4
    assert selections == compensations == len(sizes) * len(rounds)
    for step, (got, expected) in enumerate(zip(with_pieces, per_entry)):
        for i, ((indices, compensated), (want_indices, want_compensated)) in enumerate(zip(got, expected)):
            assert torch.equal(indices, want_indices), (step, i)
            assert torch.equal(compensated, want_compensated), (step, i)


def test_residuals_kept_from_one_buffer_are_read_back_without_a_copy() -> None:
    feedback = ErrorFeedback()
    keys, numels = ["a", "b", "c"], [5, 7, 3]
    buffers: list[torch.Tensor] = []
    for step in range(3):
        out, residual, has = feedback.prepare_pieces(keys, numels, torch.zeros(1))
        if step == 0:
            assert residual is None and has == [False] * 3
        else:  # last round's kept views lie end to end: the residual is a view of that buffer
            assert has == [True] * 3
            assert residual.untyped_storage().data_ptr() == buffers[-1].untyped_storage().data_ptr()
        if step == 2:  # the buffer of two rounds ago comes back as this round's output
            assert out.untyped_storage().data_ptr() == buffers[0].untyped_storage().data_ptr()
        out.copy_(torch.arange(15, dtype=torch.float32) + step)
        for key, piece in zip(keys, out.split(numels)):  # position 0 of each piece was sent
            feedback.update(key, piece, torch.tensor([0]), piece[:1].clone())
        buffers.append(out)
    assert torch.equal(feedback.residual("b"), torch.cat([torch.zeros(1), torch.arange(6, 12) + 2.0]))


def test_pieces_of_an_fsdp_style_input_select_as_alone() -> None:
    """A shard group's entries are views into the flat chunk-by-rank input at their offsets (one
    shard here, so no process group is needed: the layout of pieces is what matters)."""
    rng = np.random.default_rng(2)
    flat = torch.from_numpy(rng.standard_normal(2 * (2304 + 96)).astype(np.float32))
    pieces = [(0, 2304), (2304, 96), (2400, 2304), (4704, 96)]
    entries = [Entry(("w", i), i, flat[offset: offset + numel], offset) for i, (offset, numel) in enumerate(pieces)]
    group = Group(ShardTarget(flat, torch.zeros(flat.numel()), group=None), entries, divisor=2)
    selection = Selection(get_sparsifier("topk", density=0.1), ErrorFeedback(), "layer", ExchangeStats())
    check_entries(group)
    selection.run(group, 0)
    storages = {entry.compensated.untyped_storage().data_ptr() for entry in group.entries}
    assert len(storages) == 1  # one call wrote them all, end to end
    for entry in group.entries:
        assert torch.equal(entry.indices, topk.largest_magnitudes(entry.grad.clone(), round(0.1 * entry.numel)))
        assert entry.values is not None and torch.equal(entry.values, entry.grad[entry.indices])


def test_a_shared_support_compensates_and_checks_its_bucket_in_one_pass_as_entry_by_entry() -> None:
    # randomblock: one native pass over the whole bucket (check included) against the per-entry
    # path after the pipeline's check; the same compensated gradients, positions and unused flags
    sizes = [50_000, 300, 7, 40_000]
    generator = torch.Generator().manual_seed(4)

    def group_of(buffer: torch.Tensor) -> Group:
        group, offset = Group(BufferTarget([buffer])), 0
        for index, numel in enumerate(sizes):
            group.entries.append(Entry(index, index, buffer[offset: offset + numel], offset))
            offset += numel
        return group

    selections = [Selection(get_sparsifier("randomblock", density=0.01), ErrorFeedback(), "layer", ExchangeStats())
                  for _ in range(2)]
    for step, zero_entry in enumerate([None, 2, None]):
        gradient = torch.randn(sum(sizes), generator=generator)
        if zero_entry is not None:
            gradient[50_300: 50_307] = 0.0
        groups = []
        for one_pass, selection in zip((True, False), selections):
            group = group_of(gradient.clone())
            deferred = selection.deferrable(group) if one_pass else frozenset()
            assert deferred == (frozenset(range(4)) if one_pass else frozenset())
            check_entries(group, skip=deferred)
            selection.run(group, step, deferred=deferred)
            for entry in group.entries:  # what the strategy keeps: the values at the positions, sent whole
                group.keep(entry, entry.indices, entry.compensated[entry.indices].clone())
            for key, compensated, indices, sent in group.feedback_updates:
                selection.feedback.update(key, compensated, indices, sent)
            groups.append(group)
        fused, plain = groups
        assert fused.target.zeroed and not fused.target.buffers[0].any()  # the output's zero-fill, done
        assert (fused.compensated_flat is not None) == (zero_entry is None)
        for mine, theirs in zip(fused.entries, plain.entries):
            assert mine.unused == theirs.unused == (mine.key == zero_entry)
            assert torch.equal(mine.compensated, theirs.compensated) and torch.equal(mine.indices, theirs.indices)
        assert selections[0].stats.snapshot()["count_compensations"] == 4 * (step + 1)
    for key in range(4):
        assert torch.equal(selections[0].feedback.residuals[key], selections[1].feedback.residuals[key])
