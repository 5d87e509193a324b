"""Under torchrun with ACCELERATE_USE_CPU=1: the README's accelerate example (accumulation 2),
then a fresh run that loads its folder and must hold every rank's own residuals."""

from examples.accelerate_loop import main
from tests.frameworks.launch import write_result

accelerator, model, state = main(folder="run/ckpt", steps=6)
stats = state.stats()
digest = [float(p.detach().double().sum()) for p in model.parameters()]
# zero steps after loading: what the fresh run holds is exactly what was loaded
accelerator2, model2, state2 = main(folder="run/ckpt2", steps=0, resume="run/ckpt")
write_result({"steps": stats["step"], "sent": stats["total_bytes_sent"], "dense": stats["total_bytes_dense"],
              "norm": stats["residual_norm"], "restored_norm": state2.stats()["residual_norm"],
              "restored_iteration": state2.iteration, "digest": digest,
              "restored_digest": [float(p.detach().double().sum()) for p in model2.parameters()],
              "world": accelerator.num_processes}, run_exit_handlers=True)  # the idle warning is printed at exit
