import pytest
import torch
import torch.distributed as dist

from .distributed import run_workers


def _allreduce_rank(rank: int, world_size: int) -> float:
    tensor = torch.tensor([float(rank)])
    dist.all_reduce(tensor)
    return float(tensor)


def _fail_on_rank_one(rank: int, world_size: int) -> None:
    if rank == 1:
        raise RuntimeError("boom")
    dist.barrier()


@pytest.mark.distributed
def test_run_workers_returns_results_by_rank() -> None:
    assert run_workers(_allreduce_rank, 3, timeout=60) == [3.0, 3.0, 3.0]


@pytest.mark.distributed
def test_run_workers_reports_a_failure_without_hanging() -> None:
    with pytest.raises(AssertionError, match="boom"):
        run_workers(_fail_on_rank_one, 2, timeout=60, pg_timeout=5)
