"""HF Trainer with GradwireCallback on 2 CPU processes (gloo, ``use_cpu=True``) under torchrun."""

from __future__ import annotations

from pathlib import Path

import pytest

from .launch import ROOT, python, results, torchrun

pytest.importorskip("transformers")
pytest.importorskip("accelerate")
pytestmark = [pytest.mark.frameworks, pytest.mark.distributed]


def test_hf_trainer_callback_compresses_with_accumulation_and_restores_each_ranks_residuals(tmp_path: Path) -> None:
    torchrun(ROOT / "tests" / "frameworks" / "hf_worker.py", tmp_path, timeout=300)
    first, second = results(tmp_path)
    for rank in (first, second):
        assert rank["world"] == 2
        assert rank["steps"] == rank["global_step"] == 6  # one exchange per optimizer step (accumulation 2)
        assert 0 < rank["sent"] < rank["dense"] / 5
        assert rank["restored_norm"] == rank["norm"] > 0  # checkpoint-6 is the last step's state
        assert rank["restored_iteration"] == 6
        assert rank["resumed_steps"] == 2
    assert first["norm"] != second["norm"]
    assert first["digest"] == second["digest"]


def test_hf_example_without_torchrun_warns_and_exits_0(tmp_path: Path) -> None:
    """``python examples/hf_trainer.py``: one process, so no DDP; the example says so and trains
    uncompressed instead of failing on the hook state it does not have."""
    run = python(ROOT / "examples" / "hf_trainer.py", tmp_path, timeout=240)
    assert "HookNeverRanWarning" in run.stdout and "Traceback" not in run.stdout
    assert "gradwire: no DistributedDataParallel (one process), so 6 steps trained uncompressed" in run.stdout
