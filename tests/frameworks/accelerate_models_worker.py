"""Under torchrun with ACCELERATE_USE_CPU=1: three models on one Accelerator, each with gradwire's
hook (a GAN's two nets and a small head): "a" and "b" have the same shapes and options, "c" is so
small that ``collective="auto"`` sends it dense (its residual stays zero). A fresh run that loads
the folder must give every model its own residuals back; a file under another model's name, or
models registered in another order, must be refused."""

import os
import shutil

import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader, TensorDataset

import gradwire.integrations.accelerate as gradwire_accelerate
from tests.frameworks.launch import write_result

OPTIONS = {"compressor": "topk", "density": 0.05, "value_codec": "fp16", "index_codec": "rice"}


def build(name: str) -> torch.nn.Module:
    torch.manual_seed({"a": 0, "b": 1, "c": 2}[name])  # a and b: same shapes, other weights
    if name == "c":
        return torch.nn.Sequential(torch.nn.Linear(4, 2))
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))


def run(folder: str, steps: int, resume: "str | None" = None, order: str = "abc") -> dict:
    """Train the models ``steps`` steps (registered in ``order``), save to ``folder``; returns
    each model's residual norm and the hook steps it ran."""
    accelerator = Accelerator()
    generator = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(256, 32, generator=generator), torch.randint(0, 2, (256,), generator=generator))
    names = list(order)
    models = [build(name) for name in names]
    optimizers = [torch.optim.SGD(model.parameters(), lr=0.1) for model in models]
    *prepared, loader = accelerator.prepare(*models, *optimizers, DataLoader(data, batch_size=16))
    models, optimizers = prepared[:len(names)], prepared[len(names):]
    states = [gradwire_accelerate.register(accelerator, model, **OPTIONS) for model in models]
    if resume:
        accelerator.load_state(resume)
    for _, (inputs, targets) in zip(range(steps), loader):
        for name, model, optimizer in zip(names, models, optimizers):
            features = inputs[:, :4] if name == "c" else inputs
            accelerator.backward(torch.nn.functional.cross_entropy(model(features), targets % 2))
            optimizer.step()
            optimizer.zero_grad()
    if steps:
        accelerator.save_state(folder)
    return {name: {"norm": state.stats()["residual_norm"], "steps": state.stats()["step"]}
            for name, state in zip(names, states)}


def refusal(resume: str, order: str = "abc") -> str:
    """The error of loading ``resume`` into models registered in ``order`` ("" if it loads)."""
    try:
        run("run/unused", 0, resume=resume, order=order)
    except Exception as error:  # the test reads which error; only ValueError is the promised one
        return f"{type(error).__name__}: {error}"
    return ""


rank = int(os.environ["RANK"])
trained = run("run/ckpt", 4)
restored = run("run/unused", 0, resume="run/ckpt")
torch.distributed.barrier()  # every rank's files are written
files = sorted(name for name in os.listdir("run/ckpt") if name.startswith("gradwire_hook"))
# this rank's files of a and b swapped: equal shapes and options, so only the record tells them apart
swapped = f"run/swapped{rank}"
shutil.copytree("run/ckpt", swapped)
first, second = (os.path.join(swapped, f"gradwire_hook{part}rank{rank}.pt") for part in ("_", "_model1_"))
if os.path.exists(second):
    os.replace(first, first + ".tmp")
    os.replace(second, first)
    os.replace(first + ".tmp", second)
write_result({"trained": trained, "restored": restored, "files": files,
              "swapped_error": refusal(swapped), "reordered_error": refusal("run/ckpt", order="cab")})
