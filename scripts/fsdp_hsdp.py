"""HSDP (``fully_shard`` on a 2-D replicate x shard mesh) with gradwire's compressed reduce-scatter
and AllReduce across replicas: bytes per rank and step against plain HSDP, and the loss.

Each rank builds the 509,248-parameter ``gpt`` (``ByteGPT``), ``fully_shard``s every block and the
root on ``init_device_mesh("cpu", (R, W / R))`` and trains ``--steps`` AdamW steps on random bytes
(the loss on random bytes only tells that nothing broke: it falls to about ln 256 = 5.545 nats).
Bytes: gradwire's ``stats()`` (``bytes_sent``: what this rank handed to the collectives for its
peers; ``bytes_dense``: what plain HSDP sends for the same gradients, the reduce-scatter's
``(p_s - 1) s`` elements plus a ring AllReduce of the shard across the R replicas), the max over
ranks of the last step; the two stages apart from the strategies' counters.

    torchrun --nproc-per-node 4 scripts/fsdp_hsdp.py --method quantize:bits=8 [--replicas 2 --steps 3]

Rank 0 prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.distributed as dist


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--method", required=True, help="a gradwire train method spec")
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    from torch.distributed.device_mesh import init_device_mesh

    import gradwire.fsdp
    from gradwire.harness import sharding
    from gradwire.harness.methods import parse_method
    from gradwire.harness.models import build_model

    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (args.replicas, world // args.replicas), mesh_dim_names=("replicate", "shard"))
    model = build_model("gpt", vocab_size=256, context=128, seed=0)
    sharding.shard(model, mesh)
    state = gradwire.fsdp.compress(model, **parse_method(args.method).hook_options())
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3)
    generator = torch.Generator().manual_seed(dist.get_rank())
    losses = []
    for _ in range(args.steps):
        tokens = torch.randint(0, 256, (8, 129), generator=generator)
        optimizer.zero_grad(set_to_none=True)
        logits = model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 256), tokens[:, 1:].reshape(-1))
        loss.backward()
        optimizer.step()
        losses.append(float(loss))
    stats = state.stats()
    mine = torch.tensor([stats["bytes_sent"], stats["bytes_dense"]], dtype=torch.float64)
    rows = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(rows, mine, async_op=True).wait()
    sent, dense = torch.stack(rows).amax(dim=0).tolist()
    if dist.get_rank() == 0:
        buckets = {k[len("count_"):-len("_buckets")]: v for k, v in stats.items() if k.endswith("_buckets")}
        print(json.dumps({"method": args.method, "mesh": [args.replicas, world // args.replicas],
                          "bytes_sent": sent, "bytes_plain_hsdp": dense, "ratio": round(sent / dense, 4),
                          "losses": [round(x, 4) for x in losses], "exchanges": buckets}), flush=True)
    dist.destroy_process_group()
    os._exit(0)  # PyTorch's exit abort after gloo collectives (pytorch PR #179291)


if __name__ == "__main__":
    main()
