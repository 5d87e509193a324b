"""Run a function on N real gloo processes (spawned), with a free port and a hard timeout.

Workers are killed when the timeout passes or any worker fails, so a deadlock fails the test
in seconds instead of hanging CI. Results travel back through a multiprocessing queue: these are
test-internal Python objects between our own processes, not bytes from the wire.

>>> # in a test module (the function must be importable at module level):
>>> # def worker(rank, world_size, x): return rank * x
>>> # assert run_workers(worker, 2, 10) == [0, 10]
"""

from __future__ import annotations

import datetime
import os
import socket
import traceback
from typing import Any, Callable

import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _entry(fn: Callable, rank: int, world_size: int, port: int, queue: Any, args: tuple, pg_timeout: float,
           environment: "dict[str, str] | None" = None, cwd: "str | None" = None) -> None:
    import torch
    import torch.distributed as dist

    if environment is not None:  # the test's environment at start, as a spawned worker would have it
        os.environ.clear()
        os.environ.update(environment)
    if cwd is not None:
        os.chdir(cwd)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=pg_timeout),
        )
        result = fn(rank, world_size, *args)
        queue.put((rank, True, result))
    except BaseException:  # report every failure, including KeyboardInterrupt in a worker
        queue.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    # PyTorch itself can abort at interpreter exit after gloo collectives (pytorch PR #179291):
    # hand the result over, then leave without the interpreter's teardown
    queue.close()
    queue.join_thread()
    os._exit(0)


#: what the fork server imports once, so that each worker it forks starts with it loaded
#: (importing torch took 1.6 s of a 2-rank test's 1.7 s start on 2 cores)
_PRELOAD = ["tests.worker_preload"]


def worker_context() -> Any:
    """Workers come from a fork server that has imported :data:`_PRELOAD`: each test still gets
    fresh processes, forked from a server that has run nothing but imports (no threads, no process
    group), without paying torch's import per rank. A forked worker would see the server's
    environment and working directory, not the test's: :func:`_entry` takes the test's own.
    ``GRADWIRE_TEST_SPAWN=1``: plain spawn."""
    if os.environ.get("GRADWIRE_TEST_SPAWN") == "1":
        return mp.get_context("spawn")
    context = mp.get_context("forkserver")
    context.set_forkserver_preload(_PRELOAD)
    return context


def _spawn(fn: Callable, world_size: int, args: tuple, pg_timeout: float) -> tuple[Any, list[Any]]:
    """Start ``world_size`` workers on a free port; returns (results queue, processes)."""
    context = worker_context()
    results_queue = context.Queue()
    port = free_port()
    environment, cwd = dict(os.environ), os.getcwd()
    processes = [
        context.Process(target=_entry, daemon=True,
                        args=(fn, rank, world_size, port, results_queue, args, pg_timeout, environment, cwd))
        for rank in range(world_size)
    ]
    for process in processes:
        process.start()
    return results_queue, processes


def _reap(processes: list[Any]) -> None:
    """Join every worker, killing the ones still alive after 5 s."""
    for process in processes:
        process.join(timeout=5)
        if process.is_alive():
            process.kill()
            process.join(timeout=5)


def run_workers(fn: Callable, world_size: int, *args: Any, timeout: float = 60.0,
                pg_timeout: float = 20.0) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; return results by rank.

    Raises AssertionError with the worker's traceback if any worker raises, and TimeoutError
    (after killing every worker) if they do not all finish within ``timeout`` seconds.
    """
    import queue as queue_module
    import time

    results_queue, processes = _spawn(fn, world_size, args, pg_timeout)
    results: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(results) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"workers did not finish within {timeout} s (got ranks {sorted(results)})")
            try:
                rank, ok, value = results_queue.get(timeout=min(remaining, 1.0))
            except queue_module.Empty:
                dead = [p for p in processes if p.exitcode not in (None, 0)]
                if dead and len(results) < world_size and all(p.exitcode is not None for p in processes):
                    codes = [p.exitcode for p in processes]
                    raise AssertionError(f"workers exited without a result: exit codes {codes}")
                continue
            if not ok:
                raise AssertionError(f"rank {rank} failed:\n{value}")
            results[rank] = value
    finally:
        _reap(processes)
    return [results[rank] for rank in range(world_size)]


def run_workers_some_die(fn: Callable, world_size: int, *args: Any, timeout: float = 60.0,
                         pg_timeout: float = 60.0) -> tuple[dict[int, Any], dict[int, int]]:
    """Like :func:`run_workers`, for fault tests where some workers are meant to die.

    Returns ``(results, exit_codes)``: ``results`` holds ``(ok, value)`` for every rank that
    reported (a failure's value is its traceback text), ``exit_codes`` every process's exit code.
    Raises TimeoutError (after killing every worker) unless every process has exited within
    ``timeout`` seconds.
    """
    import queue as queue_module
    import time

    results_queue, processes = _spawn(fn, world_size, args, pg_timeout)
    results: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    try:
        while any(p.exitcode is None for p in processes) or not results_queue.empty():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"workers did not all exit within {timeout} s (reported: ranks {sorted(results)})")
            try:
                rank, ok, value = results_queue.get(timeout=min(remaining, 0.5))
                results[rank] = (ok, value)
            except queue_module.Empty:
                continue
    finally:
        _reap(processes)
    return results, {rank: p.exitcode for rank, p in enumerate(processes)}


def tamper_payload(mode: str, encoded: Any, tensors: Any, encode: Callable, *args: Any, **kwargs: Any) -> Any:
    """What a faulty rank sends instead of ``encoded`` (the codecs' ``encode_tensors`` result for
    ``tensors``), for the fault tests of every front-end.

    ``mode="checksum"``: one byte flipped (the receivers' checksum fails); ``"nan"``: a valid
    payload whose first value is NaN; anything else: a valid payload whose first value differs
    from what the sender reconstructs for itself (what a flip with a recomputed checksum amounts
    to). ``encode`` is the honest ``encode_tensors``, called again with ``args``/``kwargs``.
    """
    if mode == "checksum":
        payload = bytearray(encoded.payload)
        payload[len(payload) // 2] ^= 0x40
        return type(encoded)(bytes(payload), encoded.tensors)
    values, indices, numel = tensors[0]
    changed = values.clone()
    changed[0] = float("nan") if mode == "nan" else changed[0] * 3 + 1
    forged = encode([(changed, indices, numel), *tensors[1:]], *args, **kwargs)
    return type(encoded)(forged.payload, encoded.tensors)
