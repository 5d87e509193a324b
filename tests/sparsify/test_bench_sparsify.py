"""``gradwire bench sparsify`` runs end to end on a small tensor and writes its JSON."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import gradwire.sparsify as sparsify
from gradwire.cli.main import main


def test_bench_sparsify_small(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "bench.json"
    code = main(["bench", "sparsify", "--numel", "20000", "--densities", "0.01,0.1", "--repeats", "1",
                 "--threads", "1", "--json", str(out)])
    assert code == 0
    text = capsys.readouterr().out
    assert "torch.topk" in text and "1 thread(s)" in text
    document = json.loads(out.read_text())
    assert document["threads"] == 1
    names = {row["sparsifier"] for row in document["rows"]}
    assert names == {"torch.topk", *sparsify.sparsifiers()}
    assert len(document["rows"]) == 2 * len(names)
    for row in document["rows"]:
        assert row["median_s"] > 0 and row["gbps"] > 0 and row["speedup"] > 0
        if row["sparsifier"] in ("topk", "randomk", "randomblock", "torch.topk"):
            assert row["k"] == row["target_k"]


def test_bench_sparsify_rejects_bad_density(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "sparsify", "--numel", "100", "--densities", "2"]) == 2
    assert "density=2.0" in capsys.readouterr().err
