"""Compressed gradient averaging for custom training loops, without DDP.

>>> import torch, torch.distributed as dist, gradwire
>>> dist.init_process_group("gloo", init_method="tcp://127.0.0.1:29518", rank=0, world_size=1)
>>> model = torch.nn.Linear(32, 4)
>>> exchange = gradwire.GradientExchange(model, compressor="randomblock", density=0.25)
>>> model(torch.randn(5, 32)).sum().backward()
>>> exchange.synchronize()       # every .grad now holds the compressed average over ranks
>>> exchange.stats()["step"]
1
>>> dist.destroy_process_group()
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist

from .hook import CommHookState
from .lifetime import wait_for


class GradientExchange:
    """Averages ``model``'s gradients over ranks with the same machinery as the DDP hook.

    Parameters that require grad but got none this step count as zero gradients (every rank
    must exchange the same tensors). Buckets of about ``bucket_cap_mb`` MiB are formed in
    reverse parameter order, as DDP does, and exchanged one after another.
    ``options`` are :class:`~gradwire.hook.CommHookState`'s keyword options.

    As DDP does, the constructor copies rank 0's parameters and buffers to every rank
    (``broadcast_parameters=True``; a collective, so every rank must construct it): ranks that
    started from different weights would otherwise stay different, silently.
    """

    def __init__(self, model: torch.nn.Module, process_group: Optional[dist.ProcessGroup] = None,
                 *, bucket_cap_mb: float = 25.0, broadcast_parameters: bool = True, **options: Any) -> None:
        if bucket_cap_mb <= 0:
            raise ValueError(f"bucket_cap_mb={bucket_cap_mb} must be > 0")
        self.model = model
        if broadcast_parameters and dist.is_available() and dist.is_initialized() \
                and dist.get_world_size(process_group) > 1:
            _broadcast_from_first_rank([*model.parameters(), *model.buffers()], process_group)
        self.state = CommHookState(process_group, model=model, **options)
        self.parameters = [p for p in model.parameters() if p.requires_grad]
        cap = bucket_cap_mb * 2**20
        self.buckets: list[list[torch.Tensor]] = []
        size = cap
        for parameter in reversed(self.parameters):
            if size >= cap:
                self.buckets.append([])
                size = 0
            self.buckets[-1].append(parameter)
            size += parameter.numel() * parameter.element_size()

    def synchronize(self) -> None:
        """Replace every ``.grad`` by the compressed average over ranks (blocking)."""
        pending = []
        for index, bucket in enumerate(self.buckets):
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in bucket]
            buffer = torch.cat([g.reshape(-1) for g in grads])
            views, offset = [], 0
            for grad in grads:
                views.append(buffer[offset: offset + grad.numel()].view_as(grad))
                offset += grad.numel()
            future = self.state.run_bucket(index, buffer, bucket, views, index == len(self.buckets) - 1)
            pending.append((bucket, views, future))
        for bucket, views, future in pending:
            future.wait()
            for parameter, view in zip(bucket, views):
                if parameter.grad is None:
                    parameter.grad = view.clone()
                else:
                    parameter.grad.copy_(view)

    def stats(self) -> dict[str, float]:
        return self.state.stats()

    def state_dict(self, gather: bool = False) -> dict[str, Any]:
        """See :meth:`CommHookState.state_dict` (``gather=True`` is a collective)."""
        return self.state.state_dict(gather=gather)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        device = self.parameters[0].device if self.parameters else "cpu"
        self.state.load_state_dict(state, device=device)


def _broadcast_from_first_rank(tensors: list[torch.Tensor], group: Optional[dist.ProcessGroup]) -> None:
    """Overwrite ``tensors`` with group rank 0's values: one broadcast per (device, dtype)."""
    root = dist.get_global_rank(group, 0) if group is not None else 0
    kinds: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for tensor in tensors:
        kinds.setdefault((tensor.device, tensor.dtype), []).append(tensor)
    with torch.no_grad():
        for same in kinds.values():
            flat = torch.cat([t.detach().reshape(-1) for t in same])
            wait_for(dist.broadcast(flat, src=root, group=group, async_op=True), None, "broadcast of parameters")
            offset = 0
            for tensor in same:
                tensor.copy_(flat[offset: offset + tensor.numel()].view_as(tensor))
                offset += tensor.numel()
