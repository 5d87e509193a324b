"""gradwire in a plain DDP script, in a custom loop without DDP, and with local steps (DiLoCo), on
2 CPU processes: ``torchrun --nproc_per_node 2 examples/plain_loops.py``."""

import os
import sys

import torch
import torch.distributed as dist

import gradwire


def data(steps: int):
    generator = torch.Generator().manual_seed(dist.get_rank())  # each rank its own batches
    return [(torch.randn(16, 32, generator=generator), torch.randint(0, 4, (16,), generator=generator))
            for _ in range(steps)]


def plain_ddp(steps: int = 5):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    # [readme: plain DDP]
    from torch.nn.parallel import DistributedDataParallel as DDP

    ddp_model = DDP(model)
    state = gradwire.CommHookState(compressor="topk", density=0.05, value_codec="fp16", index_codec="rice",
                                   model=ddp_model)
    ddp_model.register_comm_hook(state, gradwire.comm_hook)  # the one added line
    optimizer = torch.optim.SGD(ddp_model.parameters(), lr=0.1)
    for inputs, targets in data(steps):
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(ddp_model(inputs), targets).backward()
        optimizer.step()
    torch.save(state.state_dict(), f"hook-rank{dist.get_rank()}.pt")  # each rank its own residuals
    # [/readme]
    return model, state


def custom_loop(steps: int = 5):
    torch.manual_seed(dist.get_rank())  # different initial weights: the exchange starts from rank 0's
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    # [readme: custom loop]
    exchange = gradwire.GradientExchange(model, compressor="topk", density=0.05)  # copies rank 0's weights
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for inputs, targets in data(steps):
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(inputs), targets).backward()
        exchange.synchronize()  # every .grad is now the compressed average over ranks
        optimizer.step()
    # [/readme]
    return model, exchange


def local_steps(steps: int = 8):
    torch.manual_seed(dist.get_rank())  # different initial weights: DiLoCo starts from rank 0's
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    # [readme: DiLoCo]
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    local = gradwire.DiLoCo(model, optimizer, sync_every=4, compressor="topk", density=0.1,
                            value_codec="fp16", index_codec="rice", unsent="model")  # copies rank 0's weights
    for inputs, targets in data(steps):
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(inputs), targets).backward()
        optimizer.step()  # every 4th step also averages the compressed pseudo-gradient: an outer step
    local.synchronize()  # e.g. before evaluating: the model now holds the global parameters
    torch.save(local.state_dict(), f"diloco-rank{dist.get_rank()}.pt")  # each rank its own
    # [/readme]
    return model, local


if __name__ == "__main__":
    dist.init_process_group("gloo")
    for run in (plain_ddp, custom_loop, local_steps):
        model, state = run()
        stats = state.stats()
        if dist.get_rank() != 0:  # one line per loop: the ranks' prints would interleave
            continue
        if run is local_steps:
            print(f"gradwire {run.__name__}: {stats['inner_steps']} steps, {stats['outer_steps']} outer steps, "
                  f"{stats['bytes_sent']:.0f} bytes sent instead of {stats['bytes_ddp_per_step'] * 8:.0f} (rank 0)",
                  flush=True)
        else:
            print(f"gradwire {run.__name__}: {stats['step']} steps, {stats['total_bytes_sent']:.0f} bytes sent "
                  f"instead of {stats['total_bytes_dense']:.0f} (rank 0)", flush=True)
    # PyTorch itself can abort at interpreter exit after gloo collectives (pytorch PR #179291):
    # tear the process group down, flush, and leave without the interpreter's teardown
    if dist.is_initialized():
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
