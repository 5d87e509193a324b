"""accelerate with gradwire.integrations.accelerate.register on 2 CPU processes under torchrun."""

from __future__ import annotations

from pathlib import Path

import pytest

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
