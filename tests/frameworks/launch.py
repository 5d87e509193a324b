"""Run a script under ``torchrun`` (2 CPU processes, a free port, a hard timeout) and read
what each rank wrote: ``rank{r}.json`` in the folder the script gets as ``GRADWIRE_TEST_OUT``."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any, Optional

from ..distributed import free_port

ROOT = Path(__file__).resolve().parents[2]


def torchrun(script: Path, out: Path, *args: str, nproc: int = 2, max_restarts: int = 0, timeout: float = 240,
             env: Optional[dict[str, str]] = None) -> subprocess.CompletedProcess:
    """``python -m torch.distributed.run`` on ``script``; raises AssertionError with the output on failure."""
    out.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
               f"--max-restarts={max_restarts}", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}",
               "--monitor-interval=0.5", str(script), *args]
    environment = dict(os.environ, GRADWIRE_TEST_OUT=str(out), OMP_NUM_THREADS="1",
                       PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(ROOT), os.environ.get("PYTHONPATH", "")]),
                       **(env or {}))
    process = subprocess.Popen(command, cwd=out, env=environment, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, start_new_session=True)
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        raise AssertionError(f"torchrun {script.name} timed out after {timeout} s:\n{output[-6000:]}")
    if process.returncode != 0:
        raise AssertionError(f"torchrun {script.name} exited with {process.returncode}:\n{output[-6000:]}")
    return subprocess.CompletedProcess(command, 0, output, "")


def results(out: Path, nproc: int = 2) -> list[dict[str, Any]]:
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(nproc)]


def write_result(result: dict[str, Any], *, run_exit_handlers: bool = False) -> None:
    """A worker script's last call: write this rank's findings as JSON, tear the process group down
    and leave with ``os._exit(0)``. PyTorch itself can abort at interpreter exit after gloo
    collectives (pytorch PR #179291), with no gradwire code involved; skipping the interpreter's
    teardown keeps every run's exit status honest. ``run_exit_handlers``: run the ``atexit``
    handlers first (a test of what a script prints at exit)."""
    import atexit

    import torch.distributed as dist

    rank = int(os.environ["RANK"])
    with open(os.path.join(os.environ["GRADWIRE_TEST_OUT"], f"rank{rank}.json"), "w") as handle:
        json.dump(result, handle)
        handle.flush()
        os.fsync(handle.fileno())
    if run_exit_handlers:
        atexit._run_exitfuncs()
    if dist.is_initialized():
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
