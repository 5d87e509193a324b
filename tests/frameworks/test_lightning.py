"""Lightning with GradwireDDPStrategy on 2 CPU processes (gloo) under torchrun."""

from __future__ import annotations

from pathlib import Path

import pytest

from .launch import ROOT, results, torchrun

pytest.importorskip("lightning")
pytestmark = [pytest.mark.frameworks, pytest.mark.distributed]


def test_lightning_strategy_compresses_on_cpu_and_restores_each_ranks_residuals(tmp_path: Path) -> None:
    torchrun(ROOT / "tests" / "frameworks" / "lightning_worker.py", tmp_path, timeout=300)
    first, second = results(tmp_path)
    for rank in (first, second):
        assert rank["steps"] == 6
        assert 0 < rank["sent"] < rank["dense"] / 5
        assert rank["restored_norm"] == rank["norm"] > 0
        assert rank["restored_iteration"] == 6
        assert rank["idle_warned"]  # the resumed fit trained no step, and says so
    assert first["norm"] != second["norm"]  # residuals really are per rank
    assert first["digest"] == second["digest"]  # parameters identical on both ranks
