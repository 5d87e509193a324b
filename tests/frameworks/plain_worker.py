"""Under torchrun: the README's plain-DDP and custom-loop snippets; then each rank's saved hook
file goes back into a fresh state of its own rank (and another rank's file is refused)."""

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import gradwire
from examples.plain_loops import custom_loop, local_steps, plain_ddp
from tests.frameworks.launch import write_result

dist.init_process_group("gloo")
rank = dist.get_rank()
result = {}
for run in (plain_ddp, custom_loop):
    model, state = run()
    stats = state.stats()
    result[run.__name__] = {"steps": stats["step"], "sent": stats["total_bytes_sent"],
                            "dense": stats["total_bytes_dense"], "norm": stats["residual_norm"],
                            "digest": [float(p.detach().double().sum()) for p in model.parameters()]}
model, local = local_steps()
stats = local.stats()
result["local_steps"] = {"steps": stats["inner_steps"], "outer": stats["outer_steps"], "sent": stats["bytes_sent"],
                         "dense": stats["bytes_ddp_per_step"] * stats["inner_steps"],
                         "digest": [float(p.detach().double().sum()) for p in model.parameters()]}
dist.barrier()  # both ranks' hook files are written
fresh = gradwire.CommHookState(compressor="topk", density=0.05, value_codec="fp16", index_codec="rice",
                               model=DDP(torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(),
                                                             torch.nn.Linear(64, 4))))
fresh.load_state_dict(torch.load(f"hook-rank{rank}.pt", weights_only=True))
result["restored_norm"] = fresh.stats()["residual_norm"]
try:
    fresh.load_state_dict(torch.load(f"hook-rank{1 - rank}.pt", weights_only=True))
except ValueError as error:
    result["other_rank_error"] = str(error)
restored = torch.load(f"diloco-rank{rank}.pt", weights_only=True)
result["diloco_state"] = {"rank": restored["rank"], "outer_steps": restored["outer_steps"]}
write_result(result)
