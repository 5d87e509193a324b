"""Start ``gradwire train``'s worker processes, locally or in an emulated cluster, and wait for them.

Local runs rendezvous through a file in the launch's temp folder (``file://`` store) and gloo is
pinned to the loopback interface, so a local run opens no socket on any other interface. Every
worker gets the parent-death signal (``prctl(PR_SET_PDEATHSIG, SIGKILL)``) and its own process
group: whatever stops the launcher — an exception, Ctrl-C, SIGTERM or SIGKILL — stops its
workers too.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict
from typing import Any, Callable, Iterator, Optional, Union

from ..cluster.netns import MAX_WORKERS  # one documented bound for local and emulated launches

__all__ = ["LOOPBACK", "MAX_WORKERS", "launch"]

#: the ``"link"`` kind of a local run's summaries: workers on one host talk over unshaped loopback
LOOPBACK = "loopback"

_PR_SET_PDEATHSIG = 1

ClusterArg = Union[None, tuple, Any]  # None, (bandwidth, latency), a ClusterSpec, or a running Cluster


def _die_with_parent() -> None:  # runs in the child between fork and exec
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: the process group and the finally-kill remain
        pass


def launch(config: Any, workers: int, *, timeout: float = 3600, cluster: ClusterArg = None,
           on_summaries: Optional[Callable[[list[dict[str, Any]]], None]] = None) -> list[dict[str, Any]]:
    """Run ``config`` on ``workers`` worker processes; return rank 0's summaries.

    Workers are killed on error, timeout, Ctrl-C, SIGTERM, or the launcher's own death.

    Args:
        config: the ``harness.training.TrainConfig`` every worker runs.
        workers: worker processes (ranks).
        timeout: seconds the workers may take in all.
        cluster: None (local processes on loopback); ``(bandwidth, latency)`` (a temporary
            emulated cluster with a prefix of its own, removed on every exit path); a
            :class:`~gradwire.cluster.ClusterSpec` (a temporary cluster built as given: its prefix
            must be free; see :func:`~gradwire.cluster.temporary_prefix`); or a running
            :class:`~gradwire.cluster.Cluster` (used as it is, left up).
        on_summaries: called with the summaries so far whenever rank 0 finishes a method.

    Returns:
        Rank 0's summaries, one per method. A local run's get ``"link": {"kind": "loopback"}``;
        with a cluster every summary gets ``"link"``: per-rank bytes sent and received on each
        worker's interface during this launch (every method, setup included) and, with nodes,
        the bytes that crossed each node's shaped uplink.

    Raises:
        RuntimeError: a worker failed, or none wrote a result.
        TimeoutError: the workers outlasted ``timeout``.
        ValueError: ``workers`` does not match a running cluster's.
        ClusterError: the emulated cluster could not be built.
    """
    with _terminate_as_exit(), tempfile.TemporaryDirectory(prefix="gradwire-train-") as folder:
        config_path = os.path.join(folder, "config.json")
        result_path = os.path.join(folder, "result.json")
        with open(config_path, "w") as handle:
            json.dump(asdict(config), handle)
        argv = [sys.executable, "-m", "gradwire.cli.worker", config_path, result_path]
        watcher = _ResultWatcher(result_path, on_summaries)
        if cluster is None:
            env = {"GRADWIRE_INIT_METHOD": f"file://{os.path.join(folder, 'rendezvous')}", "MASTER_ADDR": "127.0.0.1",
                   "GLOO_SOCKET_IFNAME": "lo"}
            _run_processes([argv] * workers, [env] * workers, timeout, watcher.poll)
            link = {"kind": LOOPBACK}  # the tables say so: an unshaped link makes compression look slow
        else:
            link = _launch_in_cluster(argv, workers, cluster, timeout, watcher.poll, folder)
        watcher.poll()
        if watcher.summaries is None:
            raise RuntimeError("the workers exited without writing a result")
        summaries = watcher.summaries
        if link is not None:
            for summary in summaries:
                summary["link"] = link
        return summaries


def _launch_in_cluster(argv: list[str], workers: int, cluster: ClusterArg, timeout: float,
                       poll: Callable[[], None], folder: str) -> dict[str, Any]:
    from ..cluster import Cluster, ClusterSpec, temporary_prefix, up

    if isinstance(cluster, Cluster):
        context: Any = contextlib.nullcontext(cluster)
    else:
        # a tuple gets a prefix of its own, so concurrent runs never collide; a spec is built as
        # given. The state file names this launcher as owner and the temp folder, so
        # `gradwire cluster down` cleans up after a SIGKILL
        spec = cluster if isinstance(cluster, ClusterSpec) else ClusterSpec(
            workers=workers, bandwidth=cluster[0], latency=cluster[1], prefix=temporary_prefix())
        context = up(spec, owner_pid=os.getpid(), temp_dir=folder)
    with context as emulated:
        if emulated.spec.workers != workers:
            raise ValueError(f"workers={workers} does not match the cluster's {emulated.spec.workers} workers")
        start = emulated.counters()
        # torchrun's names for the placement, so node-aware code (hierarchical exchange) sees the
        # emulated nodes: rank r is local rank r % per_node on node r // per_node
        per_node = emulated.spec.workers_per_node
        env = [{"MASTER_ADDR": emulated.master_addr, "GLOO_SOCKET_IFNAME": emulated.interface(r),
                "LOCAL_RANK": str(r % per_node), "LOCAL_WORLD_SIZE": str(per_node), "GROUP_RANK": str(r // per_node),
                # per-method wire bytes (training.py reads them between barriers)
                "GRADWIRE_WIRE_INTERFACE": emulated.interface(r)}
               for r in range(workers)]
        if per_node > 1:
            from ..cluster.netns import node_namespace, uplink_name

            for r in range(workers):
                node = r // per_node
                env[r]["GRADWIRE_NODE_LINK"] = (f"{node_namespace(emulated.spec.prefix, node)}:"
                                                f"{uplink_name(emulated.spec.prefix, node)}")
        _run_processes([emulated.wrap(rank, argv) for rank in range(workers)], env, timeout, poll)
        end = emulated.counters()
    link = {"prefix": emulated.spec.prefix, "bandwidth": emulated.spec.bandwidth, "latency": emulated.spec.latency,
            "latency_emulated": emulated.latency_emulated, "nodes": emulated.spec.nodes,
            "workers_per_node": emulated.spec.workers_per_node}
    for key, values in end.items():
        link[key] = [after - before for after, before in zip(values, start[key])]
    # the old key, kept for readers of earlier JSON (bench e2e, tests)
    link["launch_bytes_sent_by_rank"] = link["tx_bytes"]
    return link


class _ResultWatcher:
    """Reads rank 0's result file whenever it changes and hands the summaries on."""

    def __init__(self, path: str, callback: Optional[Callable[[list[dict[str, Any]]], None]]) -> None:
        self.path, self.callback = path, callback
        self.summaries: Optional[list[dict[str, Any]]] = None
        self._seen: Optional[tuple[int, int]] = None

    def poll(self) -> None:
        try:
            info = os.stat(self.path)
        except FileNotFoundError:
            return
        if (info.st_mtime_ns, info.st_size) == self._seen:
            return
        self._seen = (info.st_mtime_ns, info.st_size)
        with open(self.path) as handle:  # the worker renames a complete file into place
            self.summaries = json.load(handle)
        if self.callback is not None:
            self.callback(self.summaries)


@contextlib.contextmanager
def _terminate_as_exit() -> Iterator[None]:
    """Turn SIGTERM (``kill``, ``timeout``, job schedulers) into SystemExit while launching, so the
    clean-up that Ctrl-C gets (workers killed, namespaces removed) runs for it too. Python's
    default for SIGTERM is to die on the spot."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _run_processes(commands: list[list[str]], envs: list[dict[str, str]], timeout: float,
                   poll: Callable[[], None]) -> None:
    port = str(_free_port())
    processes: list[subprocess.Popen] = []
    try:
        for rank, command in enumerate(commands):
            env = dict(os.environ, MASTER_PORT=port, RANK=str(rank), WORLD_SIZE=str(len(commands)),
                       LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(len(commands)), GROUP_RANK="0",
                       OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
            env.update(envs[rank])
            processes.append(subprocess.Popen(command, env=env, start_new_session=True, preexec_fn=_die_with_parent))
        deadline = time.monotonic() + timeout
        while True:
            poll()
            codes = [p.poll() for p in processes]
            failed = [(rank, code) for rank, code in enumerate(codes) if code not in (None, 0)]
            if failed:
                raise RuntimeError(f"worker {failed[0][0]} exited with code {failed[0][1]}; see its output above")
            if all(code == 0 for code in codes):
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"workers did not finish within {timeout:.0f} s")
            time.sleep(0.2)
    finally:
        for process in processes:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGTERM)
        for process in processes:
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
