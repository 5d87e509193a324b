"""``gradwire train`` under ``torchrun --max-restarts`` (the README's examples/torchrun.sh): one
worker is killed with SIGKILL mid-run, torchrun restarts the job, it resumes from its last
checkpoint with every rank's residuals and ends with the parameters of an uninterrupted run; the
metrics hold every step exactly once. The same for a DiLoCo method killed mid-period."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from gradwire.harness.training import file_slug

from ..distributed import free_port
from .launch import ROOT

pytestmark = [pytest.mark.frameworks, pytest.mark.distributed]

SCRIPT = ROOT / "examples" / "torchrun.sh"
METHOD = "topk:density=0.01,values=fp16,indices=rice,collective=allgather"  # the script's method
LOCAL = "diloco:sync_every=4,warmup_steps=3+topk:density=0.05,collective=allgather"  # added after it
STEPS_PER_EPOCH, EPOCHS, EVERY = 10, 3, 5  # synthetic: 64 batches of 16 per rank and epoch


def _command(folder: Path, extra: tuple[str, ...] = ()) -> list[str]:
    return ["bash", str(SCRIPT), "--model", "cnn", "--data", "synthetic", "--epochs", str(EPOCHS),
            "--steps-per-epoch", str(STEPS_PER_EPOCH), "--batch-size", "16", "--no-eval", "--out", str(folder / "out"),
            "--checkpoint-every", str(EVERY), *extra]  # the last --checkpoint-every wins over the script's


def _children(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as handle:
                    fields = handle.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                found.append(int(entry))
    return found


def _run(folder: Path, kill_after_step: int | None, method: str = METHOD,
         extra: tuple[str, ...] = ()) -> tuple[str, dict]:
    (folder / "tmp").mkdir(exist_ok=True)  # torchrun's torchelastic_* folders, which it leaves, go here
    env = dict(os.environ, OMP_NUM_THREADS="1", TMPDIR=str(folder / "tmp"), PORT=str(free_port()),
               CKPT=str(folder / "ckpt"), NODES="1", PROCS="2", HEAD="127.0.0.1",
               PATH=os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")]),
               PYTHONPATH=os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]))
    process = subprocess.Popen(_command(folder, extra), cwd=folder, env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    killed: dict = {}

    def kill_one_worker() -> None:
        marker = folder / "ckpt" / file_slug(method) / f"step-{kill_after_step:06d}" / "COMPLETE"
        deadline = time.monotonic() + 200
        while not marker.exists() and process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        workers = _children(process.pid)
        if workers and process.poll() is None:
            os.kill(max(workers), signal.SIGKILL)
            killed["pid"] = max(workers)

    watcher = threading.Thread(target=kill_one_worker, daemon=True) if kill_after_step else None
    if watcher:
        watcher.start()
    try:
        output, _ = process.communicate(timeout=400)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        raise AssertionError(f"torchrun timed out:\n{output[-5000:]}")
    (folder / "torchrun.log").write_text(output)
    assert process.returncode == 0, "".join(line + "\n" for line in output.splitlines()
                                            if "Error" in line or "error" in line)[-4000:] + output[-3000:]
    if watcher:
        watcher.join(timeout=5)
    return output, killed


def _final(folder: Path, method: str = METHOD) -> dict:
    path = folder / "ckpt" / file_slug(method) / f"step-{EPOCHS * STEPS_PER_EPOCH:06d}"
    return {rank: torch.load(path / f"rank{rank}.pt", weights_only=True) for rank in (0, 1)}


def _metrics(folder: Path) -> list[dict]:
    lines = (folder / "out" / f"metrics-{file_slug(METHOD)}.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


@pytest.mark.timeout(900)
def test_sigkilled_worker_restarts_and_ends_as_an_uninterrupted_run(tmp_path: Path) -> None:
    assert f"--method {METHOD}" in SCRIPT.read_text()
    straight, interrupted = tmp_path / "straight", tmp_path / "interrupted"
    straight.mkdir(), interrupted.mkdir()
    _run(straight, None)
    output, killed = _run(interrupted, kill_after_step=EVERY)
    assert killed, "the run ended before a worker could be killed"
    assert "resumed from the checkpoint of step " in output, output[-3000:]

    reference, resumed = _final(straight), _final(interrupted)
    for rank in (0, 1):
        for name, tensor in reference[rank]["model"].items():
            torch.testing.assert_close(resumed[rank]["model"][name], tensor, rtol=1e-5, atol=1e-6)
        # every rank's own residuals came through the restart (they differ between ranks)
        for name, tensor in reference[rank]["hook"]["residuals"].items():
            torch.testing.assert_close(resumed[rank]["hook"]["residuals"][name], tensor, rtol=1e-4, atol=1e-6)
        assert resumed[rank]["hook"]["rank"] == rank
    assert any(not torch.equal(reference[0]["hook"]["residuals"][n], reference[1]["hook"]["residuals"][n])
               for n in reference[0]["hook"]["residuals"])

    steps = [record["step"] for record in _metrics(interrupted)]
    assert steps == list(range(EPOCHS * STEPS_PER_EPOCH))  # no step lost, none repeated
    losses = [record["loss"] for record in _metrics(straight)]
    assert [record["loss"] for record in _metrics(interrupted)] == pytest.approx(losses, rel=1e-5, abs=1e-6)


@pytest.mark.timeout(900)
def test_a_worker_killed_mid_diloco_period_restarts_and_ends_with_the_uninterrupted_global_parameters(
        tmp_path: Path) -> None:
    straight, interrupted = tmp_path / "straight", tmp_path / "interrupted"
    straight.mkdir(), interrupted.mkdir()
    _run(straight, None, extra=("--method", LOCAL))
    # the DiLoCo method runs second; its step 5 is local step 2 of a period of 4 (after 3 warm-up
    # steps): the checkpoint holds θ, the outer optimizer, residuals and the step in the period
    output, killed = _run(interrupted, kill_after_step=EVERY, method=LOCAL, extra=("--method", LOCAL))
    assert killed and "resumed from the checkpoint of step " in output, output[-3000:]
    for reference, mine in zip(_final(straight, LOCAL).values(), _final(interrupted, LOCAL).values()):
        assert mine["hook"]["outer_steps"] == reference["hook"]["outer_steps"] > 0
        for name, tensor in reference["hook"]["global"].items():
            torch.testing.assert_close(mine["hook"]["global"][name], tensor, rtol=1e-5, atol=1e-6)
        for name, tensor in reference["model"].items():
            torch.testing.assert_close(mine["model"][name], tensor, rtol=1e-5, atol=1e-6)
