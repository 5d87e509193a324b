"""Bytes per step of ``compressor="nonzero"`` through the real DDP hook on 2 gloo ranks, for the
embedding-heavy model of ``gradwire bench codecs`` (``--sources embedding``), against the
non-zero rows' raw size (the largest over ranks: an AllGather pads to the longest payload).

    PYTHONPATH=src python scripts/embedding_hook_bytes.py [--index-codec rle] [--steps 4]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))


def worker(rank: int, world: int, port: int, index_codec: str, steps: int, queue) -> None:
    import gradwire
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    torch.manual_seed(0)
    rows, dim = 100_000, 64
    model = torch.nn.ModuleDict({"table": torch.nn.Embedding(rows, dim), "hidden": torch.nn.Linear(dim, dim),
                                 "out": torch.nn.Linear(dim, 1)})

    class Wrapped(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = model

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            features = self.inner["table"](ids).mean(1)
            return self.inner["out"](torch.relu(self.inner["hidden"](features)))

    ddp = DDP(Wrapped())
    state = gradwire.CommHookState(model=ddp, compressor="nonzero", value_codec="fp32", index_codec=index_codec,
                                   collective="allgather")
    ddp.register_comm_hook(state, gradwire.comm_hook)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(rank)
    dense_rows_bytes = 4 * sum(p.numel() for name, p in model.named_parameters() if not name.startswith("table"))
    out = []
    for step in range(steps):
        ids = (rows ** torch.rand(256, 20, generator=generator)).long().clamp_(1, rows) - 1
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(ddp(ids), torch.rand(256, 1, generator=generator)).backward()
        # this rank's non-zero rows: the table rows its ids touched, and every row of the head
        raw = 4 * dim * int(torch.unique(ids).numel()) + dense_rows_bytes
        out.append((raw, state.stats()["bytes_sent"]))
        optimizer.step()
    queue.put((rank, out))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--index-codec", default="rle")
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    from tests.distributed import free_port

    context = mp.get_context("spawn")
    queue = context.Queue()
    port = free_port()
    processes = [context.Process(target=worker, args=(rank, 2, port, args.index_codec, args.steps, queue))
                 for rank in range(2)]
    for process in processes:
        process.start()
    results = dict(queue.get(timeout=600) for _ in processes)
    for process in processes:
        process.join(timeout=60)
    print(f"nonzero + fp32 + {args.index_codec}, 2 ranks; bytes_sent = what one rank sends per step (hook stats)")
    print("step  raw rows (max over ranks)  bytes sent  ratio")
    for step in range(args.steps):
        raw = max(results[rank][step][0] for rank in results)
        sent = results[0][step][1]
        print(f"{step:4d}  {raw:25,d}  {int(sent):10,d}  {sent / raw:.4f}")


if __name__ == "__main__":
    main()
