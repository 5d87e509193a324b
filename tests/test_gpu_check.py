"""``scripts/gpu_check.py`` runs unattended where a GPU is lent; here its CPU run keeps it from rotting."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(150)
def test_gpu_check_runs_every_section_on_the_cpu(tmp_path: Path) -> None:
    out = tmp_path / "check.json"
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_check.py"), "--device", "cpu", "--small",
                             "--budget", "100", "--json", str(out)], capture_output=True, text=True, timeout=140)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads(out.read_text())
    rows = next(iter(report["hot_path"].values()))
    assert {row["method"] for row in rows} == {"topk 1% fp16/rice allgather", "topk 1% fp16/rice sparse-allreduce",
                                              "randomblock 1% fp16", "int8 quantized", "dense"}
    assert all(row["hook_ms"] > 0 and "error" not in row for row in rows), rows
    assert all(row["ok"] and row["ranks_identical"] for row in report["two_ranks"]), report["two_ranks"]
    assert report["codecs"] and all("error" not in row for row in report["codecs"])


def test_gpu_check_without_cuda_says_so_and_exits_0() -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_check.py")], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0 and "no CUDA device here" in result.stdout
