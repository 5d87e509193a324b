"""The README's plain-DDP and custom-loop snippets (examples/plain_loops.py) on 2 gloo ranks."""

from __future__ import annotations

from pathlib import Path

import pytest

from .launch import ROOT, results, torchrun

pytestmark = [pytest.mark.frameworks, pytest.mark.distributed]


def test_plain_ddp_and_custom_loop_snippets(tmp_path: Path) -> None:
    torchrun(ROOT / "tests" / "frameworks" / "plain_worker.py", tmp_path, timeout=180)
    first, second = results(tmp_path)
    for name in ("plain_ddp", "custom_loop"):
        for rank in (first, second):
            assert rank[name]["steps"] == 5 and 0 < rank[name]["sent"] < rank[name]["dense"] / 5
        assert first[name]["digest"] == second[name]["digest"]  # custom_loop: from different initial weights
        assert first[name]["norm"] != second[name]["norm"]
    for rank in (first, second):
        assert rank["restored_norm"] == rank["plain_ddp"]["norm"]
        assert "belongs to rank" in rank["other_rank_error"]
        local = rank["local_steps"]
        assert (local["steps"], local["outer"]) == (8, 2) and 0 < local["sent"] < local["dense"] / 20
    # DiLoCo: the same global parameters on both ranks, from different initial weights
    assert first["local_steps"]["digest"] == second["local_steps"]["digest"]
    assert [first["diloco_state"]["rank"], second["diloco_state"]["rank"]] == [0, 1]


def test_plain_loops_script_prints_one_whole_line_per_loop(tmp_path: Path) -> None:
    """The script as a user runs it: rank 0 alone prints, so the ranks' lines cannot run together."""
    run = torchrun(ROOT / "examples" / "plain_loops.py", tmp_path, timeout=180)
    lines = [line for line in run.stdout.splitlines() if "gradwire" in line]
    assert len(lines) == 3, run.stdout
    for line, loop in zip(lines, ("plain_ddp", "custom_loop", "local_steps")):
        steps = 8 if loop == "local_steps" else 5
        assert line.startswith(f"gradwire {loop}: {steps} steps, ") and line.endswith("(rank 0)"), line
    assert "Traceback" not in run.stdout
