"""The DDP communication hook: sparsify, encode and exchange each bucket, with error feedback.

In the manner of ``torch.distributed.algorithms.ddp_comm_hooks``: a plain state object and a
function ``comm_hook(state, bucket) -> Future[Tensor]``.

>>> import torch, torch.distributed as dist, gradwire
>>> from torch.nn.parallel import DistributedDataParallel as DDP
>>> dist.init_process_group("gloo", init_method="tcp://127.0.0.1:29517", rank=0, world_size=1)
>>> model = DDP(torch.nn.Linear(64, 10))
>>> state = gradwire.CommHookState(compressor="topk", density=0.1, index_codec="rice", model=model)
>>> model.register_comm_hook(state, gradwire.comm_hook)          # the one added line
>>> model(torch.randn(8, 64)).sum().backward()
>>> state.stats()["step"]
1
>>> dist.destroy_process_group()

The path of one bucket:

1. ``compensated = grad + residual`` for each parameter in the bucket (error feedback), and the
   sparsifier's selection (per parameter, or once over all buckets for ``scope="global"``):
   :mod:`~gradwire.hook.selection`;
2. a strategy (:mod:`~gradwire.hook.strategies`), chosen the same way on every rank, moves the
   group between ranks and writes the average into the bucket's buffer: dense AllReduce,
   AllReduce of values on a shared support, or AllGather of encoded payloads;
3. at the step's last bucket every rank waits for its exchanges, runs second rounds, and agrees
   with the others that the step succeeded — then DDP's Futures resolve and residuals update on
   every rank, or every rank raises (or skips) the same step: :mod:`~gradwire.hook.step`.
"""

from .config import HookConfig
from .state import CommHookState, comm_hook
from .step import NonFiniteGradientError

__all__ = ["CommHookState", "HookConfig", "NonFiniteGradientError", "comm_hook"]
