"""HF Trainer on 2 CPU processes with gradwire's hook (a tiny GPT-2 from a config, random tokens):
``torchrun --nproc_per_node 2 examples/hf_trainer.py``."""

import os
import sys

import torch
import torch.distributed as dist
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments


class RandomTokens(torch.utils.data.Dataset):
    def __len__(self):
        return 256

    def __getitem__(self, index):
        tokens = torch.randint(0, 128, (16,), generator=torch.Generator().manual_seed(index))
        return {"input_ids": tokens, "labels": tokens}


def main(output_dir: str = "hf-run", max_steps: int = 6, resume: "str | bool | None" = None):
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=128, n_positions=16, n_embd=32, n_layer=2, n_head=2))
    args = TrainingArguments(output_dir=output_dir, use_cpu=True, max_steps=max_steps, per_device_train_batch_size=4,
                             gradient_accumulation_steps=2, save_steps=3, report_to=[], seed=0)
    # [readme: HF Trainer]
    from gradwire.integrations.hf import GradwireCallback

    trainer = Trainer(model=model, args=args, train_dataset=RandomTokens())
    # collective="auto" (the default) would send this small model dense over a fast local link:
    # the payload AllGather is pinned so that a 2-process run on one machine shows the compression
    callback = GradwireCallback.install(trainer, compressor="topk", density=0.05, value_codec="fp16",
                                        index_codec="rice", collective="allgather")
    trainer.train(resume_from_checkpoint=resume)  # checkpoint-N/ holds each rank's gradwire_hook_rank{r}.pt
    # [/readme]
    if callback.hook_state is None:  # the Trainer built no DDP wrapper (the warning above says why)
        print(f"gradwire: no DistributedDataParallel (one process), so {trainer.state.global_step} steps trained "
              "uncompressed (for 2 processes: torchrun --nproc_per_node 2 examples/hf_trainer.py)", flush=True)
    elif trainer.is_world_process_zero():
        stats = callback.hook_state.stats()
        print(f"gradwire: {stats['step']} steps, {stats['total_bytes_sent']:.0f} bytes sent "
              f"instead of {stats['total_bytes_dense']:.0f}")
    return trainer, callback


if __name__ == "__main__":
    main()
    # PyTorch itself can abort at interpreter exit after gloo collectives (pytorch PR #179291):
    # tear the process group down, flush, and leave without the interpreter's teardown
    if dist.is_initialized():
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
