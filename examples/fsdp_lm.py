"""FSDP2 with gradwire's compressed reduce-scatter, on CPU processes: a small byte-level language
model learns this file's own text.

    torchrun --nproc_per_node 2 examples/fsdp_lm.py                 # int8 blocks, error feedback
    torchrun --nproc_per_node 2 examples/fsdp_lm.py topk            # top-k 10%, fp16 values, Rice indices
    torchrun --nproc_per_node 2 examples/fsdp_lm.py topk-momentum   # the same, sending 1-bit Adam's momentum
    torchrun --nproc_per_node 2 examples/fsdp_lm.py plain           # plain FSDP2, to compare
"""

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

import gradwire.fsdp

TOPK = {"compressor": "topk", "density": 0.1, "value_codec": "fp16", "index_codec": "rice"}
OPTIONS = {"int8": {"quantize": "int8"}, "topk": TOPK,
           # top-k under AdamW: after 10 exact steps each rank sends its momentum (docs/fsdp.md)
           "topk-momentum": {**TOPK, "warmup_steps": 10, "momentum": 0.9}}


def data(steps: int, batch: int = 8, length: int = 64):
    text = torch.frombuffer(bytearray(Path(__file__).read_bytes()), dtype=torch.uint8).long()
    generator = torch.Generator().manual_seed(dist.get_rank())  # each rank its own windows
    for _ in range(steps):
        starts = torch.randint(0, text.numel() - length - 1, (batch,), generator=generator)
        yield torch.stack([text[s: s + length + 1] for s in starts.tolist()])


def train(setting: str, steps: int = 40) -> tuple[list[float], dict]:
    torch.manual_seed(0)  # the same initial weights on every rank
    layers = [torch.nn.TransformerEncoderLayer(64, 4, 128, dropout=0.0, batch_first=True) for _ in range(2)]
    model = torch.nn.Sequential(torch.nn.Embedding(256, 64), *layers, torch.nn.Linear(64, 256))
    options = OPTIONS.get(setting)
    # [readme: FSDP2]
    from torch.distributed.fsdp import fully_shard

    for layer in layers:
        fully_shard(layer)
    fully_shard(model)
    state = gradwire.fsdp.compress(model, **options) if options else None  # e.g. quantize="int8"
    if options and "momentum" in options:  # 1-bit Adam's exchange needs its optimizer
        optimizer = gradwire.fsdp.MomentumAdamW(model.parameters(), state, lr=3e-3)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for tokens in data(steps):
        optimizer.zero_grad()
        logits = model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 256), tokens[:, 1:].reshape(-1))
        loss.backward()  # each module's gradient reduce-scatters through gradwire
        optimizer.step()
        losses.append(float(loss))
    if state is not None:
        torch.save(state.state_dict(), f"fsdp-rank{dist.get_rank()}.pt")  # each rank its own residuals
    # [/readme]
    return losses, state.stats() if state is not None else {}


if __name__ == "__main__":
    dist.init_process_group("gloo")
    setting = sys.argv[1] if len(sys.argv) > 1 else "int8"
    losses, stats = train(setting)
    if dist.get_rank() == 0:  # one line: the ranks' prints would interleave
        sent = f", {stats['total_bytes_sent']:.0f} bytes sent instead of {stats['total_bytes_dense']:.0f}" \
            if stats else ""
        print(f"gradwire fsdp {setting}: loss {sum(losses[:5]) / 5:.3f} -> {sum(losses[-5:]) / 5:.3f} "
              f"over {len(losses)} steps{sent} (rank 0)", flush=True)
    # PyTorch itself can abort at interpreter exit after gloo collectives (pytorch PR #179291):
    # tear the process group down, flush, and leave without the interpreter's teardown
    if dist.is_initialized():
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
