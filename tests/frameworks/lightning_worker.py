"""Under torchrun: the README's Lightning example, then a checkpoint and a resume that must give
every rank its own residuals back."""

import warnings

import torch

from examples.lightning_ddp import main
from gradwire.integrations._common import HookNeverRanWarning
from tests.frameworks.launch import write_result

trainer, model, strategy = main(root="run", max_steps=6)
stats = strategy.hook_state.stats()
norm = stats["residual_norm"]
digest = [float(p.detach().double().sum()) for p in model.parameters()]
trainer.save_checkpoint("run/check.ckpt")  # every rank calls it (the hook state is gathered)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    # max_steps already reached: the resume restores every state and trains no step
    trainer2, model2, strategy2 = main(root="run", max_steps=6, ckpt_path="run/check.ckpt")
write_result({"steps": stats["step"], "sent": stats["total_bytes_sent"], "dense": stats["total_bytes_dense"],
              "norm": norm, "restored_norm": strategy2.hook_state.stats()["residual_norm"],
              "restored_iteration": strategy2.hook_state.iteration, "digest": digest,
              "idle_warned": any(issubclass(w.category, HookNeverRanWarning) for w in caught),
              "ckpt_keys": sorted(torch.load("run/check.ckpt", weights_only=True)["gradwire_hook"].keys())})
