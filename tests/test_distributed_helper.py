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


def _what_the_worker_sees(rank: int, world_size: int) -> tuple:
    import os
    import sys

    from gradwire import kernels

    return (os.environ.get("GRADWIRE_TEST_PROBE"), os.getcwd(), kernels._tried, "numba" in sys.modules)


@pytest.mark.distributed
def test_workers_see_the_tests_environment_and_folder_not_the_fork_servers(tmp_path, monkeypatch) -> None:
    """The fork server started long before this test (with other variables, in another folder); a
    worker must still start like a spawned one: this test's environment and working directory, and
    the native kernels' on/off not yet decided (each worker reads GRADWIRE_NATIVE itself)."""
    run_workers(_allreduce_rank, 2, timeout=60)  # the server is up before the changes below
    monkeypatch.setenv("GRADWIRE_TEST_PROBE", "seen")
    monkeypatch.chdir(tmp_path)
    for probe, cwd, decided, _ in run_workers(_what_the_worker_sees, 2, timeout=60):
        assert (probe, cwd, decided) == ("seen", str(tmp_path), False)


@pytest.mark.distributed
def test_workers_start_with_numba_loaded_by_the_fork_server() -> None:
    """What makes the helper fast: torch, gradwire and numba's start-up come from the server."""
    pytest.importorskip("numba")
    import os

    if os.environ.get("GRADWIRE_TEST_SPAWN") == "1" or os.environ.get("GRADWIRE_NATIVE") == "0":
        pytest.skip("plain spawn or native kernels off: nothing is preloaded")
    assert all(loaded for *_, loaded in run_workers(_what_the_worker_sees, 2, timeout=60))
