"""Compressed averaging of any list of tensors, without DDP: :class:`GradientExchange`.

>>> import torch, torch.distributed as dist, gradwire
>>> dist.init_process_group("gloo", init_method="tcp://127.0.0.1:29518", rank=0, world_size=1)
>>> model = torch.nn.Linear(32, 4)
>>> exchange = gradwire.GradientExchange(model, compressor="randomblock", density=0.25)
>>> model(torch.randn(5, 32)).sum().backward()
>>> exchange.synchronize()       # every .grad now holds the compressed average over ranks
>>> exchange.stats()["step"]
1
>>> dist.destroy_process_group()

A front-end of the compression core (:mod:`gradwire.core`), like the DDP hook: each bucket of
tensors is one group over a persistent flat buffer; a round is one :meth:`synchronize`.
"""

from __future__ import annotations

from typing import Any, Hashable, Iterable, Optional, Sequence, Union

import torch
import torch.distributed as dist

from .core import checkpoint
from .core.config import ExchangeConfig
from .core.feedback import ErrorFeedback
from .core.group import BufferTarget, Entry, Group
from .core.pipeline import Pipeline
from .core.round import RAISE, SKIP
from .exchange.collectives import world_size_of
from .fsdp.detect import refuse_fsdp
from .lifetime import wait_for


class GradientExchange:
    """Averages the gradients of ``model`` (or any list of tensors) over ranks with the core the
    DDP hook uses.

    Args:
        model: a module (its parameters that require grad are exchanged, named as in
            ``named_parameters()`` for checkpoints) or a sequence of tensors (named ``"0"``,
            ``"1"``, ...; e.g. the pieces of a pseudo-gradient).
        process_group: the ranks to average over (default: the world).
        bucket_cap_mb: buckets of about this many MiB are formed in reverse order, as DDP does,
            and exchanged one after another.
        broadcast_parameters: as DDP does, copy rank 0's parameters and buffers to every rank at
            construction (a collective, so every rank must construct it; modules only): ranks that
            started from different weights would otherwise stay different, silently.
        config: an :class:`~gradwire.ExchangeConfig`; or its options as keywords (those of
            :class:`~gradwire.CommHookState`).

    Raises:
        ValueError: an invalid option (naming it and the allowed values).

    A parameter that requires grad but got none this step counts as a zero gradient (every rank
    must exchange the same tensors). Each bucket keeps one flat buffer across steps; after the
    first :meth:`synchronize` every ``.grad`` is a view into it (like DDP's
    ``gradient_as_bucket_view``), so a backward that accumulates into the existing ``.grad``
    costs no copy in or out.
    """

    def __init__(self, model: Union[torch.nn.Module, Sequence[torch.Tensor]],
                 process_group: Optional[dist.ProcessGroup] = None, *, bucket_cap_mb: float = 25.0,
                 broadcast_parameters: bool = True, config: Optional[ExchangeConfig] = None, **options: Any) -> None:
        if bucket_cap_mb <= 0:
            raise ValueError(f"bucket_cap_mb={bucket_cap_mb} must be > 0")
        if config is not None and options:
            raise ValueError(f"pass either config= or options, not both (got {', '.join(sorted(options))})")
        refuse_fsdp(model)
        self.model = model if isinstance(model, torch.nn.Module) else None
        if self.model is not None:
            # a tensor's id is its index among all named parameters, as the DDP hook numbers them
            # (random supports draw per tensor id, so both front-ends select alike)
            every = list(self.model.named_parameters())
            ids = {id(p): i for i, (_, p) in enumerate(every)}
            named = [(n, p) for n, p in every if p.requires_grad]
            if broadcast_parameters and _distributed(process_group):
                _broadcast_from_first_rank([*self.model.parameters(), *self.model.buffers()], process_group)
        else:
            named = [(str(i), t) for i, t in enumerate(_tensor_list(model))]
            ids = {id(t): i for i, (_, t) in enumerate(named)}
        self.parameters = [p for _, p in named]
        self.config = config if config is not None else ExchangeConfig(**options)
        self.process_group = process_group
        self.pipeline = Pipeline(self.config, process_group)
        self.iteration = 0
        self._names: dict[Hashable, str] = {id(p): n for n, p in named}
        self._tensor_ids = ids
        self._specs = {n: checkpoint.ParameterSpec(p.numel(), torch.float64 if p.dtype == torch.float64
                                                   else torch.float32) for n, p in named}
        self.buckets = _buckets(self.parameters, bucket_cap_mb * 2**20)
        self._buffers: list[Optional[torch.Tensor]] = [None] * len(self.buckets)
        #: the last round's collectives' ``Work``, held until the next round (Exchange.works)
        self._last_round: list[Any] = []

    @property
    def feedback(self) -> Optional[ErrorFeedback]:
        """This rank's error-feedback memory (None without error feedback)."""
        return self.pipeline.feedback

    def synchronize(self, tensors: Optional[Sequence[torch.Tensor]] = None) -> None:
        """Replace every ``.grad`` (or, given ``tensors`` shaped like the exchanged ones, each of
        those, in place) by the compressed average over ranks. Blocking; a collective.

        Raises:
            NonFiniteGradientError: some rank's input held NaN/Inf (``nonfinite="raise"``);
                with ``"skip"`` the round is dropped instead: every output is zeroed.
            CollectiveError, DivergenceError, StepFailedError, DecodeError: the round failed; the
                same step raises on every rank and nothing was applied (residuals unchanged).
        """
        self.pipeline.check_config()
        self._last_round = []
        outputs = list(tensors) if tensors is not None else None
        if outputs is not None and [t.shape for t in outputs] != [p.shape for p in self.parameters]:
            raise ValueError("synchronize(tensors): expected one tensor per exchanged tensor, with its shape")
        divisor = float(world_size_of(self.process_group))
        groups, in_flight, copies = [], [], []
        position = 0
        for index, bucket in enumerate(self.buckets):
            buffer = self._buffer(index, bucket)
            group = Group(BufferTarget([buffer]), divisor=divisor)
            offset = 0
            for parameter in bucket:
                view = buffer[offset: offset + parameter.numel()].view_as(parameter)
                source = outputs[position] if outputs is not None else parameter.grad
                if source is None:
                    view.zero_()
                elif source.data_ptr() != view.data_ptr():
                    view.copy_(source)
                copies.append((parameter, view, position))
                group.entries.append(Entry(id(parameter), self._tensor_ids[id(parameter)], view, offset))
                offset += parameter.numel()
                position += 1
            groups.append(group)
            in_flight.append(self.pipeline.start(group, self.iteration))
            self.pipeline.poll(in_flight)
        verdict = self.pipeline.finish(groups, in_flight, self.iteration)
        self._last_round = [work for exchange in in_flight for work in exchange.works()]
        self.iteration += 1
        self.pipeline.stats.end_step()
        if verdict.action == RAISE:
            assert verdict.error is not None
            raise verdict.error
        if verdict.action == SKIP:
            for group in groups:
                group.target.zero()
        for parameter, view, index in copies:
            if outputs is not None:
                if outputs[index].data_ptr() != view.data_ptr():
                    outputs[index].copy_(view)
            elif parameter.grad is None or parameter.grad.data_ptr() != view.data_ptr():
                parameter.grad = view  # from now on backward accumulates into the buffer

    def stats(self) -> dict[str, float]:
        """See :meth:`gradwire.CommHookState.stats`."""
        snapshot = self.pipeline.stats.snapshot()
        snapshot["residual_norm"] = self.feedback.norm() if self.feedback is not None else 0.0
        snapshot.update(self.pipeline.summary())
        return snapshot

    def state_dict(self, gather: bool = False) -> dict[str, Any]:
        """See :meth:`gradwire.CommHookState.state_dict` (``gather=True`` is a collective)."""
        return self.pipeline.state_dict(names=self._names, specs=self._specs, iteration=self.iteration, gather=gather)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """See :meth:`gradwire.CommHookState.load_state_dict` (tensors go to the parameters' device)."""
        device = self.parameters[0].device if self.parameters else "cpu"
        self.iteration = self.pipeline.load_state_dict(state, names=self._names, specs=self._specs, device=device)

    def _buffer(self, index: int, bucket: list[torch.Tensor]) -> torch.Tensor:
        buffer = self._buffers[index]
        if buffer is None:
            first = bucket[0]
            buffer = torch.zeros(sum(p.numel() for p in bucket), dtype=first.dtype, device=first.device)
            self._buffers[index] = buffer
        return buffer


def _buckets(tensors: list[torch.Tensor], cap_bytes: float) -> list[list[torch.Tensor]]:
    """Reverse order, about ``cap_bytes`` each, one dtype and device per bucket (one flat buffer)."""
    buckets: list[list[torch.Tensor]] = []
    size = cap_bytes
    for tensor in reversed(tensors):
        if size >= cap_bytes or (tensor.dtype, tensor.device) != (buckets[-1][0].dtype, buckets[-1][0].device):
            buckets.append([])
            size = 0
        buckets[-1].append(tensor)
        size += tensor.numel() * tensor.element_size()
    return buckets


def _tensor_list(tensors: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    out = list(tensors)
    if not all(isinstance(t, torch.Tensor) for t in out):
        raise ValueError("GradientExchange takes a torch.nn.Module or a sequence of tensors")
    return out


def _distributed(group: Optional[dist.ProcessGroup]) -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1


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
