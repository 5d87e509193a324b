"""``gradwire train``: spec parsing, and short real runs on 2 local gloo workers."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from typing import Sequence

import pytest

from gradwire.harness.methods import parse_method
from gradwire.harness.training import file_slug


def test_method_specs_parse() -> None:
    spec = parse_method("topk:density=0.01,values=fp16,indices=eliasfano")
    assert spec.communication.name == "topk" and spec.pufferfish is None
    assert spec.hook_options() == {"compressor": "topk", "density": 0.01, "value_codec": "fp16",
                                   "index_codec": "eliasfano"}
    combined = parse_method("pufferfish:rank_ratio=0.25,warmup_epochs=1+topk:density=0.01")
    assert combined.pufferfish.options == {"rank_ratio": 0.25, "warmup_epochs": 1}
    assert combined.communication.options == {"density": 0.01}
    assert parse_method("pufferfish").communication.name == "allreduce"
    assert parse_method("qsgd-free:k=3".replace("qsgd-free", "randomk")).hook_options()["k"] == 3
    assert parse_method("topk:values=qsgd,bits=4").hook_options()["codec_options"] == {"bits": 4}
    assert parse_method("torch-powersgd:rank=4").communication.options == {"rank": 4}
    local = parse_method("pufferfish:rank_ratio=0.5+diloco:sync_every=32,overlap=1,decay=0.9,unsent=model"
                         "+topk:density=0.03,values=qsgd-ans")
    assert local.pufferfish.options == {"rank_ratio": 0.5}
    assert local.diloco_options() == {"sync_every": 32, "overlap_steps": 1, "feedback_decay": 0.9, "unsent": "model",
                                      "compressor": "topk", "density": 0.03, "value_codec": "qsgd-ans"}
    assert parse_method("diloco:sync_every=8").diloco_options() == {"sync_every": 8}  # dense outer steps
    assert parse_method("diloco:sync_every=8+quantize:bits=4").diloco_options()["quantize"] == "int4"


@pytest.mark.parametrize("spec, message", [
    ("", "empty"),
    ("nope", "'nope' is not supported; allowed: allreduce"),
    ("topk:density", "must be key=value"),
    ("topk:colour=3", "topk has no option 'colour'; allowed: density"),
    ("topk:density=abc", "density='abc' is not a valid float"),
    ("torch-powersgd:density=0.1", "allowed: rank, start_iter"),
    ("topk+randomk", "at most one pufferfish part, one diloco part and one communication"),
    ("diloco:outer_lr=0.5", "diloco needs sync_every=N"),
    ("diloco:sync_every=4+torch-fp16", "diloco's outer step takes a gradwire compressor or quantize part"),
    ("diloco:sync_every=4+quantize:warmup_steps=3", "warmup_steps belongs to the diloco part"),
    ("diloco:sync_every=4,unsent=both", "unsent='both' is not a valid residual|model"),
    ("diloco:sync_every=4+diloco:sync_every=8", "one diloco part"),
    ("topk:ef=maybe", "not a valid true/false"),
])
def test_bad_specs_name_the_problem(spec: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_method(spec)


def _train(tmp_path, *extra: str) -> tuple[list[dict], str]:
    """Run ``gradwire train`` on 2 local workers with stderr piped; (summaries from --json, stderr)."""
    out = tmp_path / "run"
    command = [sys.executable, "-m", "gradwire", "train", "--model", "cnn", "--data", "digits", "--workers", "2",
               "--batch-size", "16", "--out", str(out), "--json", str(tmp_path / "s.json"), "--timeout", "150", *extra]
    result = subprocess.run(command, capture_output=True, text=True, timeout=200)
    assert result.returncode == 0, result.stderr[-3000:]
    summaries = json.loads((tmp_path / "s.json").read_text())
    assert json.loads((out / "summary.json").read_text())[0]["method"] == summaries[0]["method"]
    return summaries, result.stderr


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_train_smoke_every_method_family(tmp_path) -> None:
    methods = ["allreduce", "torch-fp16", "torch-powersgd:rank=2",
               "topk:density=0.05,values=fp16,indices=rice,collective=allgather",
               "randomblock:density=0.05", "pufferfish:rank_ratio=0.25,warmup_epochs=1+topk:density=0.1"]
    summaries, _ = _train(tmp_path, "--epochs", "2", "--steps-per-epoch", "4",
                          *[arg for m in methods for arg in ("--method", m)])
    assert [s["method"] for s in summaries] == methods
    by_method = {s["method"]: s for s in summaries}
    for summary in summaries:
        # evaluated after training (NaN when evaluation was skipped or the method diverged)
        assert summary["status"] == "ok" and summary["steps"] == 8 and not math.isnan(summary["test_accuracy"])
    dense = by_method["allreduce"]["bytes_per_step"]
    assert by_method["torch-fp16"]["bytes_per_step"] == pytest.approx(dense / 2)
    assert by_method["topk:density=0.05,values=fp16,indices=rice,collective=allgather"]["bytes_per_step"] < dense / 5
    puffer = by_method["pufferfish:rank_ratio=0.25,warmup_epochs=1+topk:density=0.1"]
    assert puffer["parameters"] < by_method["allreduce"]["parameters"]
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics-allreduce.jsonl").read_text().splitlines()]
    assert len(metrics) == 8 and all(not math.isnan(m["loss"]) for m in metrics)
    assert {"seconds_forward", "seconds_backward", "seconds_optimizer", "bytes_sent"} <= set(metrics[0])


@pytest.mark.distributed
@pytest.mark.timeout(150)
def test_steps_counts_total_steps_lines_per_epoch_and_json_after_each_method(tmp_path, capfd, monkeypatch) -> None:
    from gradwire.cli import train
    from gradwire.cli.main import main

    written: list[int] = []  # how many summaries each (re)write of --json held
    real_write = train._write_json
    monkeypatch.setattr(train, "_write_json", lambda path, summaries: (written.append(len(summaries)),
                                                                         real_write(path, summaries)))
    assert main(["train", "--data", "digits", "--workers", "2", "--batch-size", "16", "--no-eval", "--epochs", "3",
                 "--steps-per-epoch", "2", "--steps", "5", "--method", "allreduce", "--method", "torch-fp16",
                 "--json", str(tmp_path / "s.json"), "--timeout", "120"]) == 0
    summaries = json.loads((tmp_path / "s.json").read_text())
    assert [s["steps"] for s in summaries] == [5, 5]  # 2 + 2 + 1: --steps caps the total, not each epoch
    # checked writable first, then as results arrive (the launcher polls, so two methods may land
    # in one poll on a loaded machine), then once more at the end
    assert written[0] == 0 and written[-2:] == [2, 2] and written == sorted(written), written
    captured = capfd.readouterr()
    stderr = captured.err  # rank 0 writes to the inherited fd 2
    epoch_lines = [line for line in stderr.splitlines() if line.startswith("allreduce: epoch")]
    assert [line.split(",")[1].strip() for line in epoch_lines] == ["step 2/5", "step 4/5", "step 5/5"]
    # the table's final loss is the mean the last epoch line printed, not the last step's loss alone
    last_mean = float(epoch_lines[-1].split("mean loss ")[1].split(",")[0])
    assert summaries[0]["final_loss"] == pytest.approx(last_mean, abs=1e-4)
    assert summaries[0]["link"] == {"kind": "loopback"} and "link: loopback, unshaped" in captured.out
    assert stderr.splitlines()[0].startswith("gradwire train: 2 local workers")  # says something at once


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_the_language_model_trains_with_adamw_and_reports_held_out_loss(tmp_path) -> None:
    from gradwire.harness.pystdlib import pystdlib

    data = "pystdlib:max_bytes=65536,held_out_bytes=4096"
    methods = ["allreduce", "topk:density=0.05,values=fp16,indices=rice,collective=allgather"]
    command = [sys.executable, "-m", "gradwire", "train", "--model", "gpt", "--data", data, "--optimizer", "adamw",
               "--workers", "2", "--batch-size", "4", "--steps", "2", "--json", str(tmp_path / "s.json"),
               "--timeout", "100", *[arg for m in methods for arg in ("--method", m)]]
    result = subprocess.run(command, capture_output=True, text=True, timeout=110)
    assert result.returncode == 0, result.stderr[-3000:]
    summaries = json.loads((tmp_path / "s.json").read_text())
    assert [s["method"] for s in summaries] == methods
    fingerprint = pystdlib(max_bytes=65536, held_out_bytes=4096).fingerprint
    for summary in summaries:
        assert summary["status"] == "ok" and summary["steps"] == 2 and summary["metric"] == "loss"
        assert summary["data"]["fingerprint"] == fingerprint and summary["parameters"] == 509_248
        # 2 AdamW steps from ~ln(256) = 5.55 nats per byte: lower, and measured (not NaN)
        assert 3.0 < summary["held_out_loss"] < 5.5 and summary["held_out_loss"] == summary["test_loss"]
        config = summary["config"]
        assert (config["optimizer"], config["lr"], config["weight_decay"]) == ("adamw", 2e-3, 0.01)
    assert summaries[1]["bytes_per_step"] < summaries[0]["bytes_per_step"] / 5
    header = next(line for line in result.stdout.splitlines() if line.startswith("method"))
    assert "held-out nats/byte ↓" in header and "test acc" not in header
    assert fingerprint in result.stdout


@pytest.mark.distributed
@pytest.mark.timeout(150)
def test_train_fsdp_compresses_the_reduce_scatter_and_prints_no_torch_warnings(tmp_path) -> None:
    """``gradwire train --fsdp``: plain FSDP2 and int4 blocks after a one-step exact warm-up, on 2
    ranks. int4's bytes per step are its steady state's, about 0.133 of plain's (the warm-up step
    is the untimed one); the workers' output has none of torch 2.13's warnings about
    ``reduce_scatter_tensor`` or the root's view output (both are the harness's to avoid)."""
    methods = ["allreduce", "quantize:bits=4,warmup_steps=1"]
    command = [sys.executable, "-m", "gradwire", "train", "--fsdp", "--model", "gpt",
               "--data", "pystdlib:max_bytes=65536,held_out_bytes=4096", "--optimizer", "adamw", "--workers", "2",
               "--batch-size", "4", "--steps", "3", "--warmup-steps", "1", "--no-eval",
               "--json", str(tmp_path / "s.json"), "--timeout", "120",
               *[arg for m in methods for arg in ("--method", m)]]
    result = subprocess.run(command, capture_output=True, text=True, timeout=140)
    assert result.returncode == 0, result.stderr[-3000:]
    summaries = json.loads((tmp_path / "s.json").read_text())
    assert [s["method"] for s in summaries] == methods and all(s["status"] == "ok" for s in summaries)
    ratio = summaries[1]["bytes_per_step"] / summaries[0]["bytes_per_step"]
    assert 0.12 < ratio < 0.15, ratio
    assert "Warning" not in result.stderr, result.stderr[-3000:]


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_train_runs_local_steps_methods_and_reports_them_per_inner_step(tmp_path) -> None:
    methods = ["allreduce", "diloco:sync_every=2,warmup_steps=2",
               "diloco:sync_every=4,unsent=model+topk:density=0.1,values=qsgd-ans,indices=rice,collective=allgather",
               "diloco:sync_every=4,fragments=2,overlap=1+quantize:bits=8",
               "pufferfish:rank_ratio=0.25,warmup_epochs=1+diloco:sync_every=2"]
    summaries, _ = _train(tmp_path, "--epochs", "2", "--steps-per-epoch", "4",
                          *[arg for m in methods for arg in ("--method", m)])
    by_method = {s["method"]: s for s in summaries}
    dense = by_method["allreduce"]["bytes_per_step"]
    for method in methods[1:]:
        summary = by_method[method]
        assert summary["status"] == "ok" and summary["steps"] == 8 and not math.isnan(summary["test_accuracy"])
        assert summary["per_step"] == "mean" and summary["local_steps"]["inner_steps"] >= 4
    assert by_method[methods[1]]["local_steps"]["outer_steps"] == 3  # 2 synchronous steps, then every 2nd
    # 2 of 8 steps are DDP's AllReduce, 3 syncs of everything: (2 + 3) / 8 of DDP's bytes
    assert by_method[methods[1]]["bytes_per_step"] == pytest.approx(dense * 5 / 8, rel=0.02)
    assert by_method[methods[2]]["bytes_per_step"] < dense / 40
    # fragments: a sync every 2 steps, merged 1 step later (3 in the loop); at the end the one in flight
    # is merged (the 4th outer step) and every fragment syncs once more before the evaluation: a
    # plain average, which is not an outer step
    assert by_method[methods[3]]["local_steps"]["outer_steps"] == 4
    puffer = by_method[methods[4]]
    assert puffer["parameters"] < by_method["allreduce"]["parameters"] and puffer["local_steps"]["outer_steps"] > 0
    metrics = [json.loads(line) for line in
               (tmp_path / "run" / f"metrics-{file_slug(methods[1])}.jsonl").read_text().splitlines()]
    assert [m["bytes_sent"] > 0 for m in metrics] == [True, True, False, True, False, True, False, True]


def _diloco_resume_run(tmp_path, name: str, steps: int, *extra: str) -> dict:
    folder = tmp_path / name
    command = [sys.executable, "-m", "gradwire", "train", "--model", "cnn", "--data", "digits", "--workers", "2",
               "--batch-size", "16", "--no-eval", "--epochs", "2", "--steps-per-epoch", "6", "--steps", str(steps),
               "--method", RESUME_METHOD, "--checkpoint-dir", str(tmp_path / "ckpt" / name), "--timeout", "150",
               *extra]
    result = subprocess.run(command, capture_output=True, text=True, timeout=200, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    final = tmp_path / "ckpt" / name / file_slug(RESUME_METHOD) / f"step-{steps:06d}"
    import torch

    return {"stderr": result.stderr, "ranks": [torch.load(final / f"rank{r}.pt", weights_only=True) for r in (0, 1)],
            "folder": folder}


def _fsdp_resume_run(tmp_path, name: str, methods: Sequence[str], steps: int, *extra: str) -> dict:
    command = [sys.executable, "-m", "gradwire", "train", "--fsdp", "--model", "gpt",
               "--data", "pystdlib:max_bytes=65536,held_out_bytes=4096", "--optimizer", "adamw", "--workers", "2",
               "--batch-size", "4", "--steps", str(steps), "--warmup-steps", "1", "--no-eval",
               *[arg for method in methods for arg in ("--method", method)],
               "--checkpoint-dir", str(tmp_path / "ckpt" / name), "--timeout", "120", *extra]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    import torch

    ranks = {}
    for method in methods:
        final = tmp_path / "ckpt" / name / file_slug(method) / f"step-{steps:06d}"
        ranks[method] = [torch.load(final / f"rank{r}.pt", weights_only=True) for r in (0, 1)]
    return {"stderr": result.stderr, "ranks": ranks}


def _same(a, b) -> bool:
    """Nested state dicts of plain tensors, equal bit for bit."""
    import torch

    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


FSDP_RESUME_METHODS = ("allreduce", "topk:density=0.1,indices=rice,warmup_steps=2,momentum=0.9")


@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_train_checkpoint_dir_resumes_an_fsdp2_run_exactly(tmp_path) -> None:
    """Each rank's file holds its own shards (parameters, AdamW's or MomentumAdamW's state) and its
    gradwire state (residuals, momentum bases); a run stopped at step 3 and resumed ends at step 6
    bit for bit where one run of 6 steps ends. Plain FSDP2 and top-k with momentum, both methods in
    each launch (each has its own folder under the checkpoint directory)."""
    straight = _fsdp_resume_run(tmp_path, "straight", FSDP_RESUME_METHODS, 6)
    _fsdp_resume_run(tmp_path, "resumed", FSDP_RESUME_METHODS, 3, "--checkpoint-every", "3")
    (tmp_path / "ckpt" / "resumed-again").symlink_to(tmp_path / "ckpt" / "resumed")
    resumed = _fsdp_resume_run(tmp_path, "resumed-again", FSDP_RESUME_METHODS, 6, "--checkpoint-every", "3")
    assert resumed["stderr"].count("resumed from the checkpoint of step 3") == len(FSDP_RESUME_METHODS)
    for method in FSDP_RESUME_METHODS:
        for reference, mine in zip(straight["ranks"][method], resumed["ranks"][method]):
            assert reference["model"] and _same(mine["model"], reference["model"]), method
            assert _same(mine["optimizer"]["state"], reference["optimizer"]["state"]), method
            assert _same(mine["hook"], reference["hook"]), method
        assert not _same(straight["ranks"][method][0]["model"], straight["ranks"][method][1]["model"])  # shards


RESUME_METHOD = "diloco:sync_every=4,warmup_steps=2+topk:density=0.1,collective=allgather"


@pytest.mark.distributed
@pytest.mark.timeout(400)
def test_train_checkpoint_dir_resumes_a_diloco_run_mid_period_exactly(tmp_path) -> None:
    straight = _diloco_resume_run(tmp_path, "straight", 11)
    _diloco_resume_run(tmp_path, "resumed", 5, "--checkpoint-every", "5")  # stops mid-period (local step 3)
    (tmp_path / "ckpt" / "resumed-again").symlink_to(tmp_path / "ckpt" / "resumed")
    resumed = _diloco_resume_run(tmp_path, "resumed-again", 11)
    assert "resumed from the checkpoint of step 5" in resumed["stderr"]
    import torch

    for reference, mine in zip(straight["ranks"], resumed["ranks"]):
        for name, tensor in reference["hook"]["global"].items():  # θ, bit for bit
            assert torch.equal(mine["hook"]["global"][name], tensor), name
        for name, tensor in reference["model"].items():
            assert torch.equal(mine["model"][name], tensor), name
        assert mine["hook"]["outer_steps"] == reference["hook"]["outer_steps"] == 2


BAD_OPTIONS = [
    (["--method", "topk:density=2"], "density=2.0 must be in (0, 1]"),
    (["--method", "topk:values=fp17"], "value_codec='fp17' is not supported; allowed:"),
    (["--method", "topx"], "'topx' is not supported; allowed: allreduce"),
    (["--method", "pufferfish:rank_ratio=3"], "rank_ratio=3.0 must be in (0, 1]"),
    (["--method", "torch-powersgd:rank=0"], "rank=0 must be >= 1"),
    (["--workers", "100000"], "--workers=100000 is not supported; allowed: 1 to 64"),
    (["--workers", "0"], "--workers=0 is not supported"),
    (["--timeout", "-5"], "--timeout=-5 must be > 0"),
    (["--data", "digits", "--batch-size", "5000"], "larger than each worker's share"),
    (["--model", "nope"], "model='nope' is not supported; allowed: cnn"),
    (["--data", "imagenet"], "data='imagenet' is not supported"),
    (["--model", "lstm", "--text", "/nonexistent/file.txt"], "is not a readable file"),
    (["--model", "cnn", "--text", __file__], "--text is for lstm, transformer"),
    (["--out", "/proc/gradwire-cannot-write-here"], "is not a writable folder"),
    (["--json", "/nonexistent-folder/summary.json"], "cannot be written"),
    (["--steps", "0"], "--steps=0 must be >= 1"),
    (["--epochs", "0"], "--epochs=0 must be >= 1"),
    (["--nodes", "2"], "--nodes needs --cluster"),
    (["--show", "/nonexistent/s.json"], "cannot be read"),
    (["--optimizer", "adam"], "--optimizer='adam' is not supported; allowed: sgd, adamw"),
    (["--optimizer", "adamw", "--lr", "0"], "--lr=0.0 must be > 0"),
    (["--weight-decay", "-1"], "--weight-decay=-1.0 must be >= 0"),
    (["--model", "gpt", "--data", "pystdlib:colour=1"], "'colour=1' is not an option; allowed: max_bytes=N"),
    (["--model", "gpt", "--data", "digits"], "data='digits' is not available for gpt"),
    (["--method", "topk:density=0.1,warmup_steps=5,momentum=0.9"], "momentum= is 1-bit Adam's exchange for FSDP2"),
    (["--fsdp", "--model", "gpt", "--optimizer", "adamw", "--method", "topk:density=0.1,momentum=0.9"],
     "momentum= needs warmup_steps >= 1"),
    (["--fsdp", "--model", "gpt", "--method", "topk:density=0.1,warmup_steps=5,momentum=0.9"],
     "it needs --fsdp and --optimizer adamw"),
]


@pytest.mark.parametrize("argv, message", BAD_OPTIONS, ids=[" ".join(a) for a, _ in BAD_OPTIONS])
def test_bad_options_are_one_line_and_exit_2_before_any_worker(argv: list[str], message: str, capsys) -> None:
    from gradwire.cli.main import main

    assert main(["train", *argv]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1, captured.err
    assert captured.err.startswith("gradwire train: ") and message in captured.err, captured.err


def test_the_command_itself_exits_2_with_one_line() -> None:
    result = subprocess.run([sys.executable, "-m", "gradwire", "train", "--method", "topk:density=2"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr == "gradwire train: method 'topk:density=2': density=2.0 must be in (0, 1]\n"


def test_tables_mark_the_better_direction_and_explain_missing_cells(capsys) -> None:
    from gradwire.cli.train import MISSING, print_summary

    phases = {f"seconds_{p}": math.nan for p in ("forward", "backward", "compress", "communicate", "decompress",
                                                  "optimizer")}
    summary = {"method": "torch-powersgd:rank=2", "model": "cnn", "world_size": 2, "steps": 3, "status": "ok",
               "test_accuracy": math.nan, "final_loss": 1.0, "seconds_per_step": 0.1, "bytes_per_step": math.nan,
               "parameters": 10, "phases": phases}
    print_summary([summary])
    out = capsys.readouterr().out
    assert "nan" not in out and MISSING in out
    assert "test acc ↑" in out and "s/step ↓" in out and "MB sent/step ↓" in out
    assert "PowerSGD hook keeps no byte counter" in out and "no allreduce run to compare with" in out
    print_summary([{**summary, "metric": "loss", "held_out_loss": 1.3956, "data": {"fingerprint": "pystdlib-x"}}])
    out = capsys.readouterr().out
    assert "held-out nats/byte ↓" in out and "1.3956" in out and "test acc" not in out and "pystdlib-x" in out


def _summary(**changes) -> dict:
    phases = {f"seconds_{p}": 0.01 for p in ("forward", "backward", "compress", "communicate", "decompress",
                                              "optimizer")}
    summary = {"method": "allreduce", "model": "cnn", "world_size": 2, "steps": 3, "status": "ok",
               "test_accuracy": 0.5, "final_loss": 1.0, "seconds_per_step": 0.1, "bytes_per_step": 1e6,
               "parameters": 10, "phases": phases}
    return {**summary, **changes}


def test_final_loss_is_the_last_epochs_mean() -> None:
    from gradwire.harness.training import last_epoch_loss

    records = [{"epoch": 0, "loss": 9.0}, {"epoch": 1, "loss": 2.0}, {"epoch": 1, "loss": 1.0}]
    assert last_epoch_loss(records) == 1.5 and math.isnan(last_epoch_loss([]))


@pytest.mark.parametrize("link, shown", [({"kind": "loopback"}, True), (None, False),
                                         ({"bandwidth": "1gbit", "nodes": 1, "workers_per_node": 1}, False)],
                         ids=["local", "torchrun", "cluster"])
def test_a_local_runs_table_says_its_link_is_unshaped_loopback(link, shown: bool, capsys) -> None:
    from gradwire.cli.train import print_summary

    print_summary([_summary(link=link), _summary(method="topk:density=0.01", seconds_per_step=0.2, link=link)])
    lines = capsys.readouterr().out.splitlines()
    note = [line for line in lines if line.startswith("link: loopback")]
    assert len(note) == (1 if shown else 0)
    if shown:  # right under the first table, and it says why compression can trail allreduce
        assert lines.index(note[0]) == next(i for i, line in enumerate(lines) if line.startswith("topk")) + 1
        assert "unshaped" in note[0] and "allreduce" in note[0] and "--cluster" in note[0]
    assert "last epoch loss ↓" in "\n".join(lines)


SAVED = [
    ({"method": "allreduce"}, "holds a dict, expected a list of method summaries"),
    ([], "holds no method summaries"),
    ([{"steps": 3}], "summary 0 lacks 'method', 'model'"),
    ([_summary(), 7], "summary 1 is 7, not an object"),
    ([_summary(seconds_per_step="fast")], "a summary holds a value of the wrong kind"),
    ([_summary(phases=[1, 2])], "a summary holds a value of the wrong kind"),
]


@pytest.mark.parametrize("saved, message", SAVED, ids=["dict", "empty", "no-method", "not-a-dict", "str", "phases"])
def test_show_of_a_file_of_the_wrong_shape_is_one_line_and_exit_2(saved, message: str, tmp_path, capsys) -> None:
    from gradwire.cli.main import main

    path = tmp_path / "saved.json"
    path.write_text(json.dumps(saved))
    assert main(["train", "--show", str(path)]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1, captured.err
    assert captured.err.startswith(f"gradwire train: --show={str(path)!r} ") and message in captured.err, captured.err


def test_show_prints_a_saved_file(tmp_path, capsys) -> None:
    from gradwire.cli.main import main

    path = tmp_path / "saved.json"
    path.write_text(json.dumps([_summary(), _summary(method="topk:density=0.01", link={"kind": "loopback"})]))
    assert main(["train", "--show", str(path)]) == 0
    out = capsys.readouterr().out
    assert "topk:density=0.01" in out and "median seconds per step by phase" in out


def _help(capsys) -> str:
    from gradwire.cli.main import main

    with pytest.raises(SystemExit) as exited:
        main(["train", "--help"])
    assert exited.value.code == 0
    return capsys.readouterr().out


def test_train_help_lists_every_spec_key_the_defaults_and_examples(capsys) -> None:
    from gradwire.cli.train import EXAMPLES
    from gradwire.harness.methods import HOOK_KEYS, PUFFERFISH_KEYS, TORCH_HOOKS, TORCH_KEYS
    from gradwire.sparsify import sparsifiers

    text = " ".join(_help(capsys).split())  # argparse wraps the help: compare without line breaks
    for key in [*HOOK_KEYS, *PUFFERFISH_KEYS, *TORCH_KEYS["torch-powersgd"]]:
        assert f"{key}=" in text, key
    for name in [*TORCH_HOOKS, "pufferfish", *sparsifiers()]:
        assert name in text, name
    assert "values=ans|bf16|" in text and "collective=auto|allreduce|" in text  # the choices, from the registries
    for option, default in (("--epochs", "3"), ("--lr", "0.05"), ("--batch-size", "32")):
        assert f"(default {default})" in text.split(option, 2)[2].split("--", 1)[0], option
    assert "examples:" in text and all(command in text for command, _ in EXAMPLES)


def test_train_help_examples_are_valid_commands() -> None:
    import shlex

    from gradwire.cli.main import build_parser
    from gradwire.cli.train import EXAMPLES, check_method

    for command, _ in EXAMPLES:
        args = build_parser().parse_args(shlex.split(command)[1:])
        for spec in args.methods or []:
            check_method(spec)  # raises on a key or value the parser would refuse


def test_train_help_follows_the_spec_tables(monkeypatch, capsys) -> None:
    """The key list is read from the code: a new key shows up in the help without editing it."""
    from gradwire.harness import methods

    monkeypatch.setitem(methods.HOOK_KEYS, "probe_key", ("probe_key", int))
    assert "probe_key=int" in _help(capsys)


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as handle:
            return [int(child) for child in handle.read().split()]
    except FileNotFoundError:
        return []


@pytest.mark.skipif(not os.path.exists("/proc/self/task"), reason="needs Linux /proc")
@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
def test_stopping_the_launcher_stops_its_workers(stop: signal.Signals) -> None:
    """``kill``/``timeout`` send SIGTERM: the launcher kills its workers on the way out and removes
    its temporary folder. SIGKILL gives it no way out: the workers' parent-death signal kills them,
    and the folder it leaves is in this test's own TMPDIR, removed below."""
    command = [sys.executable, "-m", "gradwire", "train", "--model", "cnn", "--data", "digits", "--workers", "2",
               "--epochs", "50", "--no-eval", "--method", "allreduce"]
    with tempfile.TemporaryDirectory(prefix="gradwire-test-launcher-") as scratch:
        _stop_launcher_and_check_workers(command, stop, scratch)


def _stop_launcher_and_check_workers(command: list[str], stop: signal.Signals, scratch: str) -> None:
    launcher = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                env=dict(os.environ, TMPDIR=scratch))
    workers: list[int] = []
    try:
        deadline = time.monotonic() + 60
        while len(workers) < 2 and time.monotonic() < deadline and launcher.poll() is None:
            time.sleep(0.2)
            workers = _children(launcher.pid)
        assert len(workers) == 2, "workers did not start"
        time.sleep(2)  # let them get into training
        launcher.send_signal(stop)
        assert launcher.wait(timeout=30) != 0
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            alive = [pid for pid in workers if _running(pid)]
            if not alive:
                break
            time.sleep(0.2)
        assert not alive, f"workers {alive} outlived the launcher"
        if stop == signal.SIGTERM:
            left = [name for name in os.listdir(scratch) if name.startswith("gradwire-train-")]
            assert not left, f"the launcher left {left} after SIGTERM"
    finally:
        if launcher.poll() is None:
            launcher.kill()
        for pid in workers:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
