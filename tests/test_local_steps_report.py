"""``scripts/local_steps_report.py``: docs/local-steps.md's tables and frontier plot come from it, so
its comparisons are checked on records whose answers are known."""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
_SPEC = importlib.util.spec_from_file_location("local_steps_report", ROOT / "scripts" / "local_steps_report.py")
report = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(report)

DDP_BYTES = 1000.0


def _record(method: str, loss: float, per_local_step: float | None = None) -> dict[str, Any]:
    record: dict[str, Any] = {"method": method, "held_out_loss": loss, "bytes_per_step": 1.0,
                              "bytes_ddp_per_step": DDP_BYTES,
                              "evaluations": [{"step": 0, "held_out_loss": 5.0}, {"step": 1500, "held_out_loss": loss}]}
    if per_local_step is not None:
        record["bytes_per_local_step"] = per_local_step
    return record


def _runs() -> dict[str, dict[int, dict[str, Any]]]:
    return {
        "ddp": {0: {"held_out_loss": 1.0, "evaluations": [{"step": 0, "held_out_loss": 5.0},
                                                           {"step": 1500, "held_out_loss": 1.0}]}},
        "dense-h64": {0: _record("diloco:sync_every=64", 1.2, 20.0), 1: _record("diloco:sync_every=64", 1.4, 20.0)},
        # seed 0 only: compared with dense-h64's seed 0 (1.2), not with its mean over seeds (1.3)
        "topk-h64": {0: _record("diloco:sync_every=64,unsent=model+topk:density=0.1", 1.32, 0.4)},
        "int4-h64": {0: _record("diloco:sync_every=64+quantize:bits=4", 1.206, 4.0),
                     1: _record("diloco:sync_every=64+quantize:bits=4", 1.386, 4.0)},
        # no dense run of its period: no relative number
        "dense-h8-nobytes": {0: _record("diloco:sync_every=8", 1.1)},
        "int8-h32": {0: _record("diloco:sync_every=32+quantize:bits=8", 1.1, 10.0)},
        "topk1-step": {0: _record("topk:density=0.01", 2.0)},
    }


def test_frontier_points_compare_with_dense_at_the_same_period_over_common_seeds() -> None:
    points = {p["name"]: p for p in report.frontier_points(_runs())}
    assert "dense-h8-nobytes" not in points  # counted no bytes
    assert points["topk-h64"]["family"] == "sparse"
    assert points["topk-h64"]["vs_dense"] == pytest.approx(10.0)
    assert points["topk-h64"]["fraction"] == pytest.approx(0.4 / DDP_BYTES)
    assert points["int4-h64"]["family"] == "quantized"
    assert points["int4-h64"]["vs_dense"] == pytest.approx(100 * (1.296 / 1.3 - 1))
    assert points["int4-h64"]["seeds"] == 2
    assert points["dense-h64"]["family"] == "dense" and math.isnan(points["dense-h64"]["vs_dense"])
    assert math.isnan(points["int8-h32"]["vs_dense"])
    assert points["ddp"]["family"] == "DDP" and points["ddp"]["fraction"] == 1.0
    # a per-step compressor's bytes per step are its bytes per local step
    assert points["topk1-step"]["family"] == "per-step"
    assert points["topk1-step"]["fraction"] == pytest.approx(1.0 / DDP_BYTES)


def test_family_tells_per_step_compression_from_outer_steps() -> None:
    assert report.family("topk1-step", {"method": "topk:density=0.01"}) == "per-step"
    assert report.family("dense-h16", {"method": "diloco:sync_every=16,warmup_steps=300"}) == "dense"
    assert report.family("x", {"method": "diloco:sync_every=16+quantize:bits=8"}) == "quantized"
    assert report.family("x", {"method": "diloco:sync_every=16+blocktopk:density=0.1"}) == "sparse"


@pytest.mark.timeout(120)
def test_plot_writes_a_png_of_the_frontier(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    for name, seeds in _runs().items():
        for seed, record in seeds.items():
            (tmp_path / f"{name}-s{seed}.json").write_text(json.dumps(record))
    out = tmp_path / "frontier.png"
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "local_steps_report.py"), "--runs", str(tmp_path),
                             "--plot", str(out)], capture_output=True, text=True, timeout=110)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "| topk-h64 |" in result.stdout and "+10.0%" in result.stdout
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_comparison_across_float_kernels_is_marked() -> None:
    """Records of one seed whose initial model evaluated to other bits were computed by other
    kernels: their comparison is marked (†), and one of matching numerics is not."""
    runs = _runs()
    table = report.quality_table(runs)
    assert "†" not in table  # no mark, and no footnote for one
    runs["topk-h64"][0]["evaluations"][0]["held_out_loss"] = 5.0000001
    table = report.quality_table(runs)
    marked = {line.split(" | ")[0].strip("| "): line for line in table.splitlines()}
    assert table.splitlines()[-1].startswith("† the pair's records")
    assert "+10.0% †" in marked["topk-h64"] and "†" not in marked["int4-h64"]
    assert report.mixed_numerics(runs["topk-h64"], runs["dense-h64"])
    assert not report.mixed_numerics(runs["int4-h64"], runs["dense-h64"])
