"""accelerate with gradwire.integrations.accelerate.register on 2 CPU processes under torchrun."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from .launch import ROOT, results, torchrun

pytest.importorskip("accelerate")
pytestmark = [pytest.mark.frameworks, pytest.mark.distributed]


def test_accelerate_register_compresses_and_keeps_each_ranks_residuals(tmp_path: Path) -> None:
    run = torchrun(ROOT / "tests" / "frameworks" / "accelerate_worker.py", tmp_path, timeout=240,
                   env={"ACCELERATE_USE_CPU": "1"})
    first, second = results(tmp_path)
    for rank in (first, second):
        assert rank["world"] == 2
        assert rank["steps"] == 6  # 12 micro-batches, accumulation 2: one exchange per optimizer step
        assert 0 < rank["sent"] < rank["dense"] / 5
        assert rank["restored_norm"] == rank["norm"] > 0
        assert rank["restored_iteration"] == 6
        assert rank["restored_digest"] == rank["digest"]
    assert first["norm"] != second["norm"]
    assert first["digest"] == second["digest"]
    assert "ran no step" in run.stdout  # the second run trained nothing, and was told so at exit


def test_accelerate_two_models_on_one_accelerator_each_get_their_own_residuals(tmp_path: Path) -> None:
    """A GAN's or a teacher/student's models on one Accelerator: one file each, nothing loads
    another model's residuals (equal shapes and options included), and a mix-up is refused."""
    torchrun(ROOT / "tests" / "frameworks" / "accelerate_models_worker.py", tmp_path, timeout=240,
             env={"ACCELERATE_USE_CPU": "1"})
    first, second = results(tmp_path)
    for rank in (first, second):
        trained, restored = rank["trained"], rank["restored"]
        assert all(trained[name]["steps"] == 4 for name in "abc")
        assert trained["a"]["norm"] > 0 and trained["b"]["norm"] > 0 and trained["a"]["norm"] != trained["b"]["norm"]
        assert trained["c"]["norm"] == 0  # sent dense under auto: nothing owed
        for name in "abc":
            assert restored[name]["norm"] == trained[name]["norm"], name
            assert restored[name]["steps"] == 0
        assert rank["swapped_error"].startswith("ValueError: gradwire: run/swapped")
        assert "holds the hook state of registered model 1, not of model 0" in rank["swapped_error"]
        assert rank["reordered_error"].startswith("ValueError: gradwire: run/ckpt/gradwire_hook_rank")
        assert "was saved from a model with other parameters" in rank["reordered_error"]
        assert "0.weight (2,048)" in rank["reordered_error"] and "0.weight (8)" in rank["reordered_error"]
    assert first["trained"]["a"]["norm"] != second["trained"]["a"]["norm"]  # per rank, too
    # the first model keeps the one-model name, so one-model folders read as before
    assert sorted(first["files"]) == sorted(f"gradwire_hook_{part}rank{r}.pt" for part in ("", "model1_", "model2_")
                                            for r in (0, 1))


@pytest.mark.skipif(torch.cuda.is_available(), reason="with GPUs accelerate builds DDP without ACCELERATE_USE_CPU")
def test_accelerate_example_without_use_cpu_warns_and_exits_0(tmp_path: Path) -> None:
    """Under torchrun on CPU without ACCELERATE_USE_CPU=1, accelerate builds no DDP: every process
    trains alone, and the example says so (one line each) instead of failing on a missing state."""
    run = torchrun(ROOT / "examples" / "accelerate_loop.py", tmp_path, timeout=240, unset=("ACCELERATE_USE_CPU",))
    assert "HookNeverRanWarning" in run.stdout and "Traceback" not in run.stdout
    lines = [line for line in run.stdout.splitlines() if line.startswith("gradwire: no DistributedDataParallel")]
    assert len(lines) == 2 and all("trained 6 steps uncompressed" in line for line in lines), run.stdout
