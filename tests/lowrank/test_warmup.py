"""Warmup: the switch from full rank to low rank, alone and under a 2-process gloo DDP."""

import pytest
import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from gradwire.lowrank import LowRankConv2d, Warmup
from gradwire.harness.models import build_model

from ..distributed import run_workers


def sgd(params):
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def train_steps(warmup: Warmup, steps: int, generator: torch.Generator, image_size: int = 8) -> list[float]:
    losses = []
    for _ in range(steps):
        x = torch.randn(8, 1, image_size, image_size, generator=generator)
        y = torch.randint(10, (8,), generator=generator)
        warmup.optimizer.zero_grad()
        loss = F.cross_entropy(warmup.model(x), y)
        loss.backward()
        warmup.optimizer.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("bad", [-1, 1.5, True])
def test_bad_warmup_epochs_is_an_error(bad: object) -> None:
    with pytest.raises(ValueError, match="warmup_epochs"):
        Warmup(build_model("cnn"), sgd, warmup_epochs=bad)


def test_bad_options_fail_at_construction_not_at_the_switch() -> None:
    with pytest.raises(ValueError, match="rank_ratio"):
        Warmup(build_model("cnn"), sgd, warmup_epochs=3, rank_ratio=0.0)
    with pytest.raises(ValueError, match="keep_full.*'fc3'"):
        Warmup(build_model("cnn"), sgd, warmup_epochs=3, keep_full=["conv1", "fc3"])
    with pytest.raises(ValueError, match="no Conv2d"):
        Warmup(torch.nn.Sequential(torch.nn.ReLU()), sgd, warmup_epochs=3)


def test_switches_after_the_warmup_epochs_once() -> None:
    model = build_model("cnn", image_size=8)
    warmup = Warmup(model, sgd, warmup_epochs=2)
    generator = torch.Generator().manual_seed(0)
    train_steps(warmup, 1, generator)
    assert warmup.step_epoch() is False and not warmup.factorized
    warmup.optimizer.param_groups[0]["lr"] = 0.01  # as a scheduler would have decayed it
    assert warmup.step_epoch() is True and warmup.factorized
    assert warmup.step_epoch() is False
    assert warmup.model is model and isinstance(model.conv2, LowRankConv2d)  # factorized in place
    assert isinstance(model.bn2, torch.nn.BatchNorm2d)  # the BN after the conv stays, after the 2nd factor
    assert [d.name for d in warmup.decisions if d.factorized] == ["conv2", "fc1"]
    optimized = {id(p) for group in warmup.optimizer.param_groups for p in group["params"]}
    assert optimized == {id(p) for p in model.parameters()}
    group = warmup.optimizer.param_groups[0]
    assert group["lr"] == 0.01 and group["momentum"] == 0.9
    assert len(warmup.optimizer.state) == 0  # fresh momentum, as in the paper
    train_steps(warmup, 1, generator)


def test_carry_momentum_keeps_the_state_of_full_rank_layers() -> None:
    model = build_model("cnn", image_size=8)
    warmup = Warmup(model, sgd, warmup_epochs=1, carry_momentum=True)
    train_steps(warmup, 1, torch.Generator().manual_seed(0))
    buffer = warmup.optimizer.state[model.conv1.weight]["momentum_buffer"]
    warmup.step_epoch()
    assert warmup.optimizer.state[model.conv1.weight]["momentum_buffer"] is buffer
    assert model.conv2.first.weight not in warmup.optimizer.state


def test_zero_warmup_epochs_factorizes_at_once_with_extra_bn() -> None:
    warmup = Warmup(build_model("cnn", image_size=8), sgd, warmup_epochs=0, extra_bn=True)
    assert warmup.factorized and isinstance(warmup.model.conv2.mid_bn, torch.nn.BatchNorm2d)
    assert train_steps(warmup, 2, torch.Generator().manual_seed(0))


def test_loss_keeps_decreasing_across_the_switch_on_mnist5k() -> None:
    from gradwire.harness.data import load

    train, _ = load("mnist5k")
    images, labels = train.tensors[0][:512], train.tensors[1][:512]
    torch.manual_seed(0)
    warmup = Warmup(build_model("cnn"), sgd, warmup_epochs=1, rank_ratio=0.25)

    def full_loss() -> float:
        warmup.model.eval()
        with torch.no_grad():
            loss = F.cross_entropy(warmup.model(images), labels).item()
        warmup.model.train()
        return loss

    epoch_losses = []
    for epoch in range(3):
        order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(epoch))
        losses = []
        for start in range(0, len(labels), 32):
            batch = order[start:start + 32]
            warmup.optimizer.zero_grad()
            loss = F.cross_entropy(warmup.model(images[batch]), labels[batch])
            loss.backward()
            warmup.optimizer.step()
            losses.append(loss.item())
        epoch_losses.append(losses)
        if epoch == 0:
            before = full_loss()
            assert warmup.step_epoch()
            after = full_loss()
            # SVD truncation to a quarter of the rank costs a little, not a restart.
            assert after < 1.5 * before, (before, after)
    means = [sum(losses) / len(losses) for losses in epoch_losses]
    assert means[2] < means[1] < means[0], means
    right_after_switch = epoch_losses[1][:3]
    assert all(torch.isfinite(torch.tensor(right_after_switch)))
    assert sum(right_after_switch) / 3 < means[0], (right_after_switch, means)


def _ddp_switch_worker(rank: int, world_size: int) -> dict:
    torch.manual_seed(rank)  # different initial weights on purpose: DDP must make them agree
    model = build_model("cnn", image_size=8)
    ddp = DistributedDataParallel(model, bucket_cap_mb=1)
    warmup = Warmup(ddp, sgd, warmup_epochs=1, carry_momentum=True)
    generator = torch.Generator().manual_seed(100 + rank)  # each rank its own data
    train_steps(warmup, 2, generator)
    switched = warmup.step_epoch()
    losses = train_steps(warmup, 3, generator)
    return {
        "switched": switched,
        "wrapped": isinstance(warmup.model, DistributedDataParallel) and warmup.model is not ddp,
        "bucket_bytes": warmup.model.bucket_bytes_cap,
        "factorized": [d.name for d in warmup.decisions if d.factorized],
        "params": torch.cat([p.detach().flatten() for p in warmup.model.parameters()]).numpy(),
        "losses": losses,
    }


@pytest.mark.distributed
def test_switch_under_ddp_keeps_ranks_identical() -> None:
    first, second = run_workers(_ddp_switch_worker, 2, timeout=120)
    for result in (first, second):
        assert result["switched"] and result["wrapped"]
        assert result["bucket_bytes"] == 1024 * 1024
        assert result["factorized"] == ["conv2", "fc1"]
    assert first["params"].shape == second["params"].shape == (44_394,)
    assert (first["params"] == second["params"]).all()
    assert first["losses"] != second["losses"]  # the ranks did see different data
