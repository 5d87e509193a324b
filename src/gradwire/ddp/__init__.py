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

:class:`CommHookState` is a thin adapter over the compression core (:mod:`gradwire.core`): DDP's
buckets become groups, the round's verdict resolves DDP's Futures. The path of one gradient is
told in docs/architecture.md.
"""

from ..errors import NonFiniteGradientError
from .state import CommHookState, HookConfig, comm_hook

__all__ = ["CommHookState", "HookConfig", "NonFiniteGradientError", "comm_hook"]
