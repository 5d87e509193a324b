"""``threshold``: keep every element with ``|x| >= threshold`` (hard threshold, variable count).

Sahu et al. (2021) show a fixed hard threshold minimises the total error under error feedback;
its count varies from step to step, so the exchange must cope with a variable size.

:func:`indices_at_or_above` is also the scan behind ``sampled-topk`` and ``gaussian-k``.
"""

from __future__ import annotations

import math
import threading

import numpy as np
import torch

from .base import DataSizedSparsifier, check_seed, register_sparsifier
from ..errors import is_real

#: Elements per pass on the CPU. A full-size ``abs`` temporary of a large tensor costs more in
#: fresh page faults (~70 ms per 64 MB measured here) than the arithmetic itself; one 4 Mi-element
#: buffer reused across chunks stays in the last-level cache.
CPU_CHUNK_NUMEL = 1 << 22

#: Per thread, the chunk buffers of the last scan, reused: a fresh temporary costs more in page
#: faults than the scan itself (measured here: ``abs`` of ResNet-18's 11M gradients takes 40 ms
#: into new tensors, 12 ms into existing ones). At most 20 MB per scanning thread.
_scratch = threading.local()

#: dtypes the CPU scan runs in numpy: its ``abs``/``>=`` into buffers and ``flatnonzero`` take
#: 1.9 + 1.3 ms per 4 Mi float32 on one thread here, torch's ``abs``/``ge``/``nonzero`` 3.1 + 4.0
#: (``python -m gradwire bench sparsify``); bfloat16 has no numpy dtype and stays in torch.
NUMPY_DTYPES = {torch.float32: np.float32, torch.float64: np.float64, torch.float16: np.float16}


def chunk_buffers(numel: int, dtype: np.dtype) -> tuple[np.ndarray, np.ndarray]:
    """This thread's reusable ``(magnitudes, mask)`` scan buffers of ``numel`` elements (views)."""
    buffers = getattr(_scratch, "buffers", None)
    if buffers is None or buffers[0].size < numel or buffers[0].dtype != dtype:
        size = max(numel, buffers[0].size if buffers is not None and buffers[0].dtype == dtype else 0)
        buffers = (np.empty(size, dtype=dtype), np.empty(size, dtype=np.bool_))
        _scratch.buffers = buffers
    return buffers[0][:numel], buffers[1][:numel]


def representable_at_least(threshold: float, dtype: torch.dtype) -> float:
    """The smallest value of ``dtype`` that is ``>= threshold`` (may be ``inf``), as a float.

    Comparing a float16 tensor with a Python float rounds the float to float16, possibly
    downwards; comparing with this value instead makes ``|x| >= threshold`` exact for every ``x``
    of ``dtype``.
    """
    numpy_dtype = NUMPY_DTYPES.get(dtype)
    if numpy_dtype is not None:  # the same IEEE rounding in numpy scalars: about 2 us, torch's four ops 40-80
        with np.errstate(over="ignore"):
            nearest = numpy_dtype(threshold)
            if float(nearest) < threshold:
                nearest = np.nextafter(nearest, numpy_dtype(np.inf))
        return float(nearest)
    exact = torch.tensor(threshold, dtype=torch.float64)
    rounded = exact.to(dtype)
    if rounded.double() < exact:
        rounded = torch.nextafter(rounded, torch.tensor(math.inf, dtype=dtype))
    return float(rounded)


def indices_at_or_above(flat: torch.Tensor, threshold: float) -> torch.Tensor:
    """The positions ``i`` of ``flat`` where ``|flat[i]| >= threshold``.

    Exact in ``flat``'s dtype (see :func:`representable_at_least`); NaN is never selected. On the
    CPU the tensor is scanned in cache-sized chunks (numpy for the dtypes it has), elsewhere in
    one pass.

    Args:
        flat: (numel,) floating tensor, any device.
        threshold: the magnitude, in ``flat``'s units.

    Returns:
        int64, strictly ascending, on ``flat``'s device.
    """
    bound = representable_at_least(threshold, flat.dtype)
    numel = flat.numel()
    numpy_dtype = NUMPY_DTYPES.get(flat.dtype)
    if flat.device.type != "cpu" or numel == 0 or numpy_dtype is None:
        return torch.nonzero(flat.abs() >= bound).view(-1)
    values = flat.detach().contiguous().numpy()
    limit = numpy_dtype(bound)  # exact: bound is representable in the dtype
    chunk = min(numel, CPU_CHUNK_NUMEL)
    magnitudes, mask = chunk_buffers(chunk, np.dtype(numpy_dtype))
    pieces = []
    for start in range(0, numel, chunk):
        part = values[start: start + chunk]
        size = part.size
        np.abs(part, out=magnitudes[:size])
        np.greater_equal(magnitudes[:size], limit, out=mask[:size])
        found = np.flatnonzero(mask[:size])
        pieces.append(found + start if start else found)
    positions = pieces[0] if len(pieces) == 1 else np.concatenate(pieces)
    return torch.from_numpy(positions.astype(np.int64, copy=False))


@register_sparsifier
class Threshold(DataSizedSparsifier):
    """Keep every element with ``|x| >= threshold``; the count ranges from 0 to ``numel``.

    ``target_k`` is None (no target), so the exchange must cope with a variable size.

    Args:
        threshold: the magnitude to keep, a finite number > 0 in the gradient's units.
        seed: an int >= 0, ignored.

    Raises:
        ValueError: a value out of range.
    """

    name = "threshold"

    def __init__(self, *, threshold: float | None = None, seed: int = 0) -> None:
        if not (is_real(threshold)
                and math.isfinite(threshold) and threshold > 0):
            raise ValueError(f"threshold={threshold!r} must be a finite number > 0")
        self.threshold = float(threshold)
        self.seed = check_seed(seed)

    def _select(self, flat: torch.Tensor, *, step: int, tensor_id: int) -> torch.Tensor:
        return indices_at_or_above(flat, self.threshold)
