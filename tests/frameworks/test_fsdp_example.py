"""The README's FSDP2 snippet (examples/fsdp_lm.py) under torchrun on 2 CPU processes."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from .launch import ROOT, torchrun

pytestmark = [pytest.mark.frameworks, pytest.mark.distributed]


@pytest.mark.timeout(400)
def test_fsdp_example_learns_with_fewer_bytes_and_saves_each_ranks_state(tmp_path: Path) -> None:
    for setting, most in (("int8", 0.27), ("topk", 0.1), ("topk-momentum", 0.4)):
        run = torchrun(ROOT / "examples" / "fsdp_lm.py", tmp_path / setting, setting, timeout=180)
        lines = [line for line in run.stdout.splitlines() if line.startswith("gradwire fsdp")]
        assert len(lines) == 1, run.stdout
        found = re.search(r"loss ([\d.]+) -> ([\d.]+) over 40 steps, (\d+) bytes sent instead of (\d+)", lines[0])
        assert found, lines[0]
        first, last, sent, dense = (float(x) for x in found.groups())
        assert last < 0.8 * first and 0 < sent < most * dense, lines[0]
        assert {p.name for p in (tmp_path / setting).glob("fsdp-rank*.pt")} == {"fsdp-rank0.pt", "fsdp-rank1.pt"}
