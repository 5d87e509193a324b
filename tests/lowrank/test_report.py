"""The per-layer report and the ``gradwire lowrank summary`` command."""

import json

import pytest
import torch

from gradwire.cli.main import main
from gradwire.lowrank import factorize, summarize
from gradwire.harness.models import build_model


def rows_by_name(summary) -> dict:
    return {row.decision.name: row for row in summary.rows}


def test_cnn_report_counts_params_and_macs_from_shapes() -> None:
    model = build_model("cnn")
    summary = summarize(model, torch.randn(1, 1, 28, 28), rank_ratio=0.25)
    rows = rows_by_name(summary)
    assert list(rows) == ["conv1", "conv2", "fc1", "fc2"]
    assert (rows["conv1"].macs_before, rows["conv1"].macs_after) == (28 * 28 * 32 * 9,) * 2
    conv2 = rows["conv2"]
    assert conv2.decision.ranks == (16,)
    assert conv2.macs_before == 14 * 14 * 64 * 32 * 9
    assert conv2.macs_after == 14 * 14 * (16 * 32 * 9 + 64 * 16)
    assert (rows["fc1"].macs_before, rows["fc1"].macs_after) == (1024 * 128, 1024 * 32 + 32 * 128)
    assert (summary.model_params_before, summary.model_params_after) == (151_402, 44_394)
    assert summary.macs_after == sum(row.macs_after for row in summary.rows) < summary.macs_before
    table = summary.table()
    assert "conv2" in table and "keep_full 'conv1'" in table and "151,402 -> 44,394" in table
    assert json.loads(json.dumps(summary.to_dict()))["layers"][1]["ranks"] == [16]


def test_batch_size_scales_macs() -> None:
    model = build_model("cnn")
    factorized = factorize(model)
    one = summarize(model, torch.randn(1, 1, 28, 28), factorized)
    four = summarize(model, torch.randn(4, 1, 28, 28), factorized)
    assert four.macs_before == 4 * one.macs_before and four.macs_after == 4 * one.macs_after


def test_lstm_and_attention_macs() -> None:
    lstm = build_model("lstm", vocab_size=50, embed_dim=16, hidden_size=16, seq_len=5)
    rows = rows_by_name(summarize(lstm, lstm.example_input(1)))
    assert rows["lstm"].macs_before == 5 * 2 * 4 * 16 * (16 + 16)
    assert rows["lstm"].macs_after == 5 * 2 * (4 * 4 * (16 + 16) + 4 * 4 * (16 + 16))
    assert rows["decoder"].macs_before == rows["decoder"].macs_after == 5 * 16 * 50
    encoder = build_model("transformer", vocab_size=50, d_model=16, nhead=2, num_layers=2, dim_feedforward=32,
                          seq_len=5)
    rows = rows_by_name(summarize(encoder, encoder.example_input(1)))
    attention = 2 * 5 * 5 * 16
    assert rows["encoder.layers.1.self_attn"].macs_before == attention + 4 * 5 * 16 * 16
    assert rows["encoder.layers.1.self_attn"].macs_after == attention + 4 * 5 * 4 * (16 + 16)
    assert rows["encoder.layers.0.self_attn"].macs_after == attention + 4 * 5 * 16 * 16


def test_summarize_needs_a_factorized_model() -> None:
    model = build_model("cnn")
    with pytest.raises(ValueError, match="lowrank_decisions"):
        summarize(model, model.example_input(1), factorized=build_model("cnn"))


def test_summary_command_prints_a_table_and_writes_json(tmp_path, capsys) -> None:
    path = tmp_path / "summary.json"
    assert main(["lowrank", "summary", "--model", "cnn", "--rank-ratio", "0.5", "--json", str(path)]) == 0
    out = capsys.readouterr().out
    assert "cnn, rank_ratio=0.5" in out and "conv2" in out and "total" in out
    report = json.loads(path.read_text())
    assert report["model"] == "cnn" and report["layers"][1]["ranks"] == [32]
    assert report["model_params_after"] < report["model_params_before"] == 151_402


def test_summary_command_reports_bad_options(capsys) -> None:
    assert main(["lowrank", "summary", "--model", "cnn", "--rank-ratio", "1.5"]) == 2
    assert "rank_ratio" in capsys.readouterr().err
    assert main(["lowrank", "summary", "--model", "cnn", "--keep-full", "conv9"]) == 2
    assert "keep_full" in capsys.readouterr().err
