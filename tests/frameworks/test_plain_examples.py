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
