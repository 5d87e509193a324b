"""Lightning on 2 CPU processes with gradwire's hook: ``torchrun --nproc_per_node 2 examples/lightning_ddp.py``
(or ``python examples/lightning_ddp.py``: Lightning then starts the second process itself)."""

import os
import sys

import lightning as L
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset


class Net(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))

    def training_step(self, batch, batch_index):
        inputs, targets = batch
        return torch.nn.functional.cross_entropy(self.layers(inputs), targets)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def main(root: str = "lightning-run", max_steps: int = 6, ckpt_path: "str | None" = None):
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(512, 32), torch.randint(0, 4, (512,)))
    # [readme: Lightning]
    from gradwire.integrations.lightning import GradwireDDPStrategy

    strategy = GradwireDDPStrategy(hook_options={"compressor": "topk", "density": 0.05,
                                                 "value_codec": "fp16", "index_codec": "rice"})
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=max_steps,
                        default_root_dir=root, logger=False, enable_progress_bar=False)
    model = Net()
    trainer.fit(model, DataLoader(data, batch_size=16), ckpt_path=ckpt_path)  # checkpoints hold every rank's residuals
    # [/readme]
    if trainer.is_global_zero:
        stats = strategy.hook_state.stats()
        print(f"gradwire: {stats['step']} steps, {stats['total_bytes_sent']:.0f} bytes sent "
              f"instead of {stats['total_bytes_dense']:.0f}")
    return trainer, model, strategy


if __name__ == "__main__":
    main()
    # PyTorch itself can abort at interpreter exit after gloo collectives (pytorch PR #179291):
    # tear the process group down, flush, and leave without the interpreter's teardown
    if dist.is_initialized():
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
