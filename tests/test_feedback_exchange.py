"""Error-feedback memory and the cost model, without process groups (world of one)."""

from __future__ import annotations

import pytest
import torch

from gradwire.exchange import CostModel, allgather_bytes, allreduce_sum, ring_allreduce_bytes
from gradwire.core.feedback import ErrorFeedback, MomentumCorrection


def test_error_feedback_invariant_is_exact() -> None:
    feedback = ErrorFeedback()
    generator = torch.Generator().manual_seed(0)
    old_residual = torch.zeros(100)
    for step in range(5):
        grad = torch.randn(100, generator=generator)
        compensated = feedback.compensate("w", grad)
        assert torch.equal(compensated, grad + old_residual)
        indices = torch.randperm(100, generator=generator)[:10].sort().values
        sent = torch.zeros(100)
        sent[indices] = compensated[indices]
        expected_total = compensated.clone()
        feedback.update("w", compensated, indices, compensated[indices].clone())
        new_residual = feedback.residuals["w"]
        assert torch.equal(sent + new_residual, expected_total)  # bit for bit
        assert torch.all(new_residual[indices] == 0)
        old_residual = new_residual.clone()
    feedback.clear("w")
    assert feedback.norm() == 0.0


def test_the_residual_norm_is_the_norm_of_every_residual_in_any_order() -> None:
    # stats() reads this every step: one fused float32 read, compared here with a float64 reference
    # over residuals of three dtypes (a bf16 residual must not be normed in bf16)
    generator = torch.Generator().manual_seed(1)
    residuals = {"big": torch.randn(300_000, generator=generator) * 0.1,
                 "half": torch.randn(4_096, generator=generator).bfloat16(),
                 "double": torch.randn(7, generator=generator, dtype=torch.float64) * 10}
    reference = sum(float(r.double().square().sum()) for r in residuals.values()) ** 0.5
    forward, backward = ErrorFeedback(), ErrorFeedback()
    forward.residuals = dict(residuals)
    backward.residuals = dict(reversed(list(residuals.items())))
    assert forward.norm() == pytest.approx(reference, rel=1e-5)  # bf16 accumulation: ~1e-3 off
    assert forward.norm() == backward.norm()
    forward.residuals["half"] = torch.zeros(4_096, dtype=torch.bfloat16)
    without_half = sum(float(r.double().square().sum()) for k, r in residuals.items() if k != "half") ** 0.5
    assert forward.norm() == pytest.approx(without_half, rel=1e-5)


def test_lossy_reception_stays_in_the_residual() -> None:
    feedback = ErrorFeedback()
    grad = torch.tensor([1.0, 2.0, 3.0])
    compensated = feedback.compensate(0, grad)
    feedback.update(0, compensated, torch.tensor([1, 2]), torch.tensor([1.5, 3.0]))
    assert feedback.residuals[0].tolist() == [1.0, 0.5, 0.0]


def test_momentum_correction_masks_sent_positions() -> None:
    feedback = MomentumCorrection(momentum=0.5)
    compensated = feedback.compensate("w", torch.tensor([1.0, 1.0]))
    feedback.update("w", compensated, torch.tensor([0]), compensated[torch.tensor([0])].clone())
    assert feedback.velocities["w"].tolist() == [0.0, 1.0]
    compensated = feedback.compensate("w", torch.tensor([1.0, 1.0]))
    # u = 0.5*u + g -> [1, 1.5]; plus residual [0, 1]
    assert compensated.tolist() == [1.0, 2.5]
    with pytest.raises(ValueError, match="momentum=1.5"):
        MomentumCorrection(1.5)


def test_cost_model_never_prefers_a_costlier_allgather() -> None:
    model = CostModel(world_size=4)
    dense = ring_allreduce_bytes(1_000_000, 4, 4)
    assert dense == 2 * 3 / 4 * 4_000_000
    assert model.prefer_allgather(10_000, 1_000_000, 4)
    assert not model.prefer_allgather(2_000_000, 1_000_000, 4)
    # break-even: (p-1) B + latency == 2 (p-1)/p 4n
    break_even = (dense - model.latency_bytes) / 3
    assert model.prefer_allgather(int(break_even) - 1, 1_000_000, 4)
    assert not model.prefer_allgather(int(break_even) + 1, 1_000_000, 4)


def test_collectives_are_identity_for_one_rank() -> None:
    tensor = torch.arange(4.0)
    assert torch.equal(allreduce_sum(tensor).result(), torch.arange(4.0))
    assert [bytes(b) for b in allgather_bytes(b"abc")] == [b"abc"]


def test_finite_check_is_exact() -> None:
    from gradwire.finite import all_finite, finite_flag

    for check in (all_finite, lambda t: bool(finite_flag(t))):
        assert check(torch.randn(1000))
        assert check(torch.tensor([3e38, 3e38]))  # the sum overflows; the values do not
        assert check(torch.empty(0))
        assert not check(torch.tensor([1.0, float("nan")]))
        assert not check(torch.tensor([1.0, -float("inf")], dtype=torch.bfloat16))
        assert not check(torch.tensor([float("inf"), -float("inf")]))  # the sum is NaN, as it should be
    flag = finite_flag(torch.ones(3))
    assert flag.dtype == torch.bool and flag.dim() == 0


@pytest.mark.parametrize("decay", [1.0, 0.5])
def test_updating_pieces_end_to_end_keeps_what_updating_each_keeps(decay: float) -> None:
    # a shared support keeps a bucket's residuals with one scatter over its flat compensated gradient
    generator = torch.Generator().manual_seed(2)
    numels = [7, 1, 300, 40]
    flat = torch.randn(sum(numels), generator=generator)
    positions = torch.tensor([0, 6, 7, 8, 100, 307, 347])
    received = torch.randn(positions.numel(), generator=generator).half()
    each, pieces = ErrorFeedback(decay=decay), ErrorFeedback(decay=decay)
    offsets = [0, 7, 8, 308]
    for key, (offset, numel) in enumerate(zip(offsets, numels)):
        inside = (positions >= offset) & (positions < offset + numel)
        each.update(key, flat[offset: offset + numel].clone(), positions[inside] - offset, received[inside])
    pieces.update_pieces([0, 1, 2, 3], numels, flat, positions, received)
    for key in range(4):
        assert torch.equal(each.residuals[key], pieces.residuals[key])
    assert pieces.residuals[2].untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()  # views, no copy
    with pytest.raises(NotImplementedError, match="entry by entry"):
        MomentumCorrection().update_pieces([0], [3], torch.zeros(3), torch.tensor([0]), torch.ones(1))
