"""How often does a 2-rank gloo script that trains with the hook and then destroys its process
group exit cleanly? (Issue: 2-3 aborts in 10 runs, "terminate called without an active exception".)

    python scripts/exit_trials.py --runs 30                  # every collective, 30 runs each
    python scripts/exit_trials.py --runs 5 --collectives dense
    python scripts/exit_trials.py --runs 30 --load 2         # two busy processes beside the trials

The abort was a race at exit (a backend thread freeing a Work after the interpreter began to shut
down; see gradwire.lifetime), so a loaded machine makes it likelier: ``--load N`` runs N busy-loop
processes during the trials.

Prints one row per collective: runs, clean exits (both ranks 0), aborts (SIGABRT), other failures.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys

COLLECTIVES = {
    "dense": "compressor=topk,density=0.05,collective=dense",
    "allreduce": "compressor=randomblock,density=0.05,collective=allreduce",
    "allgather": "compressor=topk,density=0.05,collective=allgather",
    "auto": "compressor=topk,density=0.05,collective=auto",
    "sparse-allreduce": "compressor=topk,density=0.05,collective=sparse-allreduce",
    "none": "",  # no hook: the baseline
}


def child(rank: int, world: int, port: int, spec: str) -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import gradwire

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10)),
                bucket_cap_mb=0.05)
    if spec:
        options = {}
        for item in spec.split(","):
            key, value = item.split("=")
            options[key] = float(value) if key == "density" else value
        model.register_comm_hook(gradwire.CommHookState(model=model, **options), gradwire.comm_hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(20):
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(torch.randn(32, 64)), torch.randint(0, 10, (32,))).backward()
        optimizer.step()
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def trial(spec: str, timeout: float) -> str:
    port = free_port()
    procs = [subprocess.Popen([sys.executable, __file__, "--child", str(rank), str(port), spec],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE) for rank in range(2)]
    codes = []
    for proc in procs:
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            for other in procs:
                other.kill()
            return "hang"
        codes.append(proc.returncode)
    if all(code == 0 for code in codes):
        return "clean"
    if -signal.SIGABRT in codes:
        return "abort"
    return f"exit {codes}"


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(int(sys.argv[2]), 2, int(sys.argv[3]), sys.argv[4] if len(sys.argv) > 4 else "")
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--collectives", default=",".join(COLLECTIVES))
    parser.add_argument("--timeout", type=float, default=120.0)
    parser.add_argument("--load", type=int, default=0, help="busy-loop processes to run beside the trials")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.load)]
    try:
        print(f"{'collective':<10} {'runs':>5} {'clean':>6} {'aborts':>7} other   (load {args.load})")
        for name in args.collectives.split(","):
            outcomes = [trial(COLLECTIVES[name], args.timeout) for _ in range(args.runs)]
            other = sorted({o for o in outcomes if o not in ("clean", "abort")})
            print(f"{name:<10} {len(outcomes):>5} {outcomes.count('clean'):>6} {outcomes.count('abort'):>7} "
                  f"{', '.join(other) or '-'}", flush=True)
    finally:
        for process in busy:
            process.kill()
            process.wait()


if __name__ == "__main__":
    main()
