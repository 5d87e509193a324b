"""``gradwire bench lowrank`` on the smallest model."""

import json

from gradwire.cli.main import main


def test_bench_lowrank_prints_and_writes_json(tmp_path, capsys) -> None:
    path = tmp_path / "bench.json"
    assert main(["bench", "lowrank", "--models", "cnn", "--batch-size", "4", "--repeats", "1",
                 "--json", str(path)]) == 0
    out = capsys.readouterr().out
    assert "cnn" in out and "151,402" in out and "44,394" in out
    report = json.loads(path.read_text())
    assert report["threads"] == 1
    (row,) = report["rows"]
    assert row["bytes_per_step_full"] == 4 * 151_402 and row["bytes_per_step_lowrank"] == 4 * 44_394
    assert row["ring_bytes_per_worker_full"] == 1.5 * row["bytes_per_step_full"]  # 2(p-1)/p at p=4
    assert row["bytes_ratio"] < 0.31 and row["seconds_full"] > 0 and row["seconds_lowrank"] > 0
