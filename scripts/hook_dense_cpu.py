"""CPU per rank and step: plain DDP against the gradwire hook's dense path (4 gloo ranks, loopback).

    python scripts/hook_dense_cpu.py [--model mlp] [--workers 4] [--steps 30] [--rounds 3] [--profile]
        [--methods allreduce,hook-dense] [--spec SPEC ...]

Where ``collective="auto"`` settles on dense it runs the hook's dense AllReduce, which adds to DDP's
what makes every rank fail or skip the same step: the step-end agreement (one small AllGather) and
the digest of the averaged gradients (fused with the division). On 2 cores shared by 4 ranks the
wall time of one step swings by 10-25% between launches, so this reports each rank's *process* CPU
time per step (``time.process_time``: the training thread and gloo's threads), median over the
steps after 6 untimed ones, with the two methods alternating for ``--rounds`` rounds. ``--profile``
adds a cProfile of rank 0's steps under the hook. ``--spec`` adds any method of ``gradwire train``
(e.g. ``topk:density=0.01,values=fp16,indices=rice,collective=sparse-allreduce``) as one more row;
given alone, it replaces the two default ones.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

UNTIMED = 6
METHODS = ("allreduce", "hook-dense")


def _worker(rank: int, world: int, port: int, method: str, model_name: str, steps: int, profile: bool,
            queue: object) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    import gradwire
    from gradwire.harness.workloads import build_workload

    workload = build_workload(model_name, "synthetic", seed=0)
    model = torch.nn.parallel.DistributedDataParallel(workload.model)
    if method != "allreduce":
        from gradwire.harness.methods import parse_method

        options = (dict(compressor="topk", density=0.01, collective="dense") if method == "hook-dense"
                   else parse_method(method).hook_options())
        state = gradwire.CommHookState(**options, process_group=dist.group.WORLD)
        model.register_comm_hook(state, gradwire.comm_hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    loader = torch.utils.data.DataLoader(workload.train, batch_size=32, shuffle=True,
                                         generator=torch.Generator().manual_seed(rank), drop_last=True)
    batches = iter(loader)
    cpu, wall = [], []
    profiler = cProfile.Profile() if profile and rank == 0 and method != "allreduce" else None
    for step in range(steps):
        try:
            inputs, targets = next(batches)
        except StopIteration:
            batches = iter(loader)
            inputs, targets = next(batches)
        timed = step >= UNTIMED
        if profiler is not None and timed:
            profiler.enable()
        cpu_start, wall_start = time.process_time(), time.perf_counter()
        optimizer.zero_grad()
        workload.loss(model(inputs), targets).backward()
        optimizer.step()
        cpu_end, wall_end = time.process_time(), time.perf_counter()
        if profiler is not None and timed:
            profiler.disable()
        if timed:
            cpu.append(cpu_end - cpu_start)
            wall.append(wall_end - wall_start)
    report = None
    if profiler is not None:
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(15)
        report = text.getvalue()
    queue.put((rank, statistics.median(cpu), statistics.median(wall), report))  # type: ignore[attr-defined]
    dist.barrier()
    dist.destroy_process_group()
    queue.close()  # type: ignore[attr-defined]
    queue.join_thread()  # type: ignore[attr-defined]
    os._exit(0)  # PyTorch can abort at exit after gloo collectives (pytorch PR #179291)


def _launch(method: str, args: argparse.Namespace) -> tuple[list[float], list[float], str | None]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    context = mp.get_context("spawn")
    queue = context.Queue()
    processes = [context.Process(target=_worker, args=(rank, args.workers, port, method, args.model, args.steps,
                                                       args.profile, queue)) for rank in range(args.workers)]
    for process in processes:
        process.start()
    try:
        results = sorted(queue.get(timeout=600) for _ in processes)
    finally:
        for process in processes:
            process.join(60)
            if process.is_alive():
                process.kill()
    return [r[1] * 1e3 for r in results], [r[2] * 1e3 for r in results], results[0][3]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="mlp")
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--methods", default=None,
                        help="which of allreduce, hook-dense to run (default both, unless --spec is given; one "
                             "alone, e.g. under perf)")
    parser.add_argument("--spec", action="append", default=[],
                        help="a gradwire method spec to run as one more row (repeatable)")
    args = parser.parse_args()
    named = args.methods if args.methods is not None else ("" if args.spec else ",".join(METHODS))
    methods = tuple(m for m in named.split(",") if m) + tuple(args.spec)
    if not methods or set(methods) - set(METHODS) - set(args.spec):
        parser.error(f"--methods: {args.methods!r}; allowed: {', '.join(METHODS)} (and --spec SPEC)")
    medians: dict[str, list[float]] = {method: [] for method in methods}
    print("round  method      CPU ms/step per rank (median over steps)   wall ms/step per rank")
    for round_index in range(args.rounds):
        order = methods if round_index % 2 == 0 else methods[::-1]
        for method in order:
            cpu, wall, report = _launch(method, args)
            medians[method].append(statistics.median(cpu))
            print(f"{round_index + 1:>5}  {method:<10}  {' '.join(f'{c:6.1f}' for c in cpu):<41}  "
                  f"{' '.join(f'{w:6.1f}' for w in wall)}", flush=True)
            if report:
                print(report)
    if set(methods) != set(METHODS):
        for method in methods:
            print(f"median over rounds of the ranks' median: {method} {statistics.median(medians[method]):.1f} ms "
                  f"(per round {[round(v, 1) for v in medians[method]]})")
        return 0
    plain, hook = statistics.median(medians["allreduce"]), statistics.median(medians["hook-dense"])
    print(f"median over rounds of the ranks' median: allreduce {plain:.1f} ms, hook-dense {hook:.1f} ms "
          f"({hook / plain:.3f}x); per round: allreduce {[round(v, 1) for v in medians['allreduce']]}, "
          f"hook-dense {[round(v, 1) for v in medians['hook-dense']]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
