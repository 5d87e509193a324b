"""DiLoCo on the simulator's W replicas (:mod:`.simulate`): the front-end's rules, in one process.

:class:`SimulatedDiLoCo` plugs into :func:`~.simulate.simulate` (``reduce``, ``after_step``,
``eval_model``) and runs the algorithm of :class:`gradwire.DiLoCo` over W simulated workers, so
quality experiments cost one process instead of W. It is kept the same as the front-end in three
ways:

* the outer arithmetic and the schedule are the front-end's own code: Δ, the error-feedback decay,
  the outer optimizer, the merge (:mod:`gradwire.local_steps.outer`, one ``OuterState`` per worker)
  and the fragments (:mod:`gradwire.local_steps.fragments`);
* each worker's compression runs the core's own pieces: ``check_entries``, ``Selection`` with the
  core's ``ErrorFeedback`` (residuals keyed per worker), ``encode_bucket`` for the AllGather's
  payloads, ``blockquant.roundtrip`` for the quantized AllReduce, and the frame-size rules for
  its bytes;
* what a strategy does *across* ranks — sum the received contributions in rank order, divide by the
  world size, keep ``compensated - sent`` — is replayed here in the same order, and
  ``tests/test_diloco_sim.py`` checks the global parameters against real gloo ranks of
  ``gradwire.DiLoCo`` bit for bit (dense and the shared-support AllReduce at p = 2, where gloo's
  sum has one order; AllGather and quantized, which sum in rank order themselves, at p = 3), and
  the bytes it counts within 2%. Floating buffers are averaged at each sync as the front-end does.

Strategies: ``dense``, the payload ``allgather`` (also what ``collective="auto"`` runs here: the
α–β–γ choice needs a link the simulator does not have), the ``sparse-allreduce``
(:mod:`.sparse_allreduce_sim`), the ``allreduce`` of shared supports, and ``quantize``. The
hierarchical exchange is not replayed (``ValueError``).
"""

from __future__ import annotations

import copy
import math
from typing import Any, Callable, Optional, Sequence

import torch
from torch import Tensor, nn

from ..core.config import CAST_VALUE_CODECS, QUANTIZE_BITS, ExchangeConfig
from ..core.frames import FRAME_HEADROOM, FrameSizes
from ..core.group import Group, check_entries
from ..core.payload import Part, encode_bucket
from ..core.pipeline import build_feedback
from ..core.planner import target_k
from ..core.selection import Selection
from ..core.stats import ExchangeStats
from ..core.strategies.allgather import count_slack
from ..exchange import FRAME_HEADER_BYTES, ring_allreduce_bytes
from ..exchange.blockquant import quantized_bytes, roundtrip
from ..local_steps.fragments import assign_fragments, fragment_due, layers_of
from ..local_steps.options import LocalStepsConfig, default_unsent
from ..local_steps.outer import OuterState, feedback_input, fragment_group, sgd_factory, unsent_to_model
from .simulate import exact_mean
from .sparse_allreduce_sim import SimulatedSparseAllReduce

_WIRE_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


class SimulatedDiLoCo:
    """The DiLoCo front-end's algorithm over ``workers`` simulated workers.

    Args:
        workers: W.
        total_steps: the run's inner steps: after the last one every fragment syncs (as the harness
            calls ``DiLoCo.synchronize()`` before it evaluates).
        sync_every ... merge_alpha: as :class:`gradwire.DiLoCo`.
        **options: the outer exchange's options, as :class:`gradwire.DiLoCo` takes them.

    Use: ``simulate(..., reduce=sim.reduce, after_step=sim.after_step, eval_model=sim.eval_model,
    on_start=sim.bind)``.
    ``bytes_sent`` counts what one worker would send (the warm-up's AllReduces included), with the
    strategies' own byte rules.
    """

    def __init__(self, workers: int, total_steps: int, *, sync_every: int, outer_lr: float = 0.7,
                 outer_momentum: float = 0.9, nesterov: bool = True, warmup_steps: int = 0, fragments: int = 1,
                 overlap_steps: int = 0, feedback_decay: float = 1.0, merge_alpha: float = 0.5,
                 overlap_merge: str = "mix", unsent: Optional[str] = None, warmup_quantize: Optional[str] = None,
                 warmup_exact_steps: int = 0, compressor: str = "none",
                 **options: Any) -> None:
        self.config = ExchangeConfig(compressor=compressor, **{"value_codec": "fp32", **options})
        self.local = LocalStepsConfig(sync_every=sync_every, outer_lr=outer_lr, outer_momentum=outer_momentum,
                                      nesterov=nesterov, warmup_steps=warmup_steps, fragments=fragments,
                                      overlap_steps=overlap_steps, feedback_decay=feedback_decay,
                                      merge_alpha=merge_alpha, overlap_merge=overlap_merge,
                                      unsent=default_unsent(self.config) if unsent is None else unsent,
                                      warmup_quantize=warmup_quantize, warmup_exact_steps=warmup_exact_steps)
        self.workers, self.total_steps = workers, total_steps
        self.exchange = SimulatedExchange(self.config, workers)
        #: the warm-up's gradient average: DDP's exact mean, or the front-end's quantized GradientExchange
        self.warmup = (SimulatedHook(workers, compressor="none", quantize=warmup_quantize,
                                     warmup_steps=warmup_exact_steps) if warmup_quantize else None)
        self.outer: list[OuterState] = []
        self.deltas: list[list[Tensor]] = []
        self.keys: list[list[Any]] = []
        self.buffers: list[list[Tensor]] = []
        self.rounds = self.outer_steps = 0
        self.bytes_sent = self.bytes_outer = self.bytes_peak_sync = 0.0
        self.steps_done = 0
        self.origin = warmup_steps
        self._pending: Optional[tuple[list[int], int, list[Tensor], Optional[Tensor]]] = None
        #: called with the workers' models at the last step, once its outer step (and any still in
        #: flight) is applied and before the final synchronize: θ without that plain-average exchange
        self.before_final_synchronize: Optional[Callable[[Sequence[nn.Module]], None]] = None
        #: whether the final synchronize exchanged (the workers did not hold θ: unsent="model",
        #: fragments, overlap, or a run that does not end on a sync step)
        self.final_synchronize_exchanged = False

    # ------------------------------------------------------------------ simulate's plug points
    def reduce(self, grads: Sequence[Sequence[Tensor]], models: Optional[Sequence[nn.Module]] = None
               ) -> Optional[list[Tensor]]:
        """The warm-up's synchronous steps: DDP's mean; afterwards every worker steps on its own.

        The first call (before any optimizer step) takes θ from the models' initial parameters:
        pass ``models`` then, or :meth:`bind` them before training."""
        if not self.outer:
            if models is None:
                raise ValueError("SimulatedDiLoCo: bind(models) before the first step (θ is the initial parameters)")
            self.bind(models)
        if self.steps_done < self.local.warmup_steps:
            if self.warmup is not None:
                before = self.warmup.bytes_sent
                averaged = self.warmup.reduce(grads)
                self.bytes_sent += self.warmup.bytes_sent - before
                return averaged
            numel = sum(g.numel() for g in grads[0])
            self.bytes_sent += ring_allreduce_bytes(numel, 4, self.workers)
            return exact_mean(grads)
        return None

    def after_step(self, step: int, models: Sequence[nn.Module], optimizers: Sequence[torch.optim.Optimizer]) -> None:
        """The front-end's post-hook, for every worker at once (``DiLoCo._after_inner_step``)."""
        if not self.outer:
            raise ValueError("SimulatedDiLoCo: bind(models) before the first step (θ is the initial parameters)")
        self.steps_done = step
        if step <= self.local.warmup_steps:
            if step == self.local.warmup_steps:
                for state in self.outer:
                    state.capture()
            if step < self.total_steps:
                return
        local_step = step - self.origin
        if self._pending is not None and local_step >= self._pending[1]:
            self._merge()
        fragment = fragment_due(local_step, self.local.sync_every, self.local.fragments)
        if fragment is not None and step > self.local.warmup_steps:
            self._start([fragment], local_step + self.local.overlap_steps)
            if self.local.overlap_steps == 0:
                self._merge()
        if step == self.total_steps:  # the harness's synchronize() before its evaluation
            if self._pending is not None:
                self._merge()
            if self.before_final_synchronize is not None:
                self.before_final_synchronize(models)
            if step > self.local.warmup_steps and not self._in_sync():
                self._start(list(range(self.local.fragments)), 0)
                self._merge(alpha=0.0, into_model=False, outer_step=False)
                self.final_synchronize_exchanged = True

    def eval_model(self, models: Sequence[nn.Module]) -> nn.Module:
        """A copy of worker 0's model holding the global parameters θ (what every rank agrees on);
        in the warm-up, worker 0's model itself (every worker's is the same, and θ is taken at its end)."""
        if self.steps_done < self.local.warmup_steps or not self.outer:
            return models[0]
        model = copy.deepcopy(models[0])
        if self.outer:
            copy_parameters = [p for p in model.parameters() if p.requires_grad]
            with torch.no_grad():
                for members, views in zip(self.outer[0].fragments, self.outer[0].global_views):
                    for index, view in zip(members, views):
                        copy_parameters[index].copy_(view)
        return model

    # ------------------------------------------------------------------ one sync
    def bind(self, models: Sequence[nn.Module]) -> None:
        """Take the W replicas (before their first step: θ is their initial parameters)."""
        named = [(n, p) for n, p in models[0].named_parameters() if p.requires_grad]
        members = assign_fragments(layers_of(named), self.local.fragments)
        factory = sgd_factory(self.local.outer_lr, self.local.outer_momentum, self.local.nesterov)
        for model in models:
            parameters = [p for p in model.parameters() if p.requires_grad]
            state = OuterState(parameters, members, factory)
            self.outer.append(state)
            self.deltas.append([torch.zeros(state.numel(f)) for f in range(len(members))])
            self.keys.append([id(p) for p in parameters])
            self.buffers.append([b for b in model.buffers() if b.is_floating_point()])
        every = [n for n, _ in models[0].named_parameters()]
        self.tensor_ids = [every.index(n) for n, _ in named]

    def _in_sync(self) -> bool:
        return self.local.fragments == 1 and self.local.overlap_steps == 0 and self.local.unsent == "residual" \
            and (self.steps_done - self.origin) % self.local.sync_every == 0

    def _start(self, fragments: list[int], finish_at: int) -> None:
        averaged = []
        sent = 0.0
        for fragment in fragments:
            groups = []
            for worker, state in enumerate(self.outer):
                members, offsets = state.fragments[fragment], state.offsets[fragment]
                delta = state.pseudo_gradient(fragment, self.deltas[worker][fragment], keep_start=self.local.carries)
                feedback_input(delta, self.exchange.feedback[worker], self.local.feedback_decay, members, offsets,
                               self.keys[worker])
                groups.append(fragment_group(delta, state.parameters, members, offsets, self.keys[worker],
                                             self.tensor_ids, float(self.workers)))
            result, nbytes = self.exchange.average(groups, self.rounds)
            averaged.append(result)
            sent += nbytes
        buffers = None
        if self.buffers[0]:  # the floating buffers' mean, as of the sync's start (the front-end's AllReduce)
            flats = [torch.cat([b.detach().reshape(-1).to(torch.float32) for b in own]) for own in self.buffers]
            buffers = flats[0].clone()
            for flat in flats[1:]:
                buffers += flat
            buffers.div_(self.workers)
            sent += ring_allreduce_bytes(buffers.numel(), 4, self.workers)
        self.rounds += 1
        self.bytes_outer += sent
        self.bytes_sent += sent
        self.bytes_peak_sync = max(self.bytes_peak_sync, sent)
        self._pending = (fragments, finish_at, averaged, buffers)

    def _merge(self, alpha: Optional[float] = None, into_model: bool = True, outer_step: bool = True) -> None:
        assert self._pending is not None
        fragments, _, averaged, buffers = self._pending
        self._pending = None
        carry = alpha is None and self.local.carries
        if alpha is None:
            alpha = self.local.merge_alpha if self.local.overlap_steps else 0.0
        model_holds = into_model and self.local.unsent == "model"
        for worker, state in enumerate(self.outer):
            for fragment, result in zip(fragments, averaged):
                if outer_step:
                    state.apply(fragment, result.clone())
                else:  # the front-end's synchronize(): a plain average, no outer step
                    state.average(fragment, result.clone())
                if model_holds:
                    unsent_to_model(state, fragment, self.exchange.feedback[worker], self.keys[worker], alpha,
                                    self.local.feedback_decay, carry=carry)
                else:
                    state.merge(fragment, alpha, carry=carry)
            if buffers is not None:
                with torch.no_grad():
                    position = 0
                    for buffer in self.buffers[worker]:
                        buffer.copy_(buffers[position: position + buffer.numel()].view(buffer.shape))
                        position += buffer.numel()
        self.outer_steps += int(outer_step)



class SimulatedExchange:
    """One group per worker in, the average every rank writes out: the core's strategies replayed
    across W workers in one process (the module docstring says how they are kept the same).

    Args:
        config: the exchange's options; ``collective="auto"`` runs the AllGather (or the shared
            support's AllReduce), ``"sparse-allreduce"`` the replay of :mod:`.sparse_allreduce_sim`;
            ``hierarchy`` is refused.
        workers: W; worker w's residuals live in ``feedback[w]``.

    Raises:
        ValueError: an exchange the simulator does not replay.
    """

    def __init__(self, config: ExchangeConfig, workers: int) -> None:
        if config.hierarchy is not None:
            raise ValueError("the simulator replays dense, allgather, sparse-allreduce, allreduce and quantize "
                             f"exchanges; hierarchy={config.hierarchy!r} needs real ranks (gradwire train)")
        self.config, self.workers = config, workers
        self.sparsifier = config.build_sparsifier()
        self.feedback = [build_feedback(config) for _ in range(workers)]  # as the core's pipeline builds it
        self.selection = [Selection(self.sparsifier, feedback, config.scope, ExchangeStats())
                          if self.sparsifier is not None else None for feedback in self.feedback]
        self.frames = FrameSizes(headroom=FRAME_HEADROOM + count_slack(self.sparsifier))
        self.sparse_allreduce = (SimulatedSparseAllReduce(config, workers)
                                 if config.collective == "sparse-allreduce" else None)

    def average(self, groups: list[Group], step: int) -> tuple[Tensor, float]:
        """The averaged result of ``groups`` (worker w's is ``groups[w]``; flat float32, what every
        rank writes) and the bytes one worker sends; error feedback updated.

        Raises:
            FloatingPointError: some worker's input holds NaN/Inf.
        """
        config, p = self.config, self.workers
        for group in groups:
            check_entries(group)
            if not group.finite:
                raise FloatingPointError(f"NaN or Inf in a worker's input at step {step}")
        numel = groups[0].numel
        if config.quantize is not None:
            return self._quantized(groups)
        if self.sparsifier is None or config.collective == "dense":
            total = groups[0].flat_gradient().to(torch.float32, copy=True)
            for group in groups[1:]:
                total += group.flat_gradient()
            return total.div_(p), ring_allreduce_bytes(numel, 4, p)
        for worker, group in enumerate(groups):
            self.selection[worker].run(group, step)
        shared = self.sparsifier.shared_support and (config.collective == "allreduce" or (
            config.collective == "auto" and config.value_codec.name in CAST_VALUE_CODECS))
        if shared:
            return self._shared_support(groups)
        if self.sparse_allreduce is not None:
            assert self.sparsifier is not None
            return self.sparse_allreduce.average(groups, target_k(self.sparsifier, groups[0]), step, self.feedback)
        return self._allgather(groups)

    def _allgather(self, groups: list[Group]) -> tuple[Tensor, float]:
        """``PayloadAllGather``: each worker's payload; the receivers sum every one in rank order."""
        p, numel = self.workers, groups[0].numel
        out = torch.zeros(numel)
        lengths = []
        for worker, group in enumerate(groups):
            encoded = encode_bucket([Part(e.compensated, e.indices, e.offset) for e in group.entries], numel,
                                    index_codec=self.config.index_codec, value_codec=self.config.value_codec)
            lengths.append(len(encoded.payload))
            out.index_add_(0, encoded.positions, encoded.values.to(torch.float32) / p)
            feedback = self.feedback[worker]
            if feedback is not None:
                for entry, sent in zip(group.entries, encoded.sent):
                    if not entry.unused:
                        feedback.update(entry.key, entry.compensated, sent.indices, sent.values)
        signature = groups[0].signature()
        capacity = self.frames.capacity(signature)
        if capacity is None:  # first sight of the layout: a lengths round, then padded payloads
            nbytes = 8.0 * (p - 1) + (p - 1) * max(lengths)
        else:
            nbytes = float((p - 1) * (FRAME_HEADER_BYTES + capacity))
            if max(lengths) > capacity:
                nbytes += (p - 1) * (max(lengths) - capacity)
        self.frames.learn(signature, lengths)
        return out, nbytes

    def _shared_support(self, groups: list[Group]) -> tuple[Tensor, float]:
        """``SharedSupportAllReduce``: the values at the shared positions, cast, summed in rank order."""
        p, numel = self.workers, groups[0].numel
        wire = _WIRE_DTYPES.get(self.config.value_codec.name, torch.float32)
        total: Optional[Tensor] = None
        for worker, group in enumerate(groups):
            sent = torch.cat([e.compensated[e.indices] for e in group.entries]).to(wire)
            total = sent.clone() if total is None else total + sent  # summed in the wire dtype, as on the wire
            feedback = self.feedback[worker]
            position = 0
            for entry in group.entries:
                k = entry.indices.numel()
                if feedback is not None and not entry.unused:
                    feedback.update(entry.key, entry.compensated, entry.indices, sent[position: position + k])
                position += k
        assert total is not None
        out = torch.zeros(numel)
        averaged, position = total.to(torch.float32) / p, 0
        for entry in groups[0].entries:
            k = entry.indices.numel()
            out[entry.offset + entry.indices] = averaged[position: position + k]
            position += k
        return out, ring_allreduce_bytes(total.numel() + 1, torch.empty((), dtype=wire).element_size(), p)

    def _quantized(self, groups: list[Group]) -> tuple[Tensor, float]:
        """``QuantizedAllReduce`` (:mod:`gradwire.exchange.quantized`): each worker's chunks quantized,
        owner j's float32 sum in rank order, re-quantized, applied by everyone as decoded."""
        bits, block = QUANTIZE_BITS[self.config.quantize], self.config.quantize_block
        applied, errors, nbytes = replay_quantized_allreduce(self.compensated(groups), bits, block)
        self.keep_residuals(groups, errors)
        return applied.div_(self.workers), nbytes

    def compensated(self, groups: list[Group]) -> list[Tensor]:
        """Per worker, its group's flat gradient plus its used entries' residuals (float32, new), as
        the quantized strategy builds it (:meth:`~gradwire.core.group.Group.compensated_input`)."""
        return [group.compensated_input(self.feedback[worker]) for worker, group in enumerate(groups)]

    def keep_residuals(self, groups: list[Group], residuals: list[Tensor]) -> None:
        """Worker w's residuals := ``residuals[w]`` (flat, its group's space), per used entry."""
        for worker, group in enumerate(groups):
            feedback = self.feedback[worker]
            if feedback is None:
                continue
            for entry in group.entries:
                if not entry.unused:
                    feedback.replace(entry.key, residuals[worker][entry.offset: entry.offset + entry.numel].clone())


def replay_quantized_allreduce(inputs: list[Tensor], bits: int, block: int) -> tuple[Tensor, list[Tensor], float]:
    """``QuantizedAllReduce`` (:mod:`gradwire.exchange.quantized`) over W workers' vectors, in one process.

    Each worker's ``p`` chunks quantized, owner j's float32 sum of chunk j in rank order,
    re-quantized; every rank applies the re-quantized sums as decoded (two workers: the sum of
    their whole inputs' decodings, as the exchange's swap).

    Args:
        inputs: per worker, (n,) float32, the same n.
        bits: the codec's bits per value (``QUANTIZE_BITS``); block: values per scale.

    Returns:
        The sum every rank applies (n,) float32 (not yet divided by W); per worker what it did not
        send, (n,) float32 (its quantization error, plus the owner's re-quantization error on the
        chunk it owns); the bytes one worker sends.
    """
    p, numel = len(inputs), inputs[0].numel()
    if p == 2:  # the exchange's swap of two: each rank adds both decodings, nothing re-quantized
        (packed, first), (_, second) = (roundtrip(flat, bits=bits, block_size=block) for flat in inputs)
        return first + second, [inputs[0] - first, inputs[1] - second], float(packed.numel())
    chunk = math.ceil(numel / p)
    locals_, errors = [], []
    for flat in inputs:
        padded = torch.nn.functional.pad(flat, (0, p * chunk - numel)).reshape(p, chunk)
        _, local = roundtrip(padded, bits=bits, block_size=block)
        locals_.append(local)
        errors.append(padded - local)
    applied = torch.zeros(p, chunk)
    for owner in range(p):
        shard = locals_[0][owner].clone()
        for source in range(1, p):
            shard += locals_[source][owner]
        _, requantized = roundtrip(shard, bits=bits, block_size=block)
        errors[owner][owner] += shard - requantized
        applied[owner] = requantized
    return (applied.reshape(-1)[:numel], [error.reshape(-1)[:numel] for error in errors],
            2.0 * (p - 1) * quantized_bytes(chunk, bits, block))


class SimulatedHook:
    """A per-step compressed gradient average over the simulator's workers (what the DDP hook with
    these options does every step), as ``simulate``'s ``reduce``; ``bytes_sent`` as one worker sends.

    Args:
        workers: W.
        **options: the hook's options (:class:`gradwire.CommHookState`).
    """

    def __init__(self, workers: int, **options: Any) -> None:
        self.config = ExchangeConfig(**options)
        self.exchange = SimulatedExchange(self.config, workers)
        self.workers, self.step, self.bytes_sent = workers, 0, 0.0
        self._buffers: list[Tensor] = []

    def reduce(self, grads: Sequence[Sequence[Tensor]]) -> list[Tensor]:
        numels = [g.numel() for g in grads[0]]
        # one bucket in reverse parameter order, as DDP and GradientExchange lay gradients out (the
        # quantized exchange's blocks depend on it); a model under 25 MiB is one bucket there too
        order = list(reversed(range(len(numels))))
        offsets = [0] * len(numels)
        position = 0
        for index in order:
            offsets[index] = position
            position += numels[index]
        if not self._buffers:
            self._buffers = [torch.zeros(sum(numels)) for _ in grads]
        keys = list(range(len(numels)))
        groups = []
        for worker, own in enumerate(grads):
            buffer = self._buffers[worker]
            for gradient, offset, numel in zip(own, offsets, numels):
                buffer[offset: offset + numel].copy_(gradient.reshape(-1))
            # residuals are keyed per worker by parameter index (each worker has its own feedback)
            groups.append(fragment_group(buffer, list(own), order, [offsets[i] for i in order], keys, keys,
                                         float(self.workers)))
        if self.step < self.config.warmup_steps:
            averaged = torch.stack([g.flat_gradient() for g in groups]).mean(dim=0)
            nbytes = ring_allreduce_bytes(sum(numels), 4, self.workers)
        else:
            averaged, nbytes = self.exchange.average(groups, self.step)
        self.step += 1
        self.bytes_sent += nbytes
        return [averaged[o: o + n].view_as(g) for o, n, g in zip(offsets, numels, grads[0])]
