"""``gradwire train``: train a model with one or more methods and print how they compare.

With no options: the small CNN on MNIST-5k over 2 local worker processes, dense AllReduce vs
top-k 1% with fp16 values and Rice-coded indices, three epochs each. Under ``torchrun`` it runs as
one rank of the job torchrun started (``torchrun --nnodes ... -m gradwire train ...``).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict
from typing import Any, Iterator, Optional

from ..tables import format_table

_LAUNCHES = itertools.count()
DEFAULT_METHODS = ["allreduce", "topk:density=0.01,values=fp16,indices=rice"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--method", action="append", dest="methods", metavar="SPEC",
                        help="repeatable; e.g. allreduce, torch-fp16, torch-powersgd:rank=4, "
                             "topk:density=0.01,values=fp16,indices=eliasfano, randomblock:density=0.01, "
                             "pufferfish:rank_ratio=0.25,warmup_epochs=1 (default: allreduce and topk 1%%)")
    parser.add_argument("--model", default="cnn", help="cnn, resnet18, vgg19, lstm, transformer (default cnn)")
    parser.add_argument("--data", default=None, help="mnist5k, digits, synthetic (default: mnist5k for cnn, synthetic otherwise)")
    parser.add_argument("--text", default=None, metavar="PATH", help="a local text file for lstm/transformer (byte-level)")
    parser.add_argument("--workers", type=int, default=2, help="local worker processes (ignored under torchrun)")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=None, dest="steps_per_epoch", help="cap on steps per epoch")
    parser.add_argument("--warmup-steps", type=int, default=0, help="steps left out of the per-step medians")
    parser.add_argument("--batch-size", type=int, default=32, help="per worker")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    parser.add_argument("--compute-only", action="store_true", help="forward+backward under no_sync(): no communication")
    parser.add_argument("--no-eval", action="store_true", help="skip the test-set evaluation")
    parser.add_argument("--out", default=None, metavar="DIR", help="write metrics-*.jsonl and summary.json here")
    parser.add_argument("--checkpoint-dir", default=None, metavar="DIR",
                        help="save model, optimizer and every rank's hook state here (and resume from the latest "
                             "on start, e.g. after a torchrun --max-restarts restart)")
    parser.add_argument("--checkpoint-every", type=int, default=0, metavar="N",
                        help="with --checkpoint-dir: also every N steps (default: only at the end)")
    parser.add_argument("--cluster", action="store_true",
                        help="run each worker in its own network namespace behind a rate-limited link (root)")
    parser.add_argument("--bandwidth", default="1gbit", help="with --cluster: link rate, e.g. 100mbit, 1gbit")
    parser.add_argument("--latency", default="0.5ms", help="with --cluster: one-way link latency")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds before the workers are stopped")
    parser.add_argument("--json", default=None, metavar="PATH", help="also write the summaries as JSON")
    parser.add_argument("--show", default=None, metavar="PATH", help="print the tables of a saved --json file and exit")


def config_from_args(args: argparse.Namespace) -> Any:
    from ..training import TrainConfig

    config = TrainConfig(
        methods=args.methods or list(DEFAULT_METHODS), model=args.model, data=args.data, text=args.text,
        epochs=args.epochs, steps_per_epoch=args.steps_per_epoch, warmup_steps=args.warmup_steps,
        batch_size=args.batch_size, lr=args.lr, seed=args.seed, threads=args.threads,
        evaluate=not args.no_eval, compute_only=args.compute_only, out=args.out,
        checkpoint_dir=args.checkpoint_dir, checkpoint_every=args.checkpoint_every,
        progress=sys.stderr.isatty(),
    )
    config.validate()
    return config


def run(args: argparse.Namespace) -> int:
    if args.show:
        with open(args.show) as handle:
            print_summary(json.load(handle))
        return 0
    config = config_from_args(args)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        summaries = _run_under_torchrun(config)
    else:
        if args.workers < 1:
            raise ValueError(f"--workers={args.workers} must be >= 1")
        summaries = launch(config, args.workers, timeout=args.timeout,
                           cluster=(args.bandwidth, args.latency) if args.cluster else None)
    if summaries is not None:
        print_summary(summaries)
        if args.json:
            with open(args.json, "w") as handle:
                json.dump(summaries, handle, indent=1, default=str)
    return 0


def _run_under_torchrun(config: Any) -> Optional[list[dict[str, Any]]]:
    import torch
    import torch.distributed as dist

    from ..resume import init_process_group
    from ..training import run_rank

    use_cuda = torch.cuda.is_available()
    if use_cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    init_process_group("nccl" if use_cuda else "gloo")  # a store prefix per torchrun restart
    try:
        summaries = run_rank(config)
        return summaries if dist.get_rank() == 0 else None
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch(config: Any, workers: int, *, timeout: float = 3600,
           cluster: Optional[tuple[str, str]] = None) -> list[dict[str, Any]]:
    """Start ``workers`` worker processes (in network namespaces with ``cluster=(bandwidth,
    latency)``), wait for them, and return rank 0's summaries. Workers are killed on error,
    timeout, Ctrl-C or SIGTERM; the namespaces are removed in every case."""
    with _terminate_as_exit(), tempfile.TemporaryDirectory(prefix="gradwire-train-") as folder:
        config_path = os.path.join(folder, "config.json")
        result_path = os.path.join(folder, "result.json")
        with open(config_path, "w") as handle:
            json.dump(asdict(config), handle)
        argv = [sys.executable, "-m", "gradwire.cli.worker", config_path, result_path]
        if cluster is None:
            _run_processes([argv] * workers, "127.0.0.1", timeout, interfaces=None)
        else:
            from ..cluster import ClusterSpec, up

            bandwidth, latency = cluster
            # a prefix of our own, so concurrent runs never collide
            prefix = f"g{os.getpid() % 10**6}{next(_LAUNCHES) % 1000}"
            with up(ClusterSpec(workers=workers, bandwidth=bandwidth, latency=latency, prefix=prefix)) as emulated:
                commands = [emulated.wrap(rank, argv) for rank in range(workers)]
                interfaces = [emulated.interface(rank) for rank in range(workers)]
                _run_processes(commands, emulated.master_addr, timeout, interfaces=interfaces)
                wire_bytes = [emulated.bytes_sent(rank) for rank in range(workers)]
        with open(result_path) as handle:
            summaries = json.load(handle)
        if cluster is not None:
            for summary in summaries:  # counters cover the whole launch: every method, setup included
                summary["link"] = {"bandwidth": cluster[0], "latency": cluster[1],
                                   "latency_emulated": emulated.latency_emulated,
                                   "launch_bytes_sent_by_rank": wire_bytes}
        return summaries


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


def _run_processes(commands: list[list[str]], master_addr: str, timeout: float,
                   interfaces: Optional[list[str]]) -> None:
    port = _free_port()
    processes: list[subprocess.Popen] = []
    try:
        for rank, command in enumerate(commands):
            env = dict(os.environ, MASTER_ADDR=master_addr, MASTER_PORT=str(port), RANK=str(rank),
                       WORLD_SIZE=str(len(commands)), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(len(commands)),
                       OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
            if interfaces is not None:
                env["GLOO_SOCKET_IFNAME"] = interfaces[rank]
            processes.append(subprocess.Popen(command, env=env, start_new_session=True))
        deadline = time.monotonic() + timeout
        while True:
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


def print_summary(summaries: list[dict[str, Any]]) -> None:
    baseline = next((s for s in summaries if s["method"] == "allreduce"), None)
    first = summaries[0]
    print(f"\n{first['model']} on {first['world_size']} workers, {first['steps']} steps per method")
    rows = []
    for s in summaries:
        ratio = s["seconds_per_step"] / baseline["seconds_per_step"] if baseline else float("nan")
        byte_ratio = s["bytes_per_step"] / baseline["bytes_per_step"] if baseline and baseline["bytes_per_step"] else float("nan")
        accuracy = f"{s['test_accuracy']:.4f}" if s.get("status", "ok") == "ok" else "diverged"
        rows.append([s["method"], accuracy, f"{s['final_loss']:.4g}", f"{s['seconds_per_step']:.3f}",
                     f"{ratio:.2f}", f"{s['bytes_per_step'] / 1e6:.3f}", f"{byte_ratio:.4f}", f"{s['parameters']:,}"])
    print(format_table(["method", "test acc", "final loss", "s/step", "x allreduce", "MB sent/step", "x bytes",
                        "params"], rows))
    phases = ("forward", "backward", "compress", "communicate", "decompress", "optimizer")
    print("\nmedian seconds per step by phase (backward includes the hook; communicate overlaps backward)")
    print(format_table(["method", *phases], [
        [s["method"], *(_seconds(s["phases"].get(f"seconds_{phase}")) for phase in phases)] for s in summaries]))


def _seconds(value: Any) -> str:
    return "-" if value is None or value != value else f"{value:.3f}"
