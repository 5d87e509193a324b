"""``polyfit``: DeepReduce's curve fitting with piecewise polynomials of the sorted values.

The values are sorted in descending order and, per segment of consecutive ranks, the value is
fitted as a polynomial of degree ``degree`` in the segment's normalized rank
``t = (2j - (n - 1)) / (n - 1)`` in [-1, 1] (j = 0..n-1), written in the Chebyshev basis
(well conditioned, so float32 coefficients lose little) and evaluated by Clenshaw's recurrence.
Segments start as the positive, zero and negative runs and are halved until each meets the
tolerance; see :mod:`gradwire.codecs.values._fit` for the refinement, the raw fallbacks and the
section layout (P = degree + 1 float32 coefficients per fitted segment).

Bound (guaranteed, checked by the encoder on the exact decoded values)::

    |decoded - v| <= tolerance * max|v|        for every element

Cost: 1 + 2 + 1 + 4 header bytes, per segment bit_width(k) + 2 bits and 4 * (degree + 1) bytes
(fitted) or its raw values, plus the permutation: ceil(log2 k) bits per value. Whenever the
levels layout (each value as the nearest multiple of a step <= 2 * tolerance * max|v|,
ANS-coded: about 3 bits per value at the default tolerance, at any k) or sending every value
raw (float16 / float32 / own dtype, within the tolerance) is smaller, that is sent instead --
the fitted layout wins only for small k at tight tolerances; ``level_layout=False`` restores
the choice between fitted and raw alone. Encoding sorts the values and runs at
most ~log2(k) batched refinement rounds, each a least-squares fit of the failing segments
(O(elements * degree)); decoding is one Clenshaw pass and a gather.

Non-finite input (NaN, +-Inf) raises ValueError: no finite curve represents it.
"""

from __future__ import annotations

import numpy as np
import torch

from ...errors import check_flag, check_int
from ..base import ValueCodec, register_value_codec
from ._fit import Batch, CurveModel, check_tolerance, decode_fit, encode_fit

MAX_DEGREE = 10


class ChebyshevModel(CurveModel):
    """sum_m c_m T_m(t) per segment, t in [-1, 1] across the segment's ranks."""

    def __init__(self, n_params: int) -> None:
        self.n_params = n_params

    @staticmethod
    def _t(batch: Batch) -> np.ndarray:
        # exact integers in float64, one correctly rounded division: deterministic per element
        return (2.0 * batch.j - (batch.n - 1.0)) / np.maximum(batch.n - 1.0, 1.0)

    def fit(self, y: np.ndarray, batch: Batch, segments: int) -> np.ndarray:
        size = self.n_params
        t = self._t(batch)
        # T_0..T_{2P-2}: the Gram matrix needs only their sums, as T_a T_b = (T_{a+b} + T_{|a-b|}) / 2
        basis = np.empty((t.size, 2 * size - 1))
        basis[:, 0] = 1.0
        if 2 * size - 1 > 1:
            basis[:, 1] = t
        for m in range(2, 2 * size - 1):
            basis[:, m] = 2.0 * t * basis[:, m - 1] - basis[:, m - 2]
        moments = np.add.reduceat(basis, batch.offsets, axis=0)
        rhs = np.add.reduceat(basis[:, :size] * y[:, None], batch.offsets, axis=0)
        a = np.arange(size)
        gram = 0.5 * (moments[:, a[:, None] + a[None, :]] + moments[:, np.abs(a[:, None] - a[None, :])])
        # a whisper of ridge keeps the batched solve from failing on a degenerate segment
        ridge = 1e-12 * np.trace(gram, axis1=1, axis2=2)[:, None, None] * np.eye(size)
        return np.linalg.solve(gram + ridge, rhs[..., None])[..., 0]

    def evaluate(self, params: np.ndarray, batch: Batch) -> np.ndarray:
        t = self._t(batch)
        two_t = 2.0 * t
        coefficients = params[batch.seg]
        b1 = np.zeros_like(t)
        b2 = np.zeros_like(t)
        for m in range(self.n_params - 1, 0, -1):  # Clenshaw, a loop over the degree
            b1, b2 = coefficients[:, m] + two_t * b1 - b2, b1
        return coefficients[:, 0] + t * b1 - b2


def _model_for(n_params: int) -> "ChebyshevModel | None":
    return ChebyshevModel(n_params) if 1 <= n_params <= MAX_DEGREE + 1 else None


@register_value_codec
class PolyFitCodec(ValueCodec):
    """Sorted values fitted by piecewise Chebyshev polynomials, within ``tolerance * max|v|``; lossy.

    The bound ``|decoded - v| <= tolerance * max|v|`` holds for every element: the encoder checks
    it on the exact decoded values. The encoder sends whichever of three layouts is smallest
    (module docstrings of :mod:`.polyfit` and :mod:`._fit`): the fitted curve (plus each value's
    rank, ``ceil(log2 k)`` bits, which limits it to small ``k``), the levels layout (about 3 bits
    per value at the default tolerance, at any ``k``) or plain float16/float32. Decoding is one
    Clenshaw pass and a gather, ``O(P k)``; its section bounds ``k`` (docs/wire-format.md,
    "Decode cost bounds").

    Args:
        tolerance: the error bound as a fraction of ``max|v|``, a number in (0, 1] (default 0.05).
        degree: polynomial degree per segment, an int in [0, 10] (default 3): ``degree + 1``
            float32 coefficients per fitted segment.
        level_layout: allow the levels layout (default True); False chooses between the fitted
            and the plain layouts alone.

    Raises:
        ValueError: an option out of range. ``encode`` also raises it for NaN/Inf values.
    """

    name = "polyfit"
    wire_id = 7
    lossless = False

    def __init__(self, *, tolerance: float = 0.05, degree: int = 3, level_layout: bool = True) -> None:
        self.tolerance = check_tolerance(tolerance)
        self.level_layout = check_flag("level_layout", level_layout)
        self.degree = check_int("degree", degree, 0, MAX_DEGREE)

    def encode(self, values: torch.Tensor) -> bytes:
        return self.encode_with_reconstruction(values)[0]

    def encode_with_reconstruction(self, values: torch.Tensor) -> tuple[bytes, torch.Tensor]:
        return encode_fit(values, ChebyshevModel(self.degree + 1), self.tolerance, allow_levels=self.level_layout)

    def decode(self, data: memoryview, count: int, dtype: torch.dtype) -> torch.Tensor:
        return decode_fit(data, count, dtype, _model_for)
