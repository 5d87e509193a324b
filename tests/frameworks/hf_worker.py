"""Under torchrun: the README's HF Trainer example (gradient accumulation 2, a checkpoint every 3
optimizer steps), then a resume from its last checkpoint that must give every rank its own
residuals back."""

from examples.hf_trainer import main
from gradwire.integrations.hf import GradwireCallback
from tests.frameworks.launch import write_result

begin = GradwireCallback.on_train_begin


def recording_begin(self, *args, **kwargs):
    """Note the residual norm right after the callback registered (and restored) the hook."""
    begin(self, *args, **kwargs)
    self.norm_at_begin = self.hook_state.stats()["residual_norm"]
    self.iteration_at_begin = self.hook_state.iteration


GradwireCallback.on_train_begin = recording_begin

trainer, callback = main(output_dir="run", max_steps=6)
stats = callback.hook_state.stats()
digest = [float(p.detach().double().sum()) for p in trainer.model.parameters()]
trainer2, callback2 = main(output_dir="run", max_steps=8, resume="run/checkpoint-6")
write_result({"steps": stats["step"], "global_step": trainer.state.global_step, "sent": stats["total_bytes_sent"],
              "dense": stats["total_bytes_dense"], "norm": stats["residual_norm"],
              "restored_norm": callback2.norm_at_begin, "restored_iteration": callback2.iteration_at_begin,
              "resumed_steps": callback2.hook_state.stats()["step"], "digest": digest,
              "world": trainer.args.world_size})
