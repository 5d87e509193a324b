"""``topk``: the exact k largest magnitudes — the reference every approximate sparsifier is measured against.

``torch.topk`` over millions of elements is a selection over the whole tensor and slow on the
CPU (about 0.25 s for ResNet-18's 11M gradients, one thread). The result does not need it: if
at least ``k`` elements have ``|x| >= t`` for some ``t``, the k largest are all among them. So
large tensors take a threshold from an evenly spaced sample, set low enough that it almost
always leaves a few more than ``k`` candidates, scan once for ``|x| >= t`` and pick the exact
top-k of the candidates only. Too few candidates lower ``t`` and rescan; the answer is exact
either way, only the time depends on the sample.

On the CPU the picking runs in numpy: ``np.partition`` finds the k-th largest of ~100k
candidates in 0.13 ms where ``torch.topk`` + ``torch.sort`` take 3.8 ms (one thread, measured
here), and a threshold mask keeps the positions ascending with no sort at all.

With error feedback the selection reads ``grad + residual``, which compensation has just
written: :func:`compensated_largest_magnitudes` does both in one chunked pass (add a chunk,
scan it while it is still in cache), so the compensated tensor crosses memory once.
"""

from __future__ import annotations

import functools
import math
from typing import Optional

import numpy as np
import torch

from .. import kernels
from .base import BudgetSparsifier, register_sparsifier
from .threshold import NUMPY_DTYPES, chunk_buffers, indices_at_or_above, representable_at_least

#: Below this many elements picking over everything is as fast as sampling and scanning
#: (measured here, one thread: 129 us vs 123 us at 36,864 elements).
SCAN_MIN_NUMEL = 1 << 15
#: The scan pays only when it leaves few candidates: above this density pick over everything.
SCAN_MAX_DENSITY = 0.25
#: Sample size for the threshold estimate (evenly spaced, so deterministic and cheap).
SAMPLE_SIZE = 1 << 13
#: Lowering the threshold when a scan left fewer than ``k`` candidates: widen the sample rank by this.
_WIDEN = 4.0
#: Below this many elements a tensor's compensation and top-k run as one native call
#: (``_native.compensate_top``: 8 against 12 us at 512 elements, one thread; at 9216, an FSDP
#: piece of a 384 x 96 weight, 26-43 us against 65-100 for the torch/numpy path's eight calls);
#: from it on the sampled scan (:data:`SCAN_MIN_NUMEL`)
NATIVE_TOP_MAX_NUMEL = SCAN_MIN_NUMEL - 1
#: Elements per chunk of the fused compensate-and-scan: small enough that the chunk, its
#: magnitudes and its mask (9 bytes per float32 element) stay in a core's L2 cache.
FUSED_CHUNK_NUMEL = 1 << 16


@functools.lru_cache(maxsize=1024)
def sample_stride(numel: int) -> int:
    """The step of the evenly spaced threshold sample: about ``numel / SAMPLE_SIZE``, and prime.

    A weight's gradient has structure along its rows (the outer product of the layer's error and
    its input: whole columns large or small). A stride that divides the row length samples the
    same few columns of every row: for the MLP's 2048 x 2048 weight, ``numel / SAMPLE_SIZE`` = 512
    read 4 columns of 2048, the threshold was far off and the scan overflowed its room every
    step (5.7 ms of numpy rescan per step). A prime stride walks every column in turn.
    """
    target = max(1, numel // SAMPLE_SIZE)
    if target < 3:
        return target
    candidate = target
    while candidate > 2 and any(candidate % d == 0 for d in range(2, math.isqrt(candidate) + 1)):
        candidate -= 1
    return candidate


def topk_indices(magnitudes: torch.Tensor, k: int) -> torch.Tensor:
    """Ascending int64 positions of the ``k`` largest entries of ``magnitudes`` (1-D, no NaN,
    ``k <= numel``). Ties at the k-th value keep the first positions."""
    if magnitudes.device.type == "cpu" and magnitudes.dtype in NUMPY_DTYPES:
        return torch.from_numpy(_largest_numpy(magnitudes.detach().contiguous().numpy(), k))
    # sorted=False: ordering by value is wasted work, we need ordering by position instead.
    _, indices = torch.topk(magnitudes, k, sorted=False)
    indices, _ = torch.sort(indices)
    return indices


def _largest_numpy(magnitudes: np.ndarray, k: int) -> np.ndarray:
    """Ascending int64 positions of the ``k`` largest of ``magnitudes`` (no NaN): the k-th largest
    by ``np.partition``, everything above it, then the first tied ones up to ``k``."""
    n = magnitudes.size
    if k >= n:
        return np.arange(n, dtype=np.int64)
    kth = np.partition(magnitudes, n - k)[n - k]
    mask = magnitudes > kth
    short = k - int(np.count_nonzero(mask))
    if short:
        tied = np.flatnonzero(magnitudes == kth)
        mask[tied[:short]] = True
    return np.flatnonzero(mask).astype(np.int64, copy=False)


def largest_magnitudes(flat: torch.Tensor, k: int) -> torch.Tensor:
    """Ascending int64 positions of the ``k`` largest ``|flat|``, exactly.

    NaN ranks below every number (it is kept only when fewer than ``k`` elements are not NaN),
    on every path; ties at the k-th magnitude keep the first positions.

    Args:
        flat: (numel,) floating tensor, any device.
        k: ``1 <= k <= numel``.

    Returns:
        (k,) int64, strictly ascending, on ``flat``'s device.
    """
    numel = flat.numel()
    # on a GPU, torch.topk is a radix select and needs no host sync; the sampled threshold's scan
    # would sync twice per tensor (the threshold, the candidates' count)
    if flat.device.type != "cpu" or numel < SCAN_MIN_NUMEL or k > SCAN_MAX_DENSITY * numel:
        return topk_indices(_magnitudes_nan_last(flat), k)
    found = _scan_from_sample(_sample_magnitudes(flat, None, flat.dtype, sample_stride(numel)), numel, k,
                              lambda threshold, capacity: _scan(flat, threshold, capacity))
    if found is not None:
        return _finish(flat, found, k)[0]
    return topk_indices(_magnitudes_nan_last(flat), k)


def compensated_largest_magnitudes(grad: torch.Tensor, residual: Optional[torch.Tensor], out: torch.Tensor,
                                   k: int, flags: Optional[dict] = None, zero_grad: bool = False) -> torch.Tensor:
    """``out = grad + residual`` (``out = grad`` without a residual) and the top-k of ``|out|``.

    The same result as compensating, then :func:`largest_magnitudes`, with one pass over memory
    on the CPU.

    Args:
        grad: (n,) float gradient (not modified).
        residual: (n,) of ``out``'s dtype, or None.
        out: (n,) float32/float64 buffer that receives the compensated gradient.
        k: ``1 <= k <= n``.
        flags: a dict that receives ``"finite"`` (every element of ``out``) and ``"nonzero"``
            (some element of ``grad``) when the native pass ran (:mod:`gradwire.kernels`), which
            computes them on the way, and ``"zeroed"``; and ``"values"``, ``out`` at the returned
            positions, when the scan read them on its way (the encoder then skips its gather).
        zero_grad: let the native pass zero ``grad`` once read (``flags["zeroed"]`` says if it did).

    Returns:
        Ascending int64 positions of the ``k`` largest ``|out|``, on ``out``'s device.
    """
    numel = grad.numel()
    fused = (out.device.type == "cpu" and out.dtype in NUMPY_DTYPES and numel >= SCAN_MIN_NUMEL
             and k <= SCAN_MAX_DENSITY * numel and out.is_contiguous())
    if not fused:
        native = _compensate_and_top(grad, residual, out, k)
        if native is not None:
            indices, values = native
            if flags is not None:
                flags["values"] = values
            return indices
        _compensate_into(grad, residual, out)
        return largest_magnitudes(out, k)
    sample = _sample_magnitudes(grad.reshape(-1), residual, out.dtype, sample_stride(numel))
    state = {"compensated": False}

    def scan(threshold: float, capacity: int) -> torch.Tensor:
        if state["compensated"]:  # a rescan at a lower threshold reads the compensated tensor
            return _scan(out, threshold, capacity)
        state["compensated"] = True
        return _compensate_and_scan(grad, residual, out, threshold, capacity, flags, zero_grad)

    found = _scan_from_sample(sample, numel, k, scan)
    if not state["compensated"]:
        _compensate_into(grad, residual, out)
    if found is not None:
        indices, values = _finish(out, found, k)
        if flags is not None and found[1] is not None:
            flags["values"] = values
        return indices
    return topk_indices(_magnitudes_nan_last(out), k)


Candidates = "tuple[torch.Tensor, Optional[torch.Tensor]]"


def _sample_magnitudes(flat: torch.Tensor, residual: Optional[torch.Tensor], dtype: torch.dtype,
                       stride: int) -> torch.Tensor:
    """``|flat + residual|`` (``|flat|`` without a residual; the sum in ``dtype``) at every
    ``stride``-th element as float32, NaN as -1 and infinity as float32's largest value
    (``nan_to_num``): the threshold's sample. One native call where
    the kernels take the arrays (0.1 ms less per large tensor here than torch's five calls)."""
    if flat.device.type == "cpu" and flat.dtype == dtype and flat.dim() == 1 \
            and (residual is None or residual.dtype == dtype):
        arrays = (flat.detach().numpy(), None if residual is None else residual.detach().numpy())
        if kernels.usable(*arrays):
            return torch.from_numpy(kernels.sample_magnitudes(arrays[0], arrays[1], stride))
    sample = flat[::stride].to(dtype)
    if residual is not None:
        sample = sample + residual[::stride]
    return sample.abs().float().nan_to_num_(nan=-1.0)


def _scan_from_sample(sample: torch.Tensor, numel: int, k: int, scan) -> "Optional[Candidates]":
    """Candidates (ascending positions with ``|x| >= t``, at least ``k`` of them, and their values
    when the scan read them, else None) for a threshold ``t`` read off ``sample``, the
    magnitudes at evenly spaced positions (float32, no NaN; :func:`_sample_magnitudes`),
    lowered until enough pass; None when the sample says a scan would keep nearly
    everything (pick over everything instead)."""
    size = sample.numel()
    values = sample.numpy() if sample.device.type == "cpu" else None
    # Expected k*size/numel sample elements lie above the true k-th magnitude; aim for a rank
    # well beyond that (mean + 4 standard deviations + 8) so that one scan almost always suffices.
    expected = k * size / numel
    rank = expected + 4.0 * math.sqrt(expected) + 8.0
    while rank < size:
        order = size - int(rank)  # 0-based: the (order+1)-th smallest, as torch.kthvalue(order + 1)
        threshold = (float(np.partition(values, order)[order]) if values is not None
                     else float(torch.kthvalue(sample, order + 1).values))
        if threshold <= 0.0:
            return None  # mostly zeros: a scan would keep nearly everything
        # room for the candidates the sample predicts, twice over (the native scan falls back
        # to numpy's when more pass)
        candidates = scan(threshold, int(2 * rank * numel / size) + 1024)
        if candidates[0].numel() >= k:
            return candidates
        rank *= _WIDEN
    return None


def _finish(flat: torch.Tensor, candidates: "Candidates", k: int) -> "tuple[torch.Tensor, torch.Tensor]":
    """The exact top-k among the candidates (which hold every element at or above the k-th, and
    no NaN): their positions and values."""
    positions, values = candidates
    if values is None:
        values = torch.index_select(flat, 0, positions)
    # one native pass after numpy's partition, where the kernels take the arrays (the torch/numpy
    # path's five numpy calls and two torch gathers cost about 1.6x as much for ResNet-18's candidates)
    if values.device.type == "cpu" and values.dtype in (torch.float32, torch.float64) \
            and positions.dtype == torch.int64 and positions.is_contiguous():
        found = values.detach().numpy()
        if kernels.usable(found):
            kept = kernels.keep_largest_candidates(positions.numpy(), found, k)
            return torch.from_numpy(kept[0]), torch.from_numpy(kept[1])
    return largest_among(positions, values, k)


def largest_among(positions: torch.Tensor, values: torch.Tensor, k: int) -> "tuple[torch.Tensor, torch.Tensor]":
    """:func:`_finish`'s torch/numpy path: the ``k`` of ``positions`` and ``values`` (each (m,),
    no NaN in ``values``) of largest ``|values|``, in their order, ties at the k-th the first."""
    chosen = topk_indices(values.abs(), k)
    return positions[chosen], values[chosen]


def _compensate_and_top(grad: torch.Tensor, residual: Optional[torch.Tensor], out: torch.Tensor,
                        k: int) -> "Optional[tuple[torch.Tensor, torch.Tensor]]":
    """The unfused path's answer (compensate, then :func:`topk_indices` over all of ``out``) in
    one native call where :mod:`gradwire.kernels` can take the arrays (CPU, one dtype,
    contiguous), with the values there; None otherwise. For the many small tensors of a model
    (BatchNorm, biases), whose cost is the per-call overhead of eight torch/numpy calls."""
    if out.numel() > NATIVE_TOP_MAX_NUMEL or out.device.type != "cpu" or out.dtype not in NUMPY_DTYPES \
            or not 0 < k < out.numel() \
            or grad.dtype != out.dtype or not grad.is_contiguous():
        return None
    arrays = (grad.detach().reshape(-1).numpy(), None if residual is None else residual.detach().numpy(), out.numpy())
    if not kernels.usable(*arrays):
        return None
    positions, values = kernels.compensate_and_top(arrays[0], arrays[1], arrays[2], k)
    return torch.from_numpy(positions), torch.from_numpy(values)


def compensated_top_pieces(source: torch.Tensor, *, starts: "list[int]", numels: "list[int]", ks: "list[int]",
                           residual: Optional[torch.Tensor], has_residual: "list[bool]",
                           out: torch.Tensor) -> "list[tuple[torch.Tensor, torch.Tensor]]":
    """What :func:`compensated_largest_magnitudes` answers for each of many small pieces of
    ``source`` (each ``0 < k < numel <= NATIVE_TOP_MAX_NUMEL``), in one native call: an FSDP
    module's (parameter, destination) pieces or a bucket's biases and norms cost one call, not a
    round of Python each (``kernels.compensate_and_top_pieces``).

    Args:
        source: (N,) contiguous float32/float64 CPU tensor holding the pieces.
        starts: piece i is ``source[starts[i]: starts[i] + numels[i]]``.
        numels: the pieces' sizes.
        ks: how many each keeps.
        residual: (sum of numels,) ``source``'s dtype, the residuals end to end, or None.
        has_residual: whether piece i's part of ``residual`` is added.
        out: (sum of numels,) ``source``'s dtype, contiguous: the compensated pieces end to end.

    Returns:
        Per piece: (ascending int64 positions relative to the piece, the compensated values there).
    """
    positions, values = kernels.compensate_and_top_pieces(
        source.detach().numpy(), starts=np.asarray(starts, dtype=np.int64),
        lengths=np.asarray(numels, dtype=np.int64), ks=np.asarray(ks, dtype=np.int64),
        residual=(out if residual is None else residual).detach().numpy(), add=np.asarray(has_residual, dtype=np.bool_),
        out=out.numpy())
    found_positions, found_values = torch.from_numpy(positions), torch.from_numpy(values)
    return list(zip(found_positions.split(ks), found_values.split(ks)))


def _compensate_into(grad: torch.Tensor, residual: Optional[torch.Tensor], out: torch.Tensor) -> None:
    flat = grad.reshape(-1)
    if residual is None:
        out.copy_(flat)
    else:
        torch.add(flat, residual, out=out)


def _scan(flat: torch.Tensor, threshold: float, capacity: int) -> "Candidates":
    """:func:`indices_at_or_above` (and the values there), in one native pass where
    :mod:`gradwire.kernels` can take it."""
    values = flat.detach().numpy() if flat.device.type == "cpu" and flat.dtype in NUMPY_DTYPES else None
    if values is not None and values.ndim == 1 and kernels.usable(values):
        limit = NUMPY_DTYPES[flat.dtype](representable_at_least(threshold, flat.dtype))
        found = kernels.scan(values, limit, capacity)
        if found.positions is not None:
            return torch.from_numpy(found.positions), torch.from_numpy(found.values)
    return indices_at_or_above(flat, threshold), None


def _compensate_and_scan(grad: torch.Tensor, residual: Optional[torch.Tensor], out: torch.Tensor,
                         threshold: float, capacity: int, flags: Optional[dict] = None,
                         zero_grad: bool = False) -> "Candidates":
    """``out = grad + residual`` and the ascending int64 positions where ``|out| >= threshold``
    (with their values when the native pass found them): one native pass
    (:mod:`gradwire.kernels`), else chunk by chunk, each chunk scanned while it is in cache."""
    numpy_dtype = NUMPY_DTYPES[out.dtype]
    limit = numpy_dtype(representable_at_least(threshold, out.dtype))
    flat = grad.reshape(-1)
    compensated = out.numpy()
    if grad.dtype == out.dtype and flat.is_contiguous():
        sources = (flat.detach().numpy(), None if residual is None else residual.detach().numpy())
        if kernels.usable(compensated, *sources):
            zero = zero_grad and flags is not None
            found = kernels.compensate_and_scan(sources[0], sources[1], compensated, limit, capacity, zero_grad=zero)
            if flags is not None:
                flags.update(finite=found.finite, nonzero=found.nonzero, zeroed=zero)
            if found.positions is None:  # more candidates than room: out is written in full and the
                return _scan(out, threshold, found.count)  # count is known: scan it again with room for all
            return torch.from_numpy(found.positions), torch.from_numpy(found.values)
    numel = out.numel()
    chunk = min(numel, FUSED_CHUNK_NUMEL)
    magnitudes, mask = chunk_buffers(chunk, np.dtype(numpy_dtype))
    pieces = []
    for start in range(0, numel, chunk):
        stop = min(numel, start + chunk)
        if residual is None:
            out[start:stop].copy_(flat[start:stop])
        else:
            torch.add(flat[start:stop], residual[start:stop], out=out[start:stop])
        size = stop - start
        np.abs(compensated[start:stop], out=magnitudes[:size])
        np.greater_equal(magnitudes[:size], limit, out=mask[:size])
        found = np.flatnonzero(mask[:size])
        pieces.append(found + start if start else found)
    positions = pieces[0] if len(pieces) == 1 else np.concatenate(pieces)
    return torch.from_numpy(positions.astype(np.int64, copy=False)), None


def _magnitudes_nan_last(flat: torch.Tensor) -> torch.Tensor:
    return flat.abs().nan_to_num_(nan=-1.0)


@register_sparsifier
class TopK(BudgetSparsifier):
    """Keep exactly the ``k`` elements of largest ``|x|`` (see :func:`largest_magnitudes`).

    Exact, ties at the k-th magnitude kept by position; NaN ranks below every number. Large CPU
    tensors are scanned for a sampled threshold and only the candidates ranked (module
    docstring); on a GPU ``torch.topk`` runs directly, with no host sync. Options (``density``
    or ``k``; ``seed`` is ignored) as :class:`~gradwire.sparsify.base.BudgetSparsifier`'s.
    """

    name = "topk"

    def _select_k(self, flat: torch.Tensor, k: int, *, step: int, tensor_id: int) -> torch.Tensor:
        return largest_magnitudes(flat, k)

    def fused_check_applies(self, grad: torch.Tensor) -> bool:
        """Whether :meth:`select_compensated` on ``grad`` runs the native pass, which fills
        ``flags`` (large float32/float64 CPU tensors, with :mod:`gradwire.kernels` available)."""
        numel = grad.numel()
        # the base conditions, and those of the sampled scan (compensated_largest_magnitudes)
        return (super().fused_check_applies(grad) and numel >= SCAN_MIN_NUMEL
                and 0 < self.target_k(numel) <= SCAN_MAX_DENSITY * numel)

    def pieces_apply(self, grad: torch.Tensor) -> bool:
        """Pieces below the sampled scan's size whose ``k`` leaves something out, on the CPU in
        float32/float64, with the kernels here: :func:`compensated_top_pieces` takes them."""
        numel = grad.numel()
        return (numel <= NATIVE_TOP_MAX_NUMEL and 0 < self.target_k(numel) < numel and grad.device.type == "cpu"
                and grad.dtype in (torch.float32, torch.float64) and grad.is_contiguous() and kernels.available())

    def select_compensated_pieces(self, source: torch.Tensor, *, starts: "list[int]", numels: "list[int]",
                                  residual: Optional[torch.Tensor], has_residual: "list[bool]",
                                  out: torch.Tensor) -> "list[tuple[torch.Tensor, torch.Tensor]]":
        return compensated_top_pieces(source, starts=starts, numels=numels, ks=[self.target_k(n) for n in numels],
                                      residual=residual, has_residual=has_residual, out=out)

    def select_compensated(self, grad: torch.Tensor, residual: Optional[torch.Tensor], out: torch.Tensor, *,
                           step: int = 0, tensor_id: int = 0, flags: Optional[dict] = None,
                           zero_grad: bool = False) -> torch.Tensor:
        k = self.target_k(out.numel())
        if out.numel() == 0 or k >= out.numel():
            return super().select_compensated(grad, residual, out, step=step, tensor_id=tensor_id, flags=flags,
                                              zero_grad=zero_grad)
        return compensated_largest_magnitudes(grad, residual, out, k, flags, zero_grad)
