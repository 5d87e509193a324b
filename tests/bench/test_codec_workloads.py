"""Model-level codec tables of ``gradwire bench codecs``: exact byte counts that can fail."""

from __future__ import annotations

import json

import torch

from gradwire.bench import codec_workloads
from gradwire.cli.main import main


def test_embedding_nonzero_rows_cost_their_raw_size_plus_under_5_percent() -> None:
    gradient = codec_workloads.embedding_gradient(rows=20_000, dim=32, batch=64)
    rows, info = codec_workloads.embedding_rows(gradient, ("rle", "raw"))
    by_codec = {row["index_codec"]: row for row in rows}
    assert all(row["exact"] for row in rows)
    assert by_codec["rle"]["joined_vs_rows"] <= 1.05 and by_codec["rle"]["layerwise_vs_rows"] <= 1.05
    assert by_codec["raw"]["joined_vs_rows"] > 1.9  # a 4-byte index per 4-byte value
    assert info["nonzero_row_bytes"] < info["dense_bytes"] / 5


def test_lstm_pairs_volumes_on_a_small_layered_gradient() -> None:
    generator = torch.Generator().manual_seed(0)
    gradient = [("w", torch.randn(300, 200, generator=generator) * 1e-3), ("b", torch.randn(800, generator=generator))]
    rows = {row["pair"]: row for row in codec_workloads.lstm_rows(gradient, 0.1)}
    assert abs(rows["raw + fp32"]["relative_volume"] - 0.2) < 0.002  # COO: 8 bytes per kept 4-byte value
    assert rows["rice + qsgd-ans"]["relative_volume"] < 0.75 * rows["rice + qsgd-4"]["relative_volume"]
    assert rows["rice + qsgd-ans"]["relative_l2_error"] == rows["rice + qsgd-4"]["relative_l2_error"]
    assert rows["rice + fp32"]["relative_l2_error"] == 0.0 and rows["raw + fp32"]["deepreduce"].endswith("0.2000")


def test_bench_codecs_embedding_source(tmp_path, capsys) -> None:
    out = tmp_path / "codecs.json"
    assert main(["bench", "codecs", "--sources", "embedding", "--json", str(out)]) == 0
    saved = json.loads(out.read_text())
    assert saved["rows"] == [] and {row["index_codec"] for row in saved["embedding"]} >= {"rle", "rice"}
    assert "non-zero rows raw" in capsys.readouterr().out


def test_curvefit_rows_beat_fp16_within_the_bound() -> None:
    rows = codec_workloads.curvefit_rows((16,))
    by_codec = {row["codec"]: row for row in rows}
    assert by_codec["fp16"]["bits_per_value"] == 16.0
    assert by_codec["polyfit (fitted or raw only)"]["bits_per_value"] >= 16.0  # the permutation does not pay
    for name in ("polyfit", "dexp"):
        assert by_codec[name]["bits_per_value"] < 4.0 and by_codec[name]["layout"] == 2
        assert by_codec[name]["max_error_vs_peak"] <= 0.05


def test_lossless_rows_ans_beats_zstd_on_bfloat16() -> None:
    rows = codec_workloads.lossless_rows(k=20_000, repeats=1)
    bits = {(r["data"], r["dtype"], r["codec"]): r["bits_per_value"] for r in rows}
    assert bits[("N(0,1e-3^2)", "bfloat16", "ans")] < bits[("N(0,1e-3^2)", "bfloat16", "zstd (shuffle)")] < 16
