"""FSDP2 for the harness: which modules ``gradwire train --fsdp`` shards, and a single-process
simulation of gradwire's compressed reduce-scatter for :func:`~.simulate.simulate`.

:func:`units` is the wrapping policy: every transformer block (a module whose class name ends in
``Block`` or is a ``TransformerEncoderLayer``/``DecoderLayer``), else every top-level child that
holds parameters; then the root, which takes the parameters left over (embeddings, final norm,
head). :func:`unit_parameters` gives each unit's parameter names in FSDP's order, which fixes the
flat layout of its reduce-scatter (:mod:`gradwire.fsdp.layout`).

:class:`ShardedReduce` is a ``reduce`` for :func:`~.simulate.simulate` that does per FSDP unit
what ``gradwire.fsdp.compress`` does on W ranks, with W simulated workers:

* ``quantize="int8" | "int4"``: each worker adds its residual to its flat gradient, quantizes every
  destination chunk blockwise (:func:`gradwire.exchange.blockquant.roundtrip`, blocks restarting
  at every parameter's piece of the chunk) and keeps ``x - D(Q(x))`` as its residual; each owner
  sums the dequantized chunks in worker order, in float32 (``block_size=None``: one scale per
  parameter chunk, the per-tensor comparison);
* a sparsifier (``compressor="topk"``, ``density=``): each worker selects per (parameter,
  destination) piece from ``grad + residual`` with the library's sparsifier, codes the values with
  the value codec (what the owner decodes is what it sums, and what the sender subtracts), keeps
  the rest as its residual; owners sum in worker order;
* neither: the exact fp32 mean (plain FSDP2's reduce-scatter).

The result is divided by W (FSDP's AVG) and handed back per parameter: every worker's full
parameter is the concatenation of the owners' shards, as FSDP2's all-gather makes it.
"""

from __future__ import annotations

import warnings
from typing import Optional, Sequence

import torch
from torch import Tensor, nn

from .. import codecs as codec_layer
from ..core.strategies.sparse_allreduce import RegionCodecAdapter
from ..exchange.blockquant import quantized_bytes, roundtrip
from ..fsdp import layout
from ..sparsify import get_sparsifier

_BLOCK_NAMES = ("TransformerEncoderLayer", "TransformerDecoderLayer")


def units(model: nn.Module) -> list[nn.Module]:
    """The modules to ``fully_shard``, innermost first; the root is last."""
    blocks = [m for m in model.modules() if m is not model
              and (type(m).__name__.endswith("Block") or type(m).__name__ in _BLOCK_NAMES)]
    if not blocks:
        blocks = [child for child in model.children() if any(True for _ in child.parameters())]
    return [*blocks, model]


def unit_parameters(model: nn.Module) -> list[tuple[str, list[str]]]:
    """Per unit (in :func:`units` order): its name and its parameter names in FSDP's order (the
    unit's ``named_parameters()`` order, minus those an inner unit already took)."""
    names = {id(p): n for n, p in model.named_parameters()}
    module_names = {id(m): n for n, m in model.named_modules()}
    taken: set[int] = set()
    out = []
    for unit in units(model):
        mine = [p for p in unit.parameters() if id(p) not in taken]
        taken.update(id(p) for p in mine)
        out.append((module_names[id(unit)], [names[id(p)] for p in mine]))
    return out


class TimedPlainReduceScatter:
    """Plain FSDP2's reduce-scatter (``reduce_scatter_tensor``, FSDP's op, blocking as FSDP2 calls
    it on CPU), timed: installed on every unit for ``gradwire train --fsdp``'s ``allreduce``, so its
    communication phase can be compared with gradwire's. ``stats()`` looks like gradwire's."""

    def __init__(self, model: nn.Module, bytes_per_step: float) -> None:
        from torch.distributed.fsdp import FSDPModule
        from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter

        from ..lifetime import wait_for

        timed = self

        class Timed(ReduceScatter):
            def allocate(self, size: object, *, dtype: torch.dtype, device: torch.device) -> Tensor:
                return torch.empty(*size, dtype=dtype, device=device)  # type: ignore[misc]

            def __call__(self, output_tensor: Tensor, input_tensor: Tensor, group: object, op: object,
                         async_op: bool = False) -> None:
                import time

                from ..exchange.checked import reduce_scatter_single

                started = time.perf_counter()
                work = reduce_scatter_single(output_tensor, input_tensor, op=op, group=group, async_op=True)
                wait_for(work, None, "reduce_scatter_tensor (plain FSDP2)")
                timed.seconds += time.perf_counter() - started
                return None

        self.seconds, self.last_seconds, self.bytes_per_step = 0.0, 0.0, bytes_per_step
        for module in model.modules():
            if isinstance(module, FSDPModule) and module._get_fsdp_state()._fsdp_param_groups:
                module.set_custom_reduce_scatter(Timed())

    def stats(self) -> dict[str, float]:
        """Seconds in the reduce-scatters since the last call, and the step's bytes."""
        self.last_seconds, self.seconds = self.seconds, 0.0
        return {"seconds_sparsify": 0.0, "seconds_encode": 0.0, "seconds_decode": 0.0,
                "seconds_communicate": self.last_seconds, "bytes_sent": self.bytes_per_step}


def shard(model: nn.Module, mesh: "object | None" = None, **options: object) -> nn.Module:
    """``fully_shard`` every unit of ``model`` (in place) on ``mesh`` (None: the world, 1-D)."""
    from torch.distributed.fsdp import fully_shard

    # torch 2.13 warns on every rank when the root returns a view (ByteGPT's logits are: F.linear on a
    # 3-D input), since an in-place change of it would skip the pre-backward hook. The harness only
    # reads the output (its losses are out of place), so the warning would be noise in every run
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor", category=UserWarning)

    for unit in units(model):
        fully_shard(unit, mesh=mesh, **options)
    return model


class ShardedReduce:
    """A ``reduce`` for :func:`~.simulate.simulate`: gradwire's compressed reduce-scatter per
    FSDP unit, for ``workers`` simulated ranks (module docstring).

    Args:
        model: the workload's model (only its parameter names and shapes are read).
        workers: W.
        quantize: None, ``"int8"`` or ``"int4"``.
        block_size: values per scale (None: one per parameter chunk).
        compressor, density: a gradwire sparsifier and its density (ignored with ``quantize``;
            ``compressor="none"``: the exact mean).
        value_codec, index_codec: the sparse payload's codecs (the index codec must be lossless).
        error_feedback: keep what was not sent, per worker.
        residual_dtype: the residuals' storage dtype (float32 or bfloat16).
        seed: the sparsifier's seed.
        aligned: quantization blocks restart at every parameter's chunk, as the core's do (False:
            blocks from each destination chunk's start, straddling parameters: the comparison).
        warmup_steps: the exact mean for the first N steps (the core's dense reduce-scatter).
        feedback_decay: β of ``e <- β (x - sent)`` (1: plain error feedback), as the core's.
        all_gather: ``"int8"`` / ``"int4"``: the parameter all-gathers quantized too
            (:meth:`gathered_weights`, for ``simulate(forward_weights=...)``), as
            ``gradwire.fsdp.compress(all_gather=...)`` does; None: exact.
        momentum: b1 of 1-bit Adam's exchange, as ``gradwire.fsdp.compress(momentum=b1)`` runs it
            (:mod:`gradwire.fsdp.momentum`): after the warm-up each worker sends
            ``(1 - b1) g_w + b1 s_w`` through the sparse rule, ``s_w`` being what it sent for the
            unit the step before (its decoded values at its positions; zeros at first). Pair it with
            :class:`~.optimizers.OneBitAdamW` (the gradient it is handed is then the averaged
            momentum). Needs a sparsifier with plain error feedback.

    Raises:
        ValueError: ``momentum`` without a sparsifier, with ``quantize``, without error feedback or
            with a decaying one.
    """

    def __init__(self, model: nn.Module, workers: int, *, quantize: Optional[str] = None,
                 block_size: Optional[int] = 128, compressor: str = "none", density: Optional[float] = None,
                 value_codec: str = "fp32", index_codec: str = "rice", error_feedback: bool = True,
                 residual_dtype: torch.dtype = torch.float32, seed: int = 0, aligned: bool = True,
                 warmup_steps: int = 0, feedback_decay: float = 1.0, all_gather: Optional[str] = None,
                 momentum: Optional[float] = None) -> None:
        if momentum is not None and (quantize is not None or compressor == "none" or not error_feedback
                                     or feedback_decay != 1.0 or not 0.0 < momentum < 1.0):
            raise ValueError(f"momentum={momentum!r} needs a sparsifier with plain error feedback (and 0 < b1 < 1)")
        names = [n for n, p in model.named_parameters() if p.requires_grad]
        position = {n: i for i, n in enumerate(names)}
        shapes = dict(model.named_parameters())
        self.units = [members for members in ([position[n] for n in unit_names if n in position]
                                              for _, unit_names in unit_parameters(model)) if members]
        self.shapes = [tuple(shapes[n].shape) for n in names]
        self.workers = workers
        self.bits = {None: None, "int8": 8, "int4": 4}[quantize]
        self.block_size = block_size
        self.sparsifier = None if quantize or compressor == "none" else \
            get_sparsifier(compressor, density=density, seed=seed)
        values, indices = codec_layer.resolve_codecs(value_codec, index_codec, {})
        self.codec = RegionCodecAdapter(index_codec=indices, value_codec=values)
        self.error_feedback = error_feedback
        self.feedback_decay = feedback_decay
        self.all_gather_bits = {None: None, "int8": 8, "int4": 4}[all_gather]
        self.gather_block = block_size or 128
        self.gather_bytes_sent = 0.0  # per worker: the quantized parameter all-gathers' bytes, summed over steps
        self.aligned = aligned
        self.warmup_steps = warmup_steps
        self.residual_dtype = residual_dtype
        #: residuals[w][unit]: worker w's residual over the unit's flat gradient
        self.residuals: list[dict[int, Tensor]] = [{} for _ in range(workers)]
        self.momentum = momentum
        #: bases[w][unit]: (positions, values) worker w sent for the unit on the last step (``momentum``)
        self.bases: list[dict[int, tuple[Tensor, Tensor]]] = [{} for _ in range(workers)]
        self.step = 0
        self.bytes_sent = 0.0  # what every worker handed to the all-to-all for its peers, summed over workers

    def __call__(self, grads: Sequence[Sequence[Tensor]]) -> list[Tensor]:
        out: list[Optional[Tensor]] = [None] * len(self.shapes)
        for unit, members in enumerate(self.units):
            shapes = [self.shapes[i] for i in members]
            flats = [layout.flatten([grads[w][i].float() for i in members], self.workers)
                     for w in range(self.workers)]
            warming = self.step < self.warmup_steps
            if self.bits is not None and not warming:
                total = self._quantized(unit, flats, shapes)
            elif self.sparsifier is not None and not warming:
                total = self._sparse(unit, flats, shapes, members)
            else:  # plain FSDP2's reduce-scatter (or the warm-up's): each worker sends its p-1 other chunks
                total = flats[0].clone()
                for flat in flats[1:]:
                    total += flat
                self.bytes_sent += 4.0 * (self.workers - 1) * total.numel()  # summed over the p workers
            total /= self.workers
            for i, tensor in zip(members, layout.unflatten(total, shapes, self.workers)):
                out[i] = tensor
        self.step += 1
        return out  # type: ignore[return-value]

    def plain_bytes_per_worker(self) -> float:
        """What plain FSDP2's float32 reduce-scatter sends per worker and step: ``4 (p - 1) s`` per
        unit, ``s`` the unit's padded shard (what :attr:`bytes_sent` counts for an exact step)."""
        return float(sum(4 * (self.workers - 1) * layout.shard_numel([self.shapes[i] for i in members], self.workers)
                         for members in self.units))

    def gathered_weights(self, parameters: Sequence[Tensor]) -> list[Tensor]:
        """The parameters every worker computes with under a quantized all-gather: per unit, each
        destination chunk blockwise quantized (blocks restarting at every parameter), dequantized;
        the exact parameters during the warm-up steps.

        Args:
            parameters: one worker's parameters, in model order (requires_grad ones).

        Returns:
            One tensor per parameter, shaped like it.
        """
        assert self.all_gather_bits is not None
        if self.step < self.warmup_steps:  # the warm-up gathers exactly, as the library's does
            # an exact float32 all-gather moves what the exact reduce-scatter does: (p - 1) shards
            self.gather_bytes_sent += self.plain_bytes_per_worker()
            return [p.detach() for p in parameters]
        out: list[Optional[Tensor]] = [None] * len(parameters)
        for members in self.units:
            shapes = [self.shapes[i] for i in members]
            flat = layout.flatten([parameters[i].detach().float() for i in members], self.workers)
            x = flat.reshape(self.workers, -1)
            segments = [layout.chunk_numel(shape, self.workers) for shape in shapes]
            _, values = roundtrip(x, bits=self.all_gather_bits, block_size=self.gather_block, segments=segments)
            self.gather_bytes_sent += (self.workers - 1) * quantized_bytes(
                x.shape[-1], self.all_gather_bits, self.gather_block, segments) / self.workers
            for i, tensor in zip(members, layout.unflatten(values.reshape(-1), shapes, self.workers)):
                out[i] = tensor.to(parameters[i].dtype)
        return out  # type: ignore[return-value]

    def _compensated(self, w: int, unit: int, flat: Tensor) -> Tensor:
        residual = self.residuals[w].get(unit)
        return flat if residual is None else flat + residual.float()

    def _keep(self, w: int, unit: int, residual: Tensor) -> None:
        if self.error_feedback:
            self.residuals[w][unit] = (residual * self.feedback_decay).to(self.residual_dtype)

    def _quantized(self, unit: int, flats: list[Tensor], shapes: list[tuple[int, ...]]) -> Tensor:
        total: Optional[Tensor] = None
        for w, flat in enumerate(flats):
            x = self._compensated(w, unit, flat).reshape(self.workers, -1)
            # blocks restart at every parameter's chunk, as the core's quantized reduce-scatter does
            segments = [layout.chunk_numel(shape, self.workers) for shape in shapes]
            block = max(segments) if self.block_size is None else self.block_size  # None: one scale per chunk
            _, local = roundtrip(x, bits=self.bits, block_size=max(1, block),
                                 segments=segments if self.aligned else None)
            self._keep(w, unit, (x - local).reshape(-1))
            # every worker sends its p - 1 other chunks (the one it owns stays)
            self.bytes_sent += (self.workers - 1) * quantized_bytes(
                x.shape[-1], self.bits, max(1, block), segments if self.aligned else None)
            total = local.reshape(-1).clone() if total is None else total + local.reshape(-1)
        assert total is not None
        return total

    def _sparse(self, unit: int, flats: list[Tensor], shapes: list[tuple[int, ...]], members: list[int]) -> Tensor:
        assert self.sparsifier is not None
        pieces = layout.pieces(shapes, self.workers)
        total = torch.zeros_like(flats[0])
        for w, flat in enumerate(flats):
            if self.momentum is not None:  # 1-bit Adam's exchange: this worker's momentum goes out
                flat = flat * (1.0 - self.momentum)
                base = self.bases[w].get(unit)
                if base is not None:
                    flat.index_add_(0, base[0], base[1], alpha=self.momentum)
            x = self._compensated(w, unit, flat)
            residual = x.clone()
            sent_positions: list[Tensor] = []
            sent_values: list[Tensor] = []
            for piece in pieces:
                part = x[piece.offset: piece.offset + piece.numel]
                indices = self.sparsifier.select(part, step=self.step,
                                                 tensor_id=members[piece.parameter] * self.workers + piece.chunk)
                if indices.numel() == 0:
                    continue
                data, sent = self.codec.encode(indices=indices, values=part[indices], numel=piece.numel)
                self.bytes_sent += len(data) * (piece.chunk != w)
                positions = indices + piece.offset
                total[positions] += sent
                residual[positions] -= sent
                sent_positions.append(positions)
                sent_values.append(sent.float())
            self._keep(w, unit, residual)
            if self.momentum is not None:  # the next step's base: what this worker sent (nothing: no base)
                self.bases[w].pop(unit, None)
                if sent_positions:
                    self.bases[w][unit] = (torch.cat(sent_positions), torch.cat(sent_values))
        return total

