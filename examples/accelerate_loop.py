"""An accelerate training loop on 2 CPU processes with gradwire's hook:
``ACCELERATE_USE_CPU=1 torchrun --nproc_per_node 2 examples/accelerate_loop.py``."""

import os
import sys

import torch
import torch.distributed as dist
from accelerate import Accelerator
from torch.utils.data import DataLoader, TensorDataset


def main(folder: str = "accelerate-run", steps: int = 6, resume: "str | None" = None):
    torch.manual_seed(0)
    accelerator = Accelerator(gradient_accumulation_steps=2)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = TensorDataset(torch.randn(512, 32), torch.randint(0, 4, (512,)))
    # [readme: accelerate]
    import gradwire.integrations.accelerate as gradwire_accelerate

    model, optimizer, loader = accelerator.prepare(model, optimizer, DataLoader(data, batch_size=16))
    state = gradwire_accelerate.register(accelerator, model, compressor="topk", density=0.05,
                                         value_codec="fp16", index_codec="rice")
    if resume:
        accelerator.load_state(resume)  # every rank gets its own residuals back
    for batch, (inputs, targets) in zip(range(2 * steps), loader):
        with accelerator.accumulate(model):
            accelerator.backward(torch.nn.functional.cross_entropy(model(inputs), targets))
            optimizer.step()
            optimizer.zero_grad()
    accelerator.save_state(folder)  # writes gradwire_hook_rank{r}.pt on every rank
    # [/readme]
    if state is None:  # accelerate built no DDP wrapper (the warning above says why): each process trained alone
        # one write with its newline: both processes print to one pipe, and under PYTHONUNBUFFERED a
        # print's text and its newline are two writes another process's line can fall between
        print(f"gradwire: no DistributedDataParallel, so this process trained {steps} steps uncompressed "
              "(on CPU: ACCELERATE_USE_CPU=1 torchrun --nproc_per_node 2 examples/accelerate_loop.py)\n",
              end="", flush=True)
    elif accelerator.is_main_process:
        stats = state.stats()
        print(f"gradwire: {stats['step']} steps, {stats['total_bytes_sent']:.0f} bytes sent "
              f"instead of {stats['total_bytes_dense']:.0f}")
    return accelerator, model, state


if __name__ == "__main__":
    main()
    # PyTorch itself can abort at interpreter exit after gloo collectives (pytorch PR #179291):
    # tear the process group down, flush, and leave without the interpreter's teardown
    if dist.is_initialized():
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
