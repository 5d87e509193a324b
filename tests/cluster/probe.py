"""Programs the cluster tests run inside worker namespaces via ``ip netns exec`` (no iperf needed).

    python probe.py recv HOST PORT          # prints "listening", then one JSON line at EOF
    python probe.py send HOST PORT NBYTES   # connects (retrying up to 10 s), sends NBYTES, closes
    python probe.py allreduce NUMEL         # one gloo rank; MASTER_ADDR/PORT, RANK, WORLD_SIZE from env

The receiver times from accepting the connection to reading the sender's EOF, i.e. the time
all bytes took to cross the link, and prints ``{"bytes": n, "seconds": t, "start": t0, "end": t1}``
(t0, t1 from ``time.time()``). An allreduce rank
prints ``{"rank": r, "seconds": t, "correct": bool}`` for one timed all_reduce of NUMEL float32.
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import sys
import time

CHUNK = 1 << 20  # bytes per send/recv call


def receive(host: str, port: int) -> None:
    with socket.create_server((host, port)) as server:
        print("listening", flush=True)
        server.settimeout(30)
        connection, _ = server.accept()
        with connection:
            connection.settimeout(60)
            start, began = time.perf_counter(), time.time()
            total = 0
            while True:
                data = connection.recv(CHUNK)
                if not data:
                    break
                total += len(data)
            seconds, ended = time.perf_counter() - start, time.time()
            connection.sendall(b"k")  # lets the sender close only after everything arrived
    # wall-clock marks too, comparable across namespaces (one host, one clock), to overlap flows
    print(json.dumps({"bytes": total, "seconds": seconds, "start": began, "end": ended}), flush=True)


def send(host: str, port: int, nbytes: int) -> None:
    deadline = time.monotonic() + 10
    while True:
        try:
            connection = socket.create_connection((host, port), timeout=5)
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    with connection:
        connection.settimeout(60)
        payload = bytes(CHUNK)
        left = nbytes
        while left > 0:
            connection.sendall(payload[: min(left, CHUNK)])
            left -= min(left, CHUNK)
        connection.shutdown(socket.SHUT_WR)
        connection.recv(1)


def allreduce(numel: int) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="env://", timeout=datetime.timedelta(seconds=30))
    try:
        rank, world_size = dist.get_rank(), dist.get_world_size()
        dist.all_reduce(torch.ones(16))  # every pair connected and warm before the clock starts
        tensor = torch.full((numel,), float(rank + 1))
        dist.barrier()
        start = time.perf_counter()
        dist.all_reduce(tensor)
        seconds = time.perf_counter() - start
        expected = world_size * (world_size + 1) / 2
        correct = bool(torch.all(tensor == expected))
        print(json.dumps({"rank": rank, "seconds": seconds, "correct": correct,
                          "ifname": os.environ.get("GLOO_SOCKET_IFNAME")}), flush=True)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    if sys.argv[1] == "allreduce":
        allreduce(int(sys.argv[2]))
    elif sys.argv[1] == "recv":
        receive(sys.argv[2], int(sys.argv[3]))
    else:
        send(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
