"""``gradwire train``: spec parsing, and short real runs on 2 local gloo workers."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time

import pytest

from gradwire.methods import parse_method


def test_method_specs_parse() -> None:
    spec = parse_method("topk:density=0.01,values=fp16,indices=eliasfano")
    assert spec.communication.name == "topk" and spec.pufferfish is None
    assert spec.hook_options() == {"compressor": "topk", "density": 0.01, "value_codec": "fp16", "index_codec": "eliasfano"}
    combined = parse_method("pufferfish:rank_ratio=0.25,warmup_epochs=1+topk:density=0.01")
    assert combined.pufferfish.options == {"rank_ratio": 0.25, "warmup_epochs": 1}
    assert combined.communication.options == {"density": 0.01}
    assert parse_method("pufferfish").communication.name == "allreduce"
    assert parse_method("qsgd-free:k=3".replace("qsgd-free", "randomk")).hook_options()["k"] == 3
    assert parse_method("topk:values=qsgd,bits=4").hook_options()["codec_options"] == {"bits": 4}
    assert parse_method("torch-powersgd:rank=4").communication.options == {"rank": 4}


@pytest.mark.parametrize("spec, message", [
    ("", "empty"),
    ("nope", "'nope' is not supported; allowed: allreduce"),
    ("topk:density", "must be key=value"),
    ("topk:colour=3", "topk has no option 'colour'; allowed: density"),
    ("topk:density=abc", "density='abc' is not a valid float"),
    ("torch-powersgd:density=0.1", "allowed: rank, start_iter"),
    ("topk+randomk", "at most one pufferfish part with one communication"),
    ("topk:ef=maybe", "not a valid true/false"),
])
def test_bad_specs_name_the_problem(spec: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_method(spec)


def _train(tmp_path, *extra: str) -> list[dict]:
    out = tmp_path / "run"
    command = [sys.executable, "-m", "gradwire", "train", "--model", "cnn", "--data", "digits", "--workers", "2",
               "--steps", "4", "--batch-size", "16", "--out", str(out), "--json", str(tmp_path / "s.json"),
               "--timeout", "150", *extra]
    result = subprocess.run(command, capture_output=True, text=True, timeout=200)
    assert result.returncode == 0, result.stderr[-3000:]
    summaries = json.loads((tmp_path / "s.json").read_text())
    assert json.loads((out / "summary.json").read_text())[0]["method"] == summaries[0]["method"]
    return summaries


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_train_smoke_every_method_family(tmp_path) -> None:
    methods = ["allreduce", "torch-fp16", "torch-powersgd:rank=2", "topk:density=0.05,values=fp16,indices=rice",
               "randomblock:density=0.05", "pufferfish:rank_ratio=0.25,warmup_epochs=1+topk:density=0.1"]
    summaries = _train(tmp_path, "--epochs", "2", *[arg for m in methods for arg in ("--method", m)])
    assert [s["method"] for s in summaries] == methods
    by_method = {s["method"]: s for s in summaries}
    for summary in summaries:
        assert summary["status"] == "ok" and summary["steps"] == 8 and 0.0 <= summary["test_accuracy"] <= 1.0
    dense = by_method["allreduce"]["bytes_per_step"]
    assert by_method["torch-fp16"]["bytes_per_step"] == pytest.approx(dense / 2)
    assert by_method["topk:density=0.05,values=fp16,indices=rice"]["bytes_per_step"] < dense / 5
    puffer = by_method["pufferfish:rank_ratio=0.25,warmup_epochs=1+topk:density=0.1"]
    assert puffer["parameters"] < by_method["allreduce"]["parameters"]
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics-allreduce.jsonl").read_text().splitlines()]
    assert len(metrics) == 8 and all(not math.isnan(m["loss"]) for m in metrics)
    assert {"seconds_forward", "seconds_backward", "seconds_optimizer", "bytes_sent"} <= set(metrics[0])


def test_train_rejects_bad_options(tmp_path) -> None:
    result = subprocess.run([sys.executable, "-m", "gradwire", "train", "--method", "topk:density=2"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode != 0 and "density" in result.stderr


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as handle:
            return [int(child) for child in handle.read().split()]
    except FileNotFoundError:
        return []


@pytest.mark.skipif(not os.path.exists("/proc/self/task"), reason="needs Linux /proc")
def test_sigterm_stops_the_launcher_and_its_workers() -> None:
    """``kill``/``timeout`` send SIGTERM; the launcher must still kill its workers on the way out."""
    command = [sys.executable, "-m", "gradwire", "train", "--model", "cnn", "--data", "digits", "--workers", "2",
               "--epochs", "50", "--no-eval", "--method", "allreduce"]
    launcher = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    workers: list[int] = []
    try:
        deadline = time.monotonic() + 60
        while len(workers) < 2 and time.monotonic() < deadline and launcher.poll() is None:
            time.sleep(0.2)
            workers = _children(launcher.pid)
        assert len(workers) == 2, "workers did not start"
        time.sleep(2)  # let them get into training
        launcher.send_signal(signal.SIGTERM)
        assert launcher.wait(timeout=30) != 0
        time.sleep(0.5)
        alive = [pid for pid in workers if os.path.exists(f"/proc/{pid}") and
                 open(f"/proc/{pid}/stat").read().split()[2] != "Z"]
        assert not alive, f"workers {alive} outlived the launcher"
    finally:
        if launcher.poll() is None:
            launcher.kill()
        for pid in workers:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
