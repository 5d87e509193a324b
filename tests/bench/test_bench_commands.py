"""The benchmark commands run end to end on small inputs and write what they promise."""

from __future__ import annotations

import json
import math
import time

import pytest
import torch

from gradwire.cli.main import main


def test_bench_codecs_small(tmp_path, capsys) -> None:
    out = tmp_path / "codecs.json"
    code = main(["bench", "codecs", "--numel", "65536", "--sources", "synthetic", "--densities", "0.01",
                 "--index-codecs", "rice,raw", "--value-codecs", "fp16", "--repeats", "1", "--json", str(out)])
    assert code == 0
    rows = json.loads(out.read_text())["rows"]
    by_codec = {row["codec"]: row for row in rows}
    assert set(by_codec) == {"rice", "raw", "fp16"}
    assert by_codec["raw"]["bits_per_index"] == pytest.approx(32.0, abs=0.1)
    assert by_codec["rice"]["ratio_to_bound"] < 1.05
    assert by_codec["fp16"]["bits_per_value"] == 16.0
    assert "rice" in capsys.readouterr().out


@pytest.mark.timeout(180)
def test_bench_codecs_runs_with_its_default_sources(tmp_path, capsys) -> None:
    """Every default source and table, as a user's first run would (only --repeats is lowered, to
    keep it short): the LSTM pairs table decodes the library's own Bloom payloads of its largest
    parameters, which the payload-size budget refuses without a max_numel."""
    from gradwire.bench.codec_workloads import LSTM_PAIRS
    from gradwire.bench.codecs import SOURCES

    out = tmp_path / "codecs.json"
    assert main(["bench", "codecs", "--repeats", "1", "--json", str(out)]) == 0
    saved = json.loads(out.read_text())
    assert {row["source"] for row in saved["rows"]} == set(SOURCES) - {"embedding", "curvefit", "lossless"}
    pairs = {row["pair"]: row for row in saved["lstm_pairs"]}
    assert set(pairs) == {label for label, *_ in LSTM_PAIRS}
    # Bloom's payload is smaller than COO's and its false positives cost accuracy, not nothing
    assert 0.1 < pairs["bloom + fp32"]["relative_volume"] < pairs["raw + fp32"]["relative_volume"]
    assert pairs["bloom + fp32"]["relative_l2_error"] > 0.0 and pairs["rice + fp32"]["relative_l2_error"] == 0.0
    assert saved["embedding"] and saved["curvefit"] and saved["lossless"]
    printed = capsys.readouterr().out
    assert "lstm LM" in printed and f"wrote {out}" in printed


@pytest.mark.parametrize("arguments, option, allowed", [
    (["--numel", "0"], "--numel=0", "allowed: an integer >= 1"),
    (["--densities", "0"], "--densities='0'", "allowed: comma-separated numbers in (0, 1]"),
    (["--densities", "0.1,abc"], "--densities='0.1,abc'", "in (0, 1]"),
    (["--index-codecs", "nope"], "--index-codecs='nope': unknown nope", "rice"),
    (["--value-codecs", "fp16,nope"], "--value-codecs='fp16,nope': unknown nope", "qsgd-ans"),
    (["--sources", "lstm,nope"], "--sources='lstm,nope': unknown nope", "synthetic, mnist, lstm"),
    (["--repeats", "0"], "--repeats=0", "allowed: an integer >= 1"),
    (["--lstm-density", "1.5"], "--lstm-density=1.5", "(0, 1]"),
])
def test_bench_codecs_input_errors_are_one_line_and_exit_2(tmp_path, capsys, arguments, option, allowed) -> None:
    out = tmp_path / "codecs.json"
    assert main(["bench", "codecs", *arguments, "--json", str(out)]) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"gradwire bench codecs: {option}"), captured.err
    assert allowed in lines[0] and "Traceback" not in captured.err
    assert captured.out == "" and not out.exists()  # refused before any work


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_bench_e2e_local_writes_report_and_plots(tmp_path) -> None:
    out = tmp_path / "e2e"
    code = main(["bench", "e2e", "--local", "--model", "cnn", "--data", "digits", "--workers", "2",
                 "--steps", "2", "--warmup-steps", "1", "--batch-size", "16", "--method", "allreduce",
                 "--method", "topk:density=0.05,values=fp16,indices=rice", "--out", str(out), "--timeout", "200",
                 "--rounds", "2"])
    assert code == 0
    results = json.loads((out / "results.json").read_text())
    assert [row["method"] for row in results["rows"]] == ["allreduce", "topk:density=0.05,values=fp16,indices=rice"]
    for row in results["rows"]:
        assert row["floor_seconds"] > 0 and not math.isnan(row["communication_overhead"])
        assert row["rounds"] == 2 and len(row["seconds_per_step_by_round"]) == 2
        # the reported time is the rounds' median (two rounds: their mean), not one round's
        assert row["seconds_per_step"] == pytest.approx(sum(row["seconds_per_step_by_round"]) / 2)
        # each round's run keeps its steps (warm-up and measured), the median's raw material
        paths = row["metrics_path_by_round"]
        assert len(set(paths)) == 2 and all(f"round{i + 1}" in path for i, path in enumerate(paths))
        for path, seconds in zip(paths, row["seconds_per_step_by_round"]):
            records = [json.loads(line) for line in open(path)]
            assert [r["step"] for r in records] == [0, 1, 2] and {r["method"] for r in records} == {row["method"]}
            measured = sorted(r["seconds_step"] for r in records[1:])
            assert seconds == pytest.approx(sum(measured) / 2)  # the round's median, over the measured steps
    allreduce, topk = results["rows"]
    # top-k's ratio is taken against the AllReduce row of the same run, not against itself
    assert topk["ratio_to_allreduce"] == pytest.approx(topk["seconds_per_step"] / allreduce["seconds_per_step"])
    report = (out / "report.md").read_text()
    assert "2 workers, loopback" in report
    for name in ("phases-2w-loopback.png", "speedup.png", "bytes.png"):
        assert (out / name).stat().st_size > 1000 and name in report


@pytest.mark.parametrize("model, workers, steps", [("resnet18", 2, 30), ("resnet18", 4, 30), ("mlp", 2, 46),
                                                   ("cnn", 3, 5)])
def test_bench_e2e_makes_synthetic_data_for_every_step_after_the_held_out_split(model, workers, steps) -> None:
    # ResNet-18's 30-step runs used to stop at 24: the images were sized without the held-out split
    from gradwire.bench.e2e import _synthetic_size
    from gradwire.harness.workloads import build_workload

    batch = 32
    workload = build_workload(model, "synthetic", synthetic_size=_synthetic_size(batch, workers, steps))
    assert len(workload.train) // (batch * workers) >= steps


def test_accuracy_table_over_seeds() -> None:
    from gradwire.bench.e2e import accuracy_by_method, format_accuracy

    runs = [{"method": "allreduce", "test_accuracy": a} for a in (0.97, 0.95)]
    runs += [{"method": "topk", "test_accuracy": 0.96}, {"method": "topk", "test_accuracy": 0.0, "status": "diverged"},
             {"method": "topk", "test_accuracy": 0.92}]
    table = {row["method"]: row for row in accuracy_by_method(runs)}
    assert table["allreduce"]["mean"] == pytest.approx(0.96)
    assert table["allreduce"]["std"] == pytest.approx(0.0141421, rel=1e-4)
    assert table["topk"]["accuracies"] == [0.96, 0.92]  # the diverged run is counted apart
    assert table["topk"]["points_vs_allreduce"] == pytest.approx(-2.0)
    assert "1 failed" in format_accuracy(runs)


def test_bench_hostile_small(tmp_path, capsys) -> None:
    out = tmp_path / "hostile.json"
    code = main(["bench", "hostile", "--mutations", "60", "--no-hand-made", "--json", str(out)])
    report = json.loads(out.read_text())
    assert code == 0 and not report["failures"]
    total = report["rows"][-1]
    assert total[0] == "all (no opt-in)" and int(total[1]) == 60
    assert int(total[3]) + int(total[4]) == 60  # refused + decoded: nothing else
    assert "max traced MiB" in capsys.readouterr().out


@pytest.mark.parametrize("command", ["codecs", "hook", "lowrank", "sparsify", "hostile"])
def test_an_unwritable_json_path_is_refused_before_measuring(command: str, tmp_path, capsys) -> None:
    started = time.perf_counter()
    assert main(["bench", command, "--json", str(tmp_path / "missing" / "out.json")]) == 2
    assert time.perf_counter() - started < 5  # no measuring ran first
    message = capsys.readouterr().err.strip().splitlines()
    assert len(message) == 1 and "--json=" in message[0] and "cannot be written" in message[0], message


def test_bench_hook_takes_distinct_gradients_in_turn(tmp_path, capsys) -> None:
    """Each step copies the next of ``--batches`` real gradients (one repeated would give the
    sparse AllReduce's threshold search last step's threshold for free); every entry is selected
    once per step."""
    from gradwire.bench import hook

    sets = hook._gradients("mlp", 3)
    assert len(sets) == 3 and all(len(s) == len(sets[0]) for s in sets)
    assert not torch.equal(sets[0][0], sets[1][0]) and not torch.equal(sets[1][0], sets[2][0])
    out = tmp_path / "hook.json"
    code = main(["bench", "hook", "--models", "mlp", "--methods",
                 "topk:density=0.01,values=fp16,indices=rice,collective=sparse-allreduce",
                 "--repeats", "3", "--warmup", "1", "--batches", "3", "--json", str(out)])
    report = json.loads(out.read_text())
    assert code == 0 and report["batches"] == 3
    (row,) = report["rows"]
    assert row["count_selections_per_step"] == len(sets[0])  # one selection per entry (one bucket's worth)
    assert row["hook_ms"] > 0 and row["floor_ms"] > 0
    assert "3 distinct gradient(s) in turn" in capsys.readouterr().out


def test_bench_hook_refuses_no_batches(capsys) -> None:
    assert main(["bench", "hook", "--batches", "0"]) == 2
    message = capsys.readouterr().err.strip().splitlines()
    assert len(message) == 1 and "--batches=0 >= 1" in message[0], message
