"""Run a script under ``torchrun`` (2 CPU processes, a free port, a hard timeout) and read
what each rank wrote: ``rank{r}.json`` in the folder the script gets as ``GRADWIRE_TEST_OUT``."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any, Optional, Sequence

from ..distributed import free_port

ROOT = Path(__file__).resolve().parents[2]


def torchrun(script: Path, out: Path, *args: str, nproc: int = 2, max_restarts: int = 0, timeout: float = 240,
             env: Optional[dict[str, str]] = None, unset: Sequence[str] = ()) -> subprocess.CompletedProcess:
    """``python -m torch.distributed.run`` on ``script``; raises AssertionError with the output on failure.
    ``unset``: variables of this environment the script must not see (e.g. ACCELERATE_USE_CPU)."""
    command = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
               f"--max-restarts={max_restarts}", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}",
               "--monitor-interval=0.5", str(script), *args]
    return run_script(command, out, f"torchrun {script.name}", timeout=timeout, env=env, unset=unset)


def python(script: Path, out: Path, *args: str, timeout: float = 240,
           env: Optional[dict[str, str]] = None) -> subprocess.CompletedProcess:
    """``python script`` as one plain process (no torchrun); as :func:`torchrun` otherwise."""
    return run_script([sys.executable, str(script), *args], out, script.name, timeout=timeout, env=env)


def run_script(command: list[str], out: Path, name: str, *, timeout: float, env: Optional[dict[str, str]] = None,
               unset: Sequence[str] = ()) -> subprocess.CompletedProcess:
    """Run ``command`` in ``out`` in its own session, killed with all its children after ``timeout``;
    raises AssertionError with the output (stdout and stderr together) on failure. Its temporary
    files (torchrun's ``torchelastic_*`` log folders, which it leaves behind) go to ``out/tmp``,
    removed afterwards."""
    out.mkdir(parents=True, exist_ok=True)
    scratch = out / "tmp"
    scratch.mkdir(exist_ok=True)
    try:
        return _run_in(command, out, name, timeout, scratch, env, unset)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _run_in(command: list[str], out: Path, name: str, timeout: float, scratch: Path,
            env: Optional[dict[str, str]], unset: Sequence[str]) -> subprocess.CompletedProcess:
    environment = dict(os.environ, GRADWIRE_TEST_OUT=str(out), OMP_NUM_THREADS="1", TMPDIR=str(scratch),
                       PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(ROOT), os.environ.get("PYTHONPATH", "")]),
                       **(env or {}))
    for variable in unset:
        environment.pop(variable, None)
    process = subprocess.Popen(command, cwd=out, env=environment, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, start_new_session=True)
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        raise AssertionError(f"{name} timed out after {timeout} s:\n{output[-6000:]}")
    if process.returncode != 0:
        raise AssertionError(f"{name} exited with {process.returncode}:\n{output[-6000:]}")
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
