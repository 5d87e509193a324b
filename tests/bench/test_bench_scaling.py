"""``gradwire bench scaling``: the projection (no cluster), its plumbing, and a tiny real run."""

from __future__ import annotations

import argparse
import importlib.util
import json
import math

import pytest

from gradwire.bench.projection import PROJECTED_MODELS, Constants, allgather_loses_at, project, project_point
from gradwire.bench.scaling import check_targets, parse_layout, strategy_specs
from gradwire.cli.main import main


def test_allgather_crossing_in_bytes_matches_the_closed_form() -> None:
    # (p-1)(k e + 64) > 2 (p-1)/p * 4 n  <=>  p > 8 n / (k e + 64)
    constants = Constants(bytes_per_entry=3.2)
    for numel in PROJECTED_MODELS.values():
        k = round(0.01 * numel)
        expected = math.floor(8 * numel / (k * 3.2 + 64)) + 1
        assert allgather_loses_at(numel, 0.01, None, constants) == expected


def test_decode_cost_moves_the_crossing_to_fewer_workers() -> None:
    slow_decode = Constants(decode_seconds_per_entry=50e-9)
    free_decode = Constants(decode_seconds_per_entry=0.0)
    numel = PROJECTED_MODELS["resnet50"]
    assert allgather_loses_at(numel, 0.01, 100.0, slow_decode) < allgather_loses_at(numel, 0.01, 100.0, free_decode)


def test_projection_targets_and_auto_choice() -> None:
    result = project(Constants())
    # flat in p: 2k(p-1)/p entries + histograms (one level with the hook's hint, two without) + framing
    assert result["max_sparse_allreduce_volume_k"] <= result["max_sparse_allreduce_volume_k_unhinted"] <= 2.2
    assert result["auto_picks_winner"]
    # the winner changes with p: sparse AllReduce at 16 workers, dense at 1024 (ResNet-50, 100 Gbit/s, flat)
    numel = PROJECTED_MODELS["resnet50"]
    assert project_point(numel, 0.01, 16, 100.0, Constants())["winner"] == "sparse-allreduce"
    assert project_point(numel, 0.01, 1024, 100.0, Constants())["winner"] == "dense"
    # with nodes the hierarchical exchange is a candidate (and auto sees it too)
    nodes = project_point(numel, 0.01, 64, 10.0, Constants(), local_size=8)
    assert "hierarchical" in nodes["seconds"] and nodes["auto"] == nodes["winner"]


def test_layouts_and_strategy_specs() -> None:
    assert parse_layout("8") == (8, 1) and parse_layout("2x4") == (8, 4)
    for bad in ("1", "x", "2x0"):
        with pytest.raises(ValueError, match="--layouts"):
            parse_layout(bad)
    args = argparse.Namespace(compressor="topk", density=0.01, values="fp16", indices="rice", strategies=None)
    assert "hierarchical" not in strategy_specs(args, 1)
    nodes = strategy_specs(args, 4)
    assert nodes["hierarchical"].endswith("collective=sparse-allreduce,hierarchy=4")
    assert nodes["auto"].endswith("collective=auto,hierarchy=4") and nodes["dense"] == "allreduce"
    args.strategies = "dense,nope"
    with pytest.raises(ValueError, match="--strategies: 'nope'"):
        strategy_specs(args, 1)


def test_targets_from_rows() -> None:
    def row(strategy: str, layout: str, wire: float, seconds: float) -> dict:
        return {"strategy": strategy, "layout": layout, "bandwidth": "100mbit", "wire_bytes_per_step": wire,
                "seconds_per_step": seconds}

    rows = [row("allgather", "4", 300.0, 1.0), row("allgather", "8", 700.0, 2.0),
            row("sparse-allreduce", "4", 200.0, 0.5), row("sparse-allreduce", "8", 230.0, 1.2)]
    checks = {c["target"].split(":")[1].strip()[:20]: c for c in check_targets(rows)}
    assert [c["met"] for c in check_targets(rows)] == [True, False, True]
    assert any(c["value"] == pytest.approx(230 / 700) for c in checks.values())


def test_projection_only_command_writes_json_and_rejects_bad_options(tmp_path, capsys) -> None:
    out = tmp_path / "scaling"
    assert main(["bench", "scaling", "--projection-only", "--out", str(out)]) == 0
    if importlib.util.find_spec("matplotlib") is not None:  # the optional `plot` extra
        assert (out / "projection.png").stat().st_size > 1000
    saved = json.loads((out / "results.json").read_text())
    assert saved["rows"] == [] and saved["projection"]["auto_picks_winner"]
    assert "allgather top-k is slower than dense" in capsys.readouterr().out
    assert main(["bench", "scaling", "--projection-only", "--layouts", "1", "--out", str(out)]) == 2
    assert "--layouts" in capsys.readouterr().err


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_tiny_run_on_the_emulated_cluster_counts_wire_bytes_per_method(tmp_path) -> None:
    from gradwire.cluster import cluster_available

    available, why = cluster_available()
    if not available:
        pytest.skip(why)
    out = tmp_path / "scaling"
    code = main(["bench", "scaling", "--layouts", "2", "--bandwidths", "1gbit", "--model", "cnn",
                 "--strategies", "dense,sparse-allreduce", "--steps", "2", "--warmup-steps", "1", "--rounds", "1",
                 "--batch-size", "16", "--no-plot", "--gamma", "2e-8", "--out", str(out), "--timeout", "200"])
    assert code == 0
    rows = {row["strategy"]: row for row in json.loads((out / "results.json").read_text())["rows"]}
    dense, sparse = rows["dense"], rows["sparse-allreduce"]
    assert dense["measured_steps"] == sparse["measured_steps"] == 2 and sparse["rounds"] == 1
    # the interface counters, per method: at least the hook's bytes (headers on top), far below dense
    assert sparse["hook_bytes_per_step"] <= sparse["wire_bytes_per_step"] <= 1.5 * sparse["hook_bytes_per_step"] + 8192
    assert dense["hook_bytes_per_step"] <= dense["wire_bytes_per_step"] <= 1.2 * dense["hook_bytes_per_step"] + 8192
    assert sparse["wire_bytes_per_step"] < dense["wire_bytes_per_step"] / 10
