"""Where the hook's time goes: 2 gloo ranks on loopback, ResNet-18, one thread each.

Prints, per method, the seconds per step and the hook's own per-phase seconds (last step, rank
0), optionally with a cProfile of rank 0's main thread. No rate limit: this isolates the CPU
cost of the hook from the link (``gradwire bench e2e`` measures both together).

    python scripts/profile_hook.py                              # topk, sampled-topk, randomblock at 1%
    python scripts/profile_hook.py --method topk:density=0.01,values=fp16,indices=rice --profile
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import socket
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

DEFAULT_METHODS = [
    "topk:density=0.01,values=fp16,indices=rice",
    "sampled-topk:density=0.01,values=fp16,indices=rice",
    "randomblock:density=0.01,values=fp16",
]


def _worker(rank: int, world: int, port: int, specs: list[str], steps: int, profile: bool, queue: object) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    import gradwire
    from gradwire.harness.methods import parse_method
    from gradwire.harness.models import build_model
    from torch.nn.parallel import DistributedDataParallel as DDP

    for spec_text in specs:
        torch.manual_seed(0)
        ddp = DDP(build_model("resnet18", num_classes=10))
        options = parse_method(spec_text).hook_options()
        state = gradwire.CommHookState(model=ddp, **options)
        ddp.register_comm_hook(state, gradwire.comm_hook)
        optimizer = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
        inputs, targets = torch.randn(32, 3, 32, 32), torch.randint(0, 10, (32,))

        def step() -> None:
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(ddp(inputs), targets).backward()
            optimizer.step()

        for _ in range(2):  # bucket rebuild and first-sight length rounds
            step()
        profiler = cProfile.Profile() if profile and rank == 0 else None
        start = time.perf_counter()
        if profiler:
            profiler.enable()
        for _ in range(steps):
            step()
        if profiler:
            profiler.disable()
        seconds = (time.perf_counter() - start) / steps
        if rank == 0:
            stats = state.stats()
            row = {"method": spec_text, "seconds_per_step": seconds,
                   **{key: stats[key] for key in ("seconds_sparsify", "seconds_encode", "seconds_communicate",
                                                  "seconds_decode", "bytes_sent")},
                   "frame_overflows": stats.get("count_frame_overflows", 0.0),
                   "exchanges": stats.get("count_allgather_buckets", 0.0)}
            if profiler:
                text = io.StringIO()
                pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(20)
                row["profile"] = text.getvalue()
            queue.put(row)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--method", action="append", dest="methods", help="repeatable; gradwire method specs")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--profile", action="store_true", help="print a cProfile of rank 0's main thread")
    args = parser.parse_args()
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    context = mp.get_context("spawn")
    queue = context.Queue()
    specs = args.methods or DEFAULT_METHODS
    mp.start_processes(_worker, args=(2, port, specs, args.steps, args.profile, queue), nprocs=2, start_method="spawn")
    print(f"{'method':55s} {'s/step':>7s} {'sparsify':>8s} {'encode':>7s} {'decode':>7s} {'bytes':>8s} "
          f"{'overflows':>9s}")
    for _ in specs:
        row = queue.get(timeout=60)
        print(f"{row['method']:55s} {row['seconds_per_step']:7.3f} {row['seconds_sparsify']:8.3f} "
              f"{row['seconds_encode']:7.3f} {row['seconds_decode']:7.3f} {row['bytes_sent']:8.0f} "
              f"{row['frame_overflows']:.0f}/{row['exchanges']:.0f}")
        if "profile" in row:
            print(row["profile"])
    print(json.dumps({"torch": torch.__version__, "threads_per_rank": 1, "ranks": 2}))


if __name__ == "__main__":
    main()
