"""``dexp``: DeepReduce's double-exponential fit of the sorted values.

The values are sorted in descending order and, per segment of consecutive ranks, fitted as

    y(t) = a * exp(p * t) + c * exp(q * t),      t = j / (n - 1) in [0, 1], j = 0..n-1

(four float32 parameters a, p, c, q per fitted segment). A sorted gradient falls steeply at
both ends and is flat in between, which one decaying and one growing exponential follow well;
the initial segments are the positive, zero and negative runs (DeepReduce fits per sign), halved
until each meets the tolerance. See :mod:`gradwire.codecs.values._fit` for the refinement, the
raw fallbacks and the section layout (P = 4).

Fitting starts with variable projection: for fixed rates (p, q) the best (a, c) is a 2x2
least-squares problem whose Gram entries are geometric sums in closed form, so a coarse grid of
17 rates (asinh-spaced in [-64, 64], 0 included: "exponential + constant" is in the family) is
searched for every pair, then one 3x3 local search at half the grid step; four
Levenberg-Marquardt steps on all four parameters finish (each step kept per segment only if it
lowers the error of the float32-rounded parameters). About 40 vectorized passes over the
segment elements in all, no per-element or per-segment Python loop. Since segments are refined
anyway, fit quality mostly changes the segment count, which costs little next to the ranks.
The decoder evaluates with :func:`~gradwire.codecs.values._fit.det_exp` (correctly rounded
operations only), so the encoder's tolerance check sees the decoder's exact bits.

Bound (guaranteed, checked by the encoder on the exact decoded values)::

    |decoded - v| <= tolerance * max|v|        for every element

Cost: as ``polyfit`` with 16 bytes per fitted segment; the permutation (ceil(log2 k) bits per
value) dominates, and the levels layout or plain float16 is sent whenever it is smaller and
meets the tolerance (``level_layout=False``: plain only).

Non-finite input (NaN, +-Inf) raises ValueError.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from ...errors import check_flag
from ..base import ValueCodec, register_value_codec
from ._fit import Batch, CurveModel, check_tolerance, decode_fit, det_exp, encode_fit

_MAX_RATE = 64.0
_GRID_PHI = np.linspace(-math.asinh(_MAX_RATE), math.asinh(_MAX_RATE), 17)
_REFINE_ROUNDS = 1
_GAUSS_NEWTON_STEPS = 4
#: pairs whose normalized Gram determinant 1 - rho^2 is below this are treated as one term:
#: near-collinear exponentials give huge cancelling a, c that float32 cannot carry
_MIN_DET = 1e-4


def _rate(phi: np.ndarray) -> np.ndarray:
    """Rates on the asinh scale (log-like for large |p|, linear near 0), rounded to float32
    since that is what the decoder will use."""
    return np.sinh(np.clip(phi, _GRID_PHI[0], _GRID_PHI[-1])).astype(np.float32).astype(np.float64)


def _exp_sum(rate: np.ndarray, n: np.ndarray) -> np.ndarray:
    """sum_{j=0}^{n-1} exp(rate * j / (n - 1)) in closed form (geometric series), n >= 2."""
    step = rate / (n - 1.0)
    with np.errstate(all="ignore"):
        ratio = np.expm1(n * step) / np.expm1(step)
    return np.where(step == 0, n, ratio)


def _solve_pairs(
    rate_p: np.ndarray, rate_q: np.ndarray, b_p: np.ndarray, b_q: np.ndarray, n: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Least-squares (a, c) for every candidate pair and the drop in squared error it gives.

    All arrays broadcast to (S, ...); ``b_*`` are sum(y * exp(rate * t)) over the segment.
    """
    s_pp = _exp_sum(2.0 * rate_p, n)
    s_qq = _exp_sum(2.0 * rate_q, n)
    s_pq = _exp_sum(rate_p + rate_q, n)
    norm_p, norm_q = np.sqrt(s_pp), np.sqrt(s_qq)
    rho = s_pq / (norm_p * norm_q)
    det = 1.0 - rho * rho
    beta_p, beta_q = b_p / norm_p, b_q / norm_q
    pair = det > _MIN_DET
    safe_det = np.where(pair, det, 1.0)
    a_n = np.where(pair, (beta_p - rho * beta_q) / safe_det, beta_p)  # one term: c = 0
    c_n = np.where(pair, (beta_q - rho * beta_p) / safe_det, 0.0)
    gain = a_n * beta_p + c_n * beta_q
    return a_n / norm_p, c_n / norm_q, np.where(np.isfinite(gain), gain, -np.inf)


def _squared_error(params: np.ndarray, y: np.ndarray, t: np.ndarray, batch: Batch) -> np.ndarray:
    """Per-segment squared error of the float32-rounded parameters (what will be sent)."""
    a, p, c, q = (params.astype(np.float32).astype(np.float64)[batch.seg, i] for i in range(4))
    residual = y - (a * np.exp(p * t) + c * np.exp(q * t))
    return np.add.reduceat(residual * residual, batch.offsets)


def _gauss_newton(params: np.ndarray, y: np.ndarray, t: np.ndarray, batch: Batch) -> np.ndarray:
    """A few Levenberg-Marquardt steps on all four parameters, every segment at once.

    The grid search lands near the optimum; these steps converge quadratically from there. A
    step is kept per segment only where it lowers the squared error of the float32-rounded
    parameters, so it can never make a segment worse (nor blow up a, c through cancellation).
    """
    segments = params.shape[0]
    damping = np.full(segments, 1e-3)
    error = _squared_error(params, y, t, batch)
    upper = np.triu_indices(4)
    for _ in range(_GAUSS_NEWTON_STEPS):
        a, p, c, q = (params[batch.seg, i] for i in range(4))
        e_p, e_q = np.exp(p * t), np.exp(q * t)
        residual = y - (a * e_p + c * e_q)
        jacobian = np.stack([e_p, a * t * e_p, e_q, c * t * e_q], axis=1)
        products = jacobian[:, upper[0]] * jacobian[:, upper[1]]  # the 10 distinct entries of J^T J
        normal = np.zeros((segments, 4, 4))
        normal[:, upper[0], upper[1]] = np.add.reduceat(products, batch.offsets, axis=0)
        normal = normal + np.triu(normal, 1).transpose(0, 2, 1)
        gradient = np.add.reduceat(jacobian * residual[:, None], batch.offsets, axis=0)
        diagonal = np.einsum("sii->si", normal)
        lhs = normal + (damping[:, None] * np.maximum(diagonal, 1e-300))[:, :, None] * np.eye(4)
        try:
            step = np.linalg.solve(lhs, gradient[..., None])[..., 0]
        except np.linalg.LinAlgError:
            break
        trial = params + step
        trial[:, 1] = np.clip(trial[:, 1], -_MAX_RATE, _MAX_RATE)
        trial[:, 3] = np.clip(trial[:, 3], -_MAX_RATE, _MAX_RATE)
        trial_error = _squared_error(trial, y, t, batch)
        better = np.isfinite(trial).all(axis=1) & (trial_error < error)
        params = np.where(better[:, None], trial, params)
        error = np.where(better, trial_error, error)
        damping = np.where(better, damping / 10, damping * 10)
    return params


class DoubleExpModel(CurveModel):
    """a * exp(p t) + c * exp(q t) per segment, t in [0, 1]; parameters (a, p, c, q)."""

    n_params = 4

    @staticmethod
    def _t(batch: Batch) -> np.ndarray:
        return batch.j / np.maximum(batch.n - 1.0, 1.0)

    def fit(self, y: np.ndarray, batch: Batch, segments: int) -> np.ndarray:
        t = self._t(batch)
        n = np.add.reduceat(np.ones_like(t), batch.offsets)  # segment lengths, float64

        def projections(rates: np.ndarray) -> np.ndarray:
            """sum(y * exp(rate * t)) per segment for per-segment rates (S, R): R passes."""
            return np.stack(
                [np.add.reduceat(y * np.exp(rates[batch.seg, r] * t), batch.offsets) for r in range(rates.shape[1])],
                axis=1,
            )

        # coarse grid: every pair (p, q) of grid rates
        grid = np.broadcast_to(_rate(_GRID_PHI), (segments, _GRID_PHI.size))
        b = projections(grid)
        _, _, gain = _solve_pairs(grid[:, :, None], grid[:, None, :], b[:, :, None], b[:, None, :], n[:, None, None])
        best = np.argmax(gain.reshape(segments, -1), axis=1)
        phi_p = _GRID_PHI[best // _GRID_PHI.size]
        phi_q = _GRID_PHI[best % _GRID_PHI.size]
        step = _GRID_PHI[1] - _GRID_PHI[0]
        rows = np.arange(segments)
        for _ in range(_REFINE_ROUNDS):  # local 3x3 search around the best pair, halving steps
            step /= 2
            offsets = np.array([-step, 0.0, step])
            cand_p = phi_p[:, None] + offsets
            cand_q = phi_q[:, None] + offsets
            rate_p, rate_q = _rate(cand_p), _rate(cand_q)
            b_p, b_q = projections(rate_p), projections(rate_q)
            _, _, gain = _solve_pairs(
                rate_p[:, :, None], rate_q[:, None, :], b_p[:, :, None], b_q[:, None, :], n[:, None, None]
            )
            best = np.argmax(gain.reshape(segments, -1), axis=1)
            phi_p = cand_p[rows, best // 3]
            phi_q = cand_q[rows, best % 3]
        rate_p, rate_q = _rate(phi_p[:, None]), _rate(phi_q[:, None])
        a, c, _ = _solve_pairs(rate_p, rate_q, projections(rate_p), projections(rate_q), n[:, None])
        params = np.stack([a[:, 0], rate_p[:, 0], c[:, 0], rate_q[:, 0]], axis=1)
        return _gauss_newton(params, y, t, batch)

    def evaluate(self, params: np.ndarray, batch: Batch) -> np.ndarray:
        t = self._t(batch)
        a, p, c, q = (params[batch.seg, i] for i in range(4))
        return a * det_exp(p * t) + c * det_exp(q * t)


def _model_for(n_params: int) -> "DoubleExpModel | None":
    return DoubleExpModel() if n_params == DoubleExpModel.n_params else None


@register_value_codec
class DoubleExpCodec(ValueCodec):
    """Sorted values fitted by piecewise double exponentials, within ``tolerance * max|v|``; lossy.

    As :class:`~gradwire.codecs.values.polyfit.PolyFitCodec` with the model
    ``a exp(p t) + c exp(q t)`` (four float32 parameters per fitted segment): the bound holds for
    every element, checked by the encoder on the exact decoded values, and the smallest of the
    fitted, levels and plain layouts is sent. Decoding is ``O(k)`` (two
    :func:`~gradwire.codecs.values._fit.det_exp` per fitted value) and a gather; its section
    bounds ``k`` (docs/wire-format.md, "Decode cost bounds").

    Args:
        tolerance: the error bound as a fraction of ``max|v|``, a number in (0, 1] (default 0.05).
        level_layout: allow the levels layout (default True); False chooses between the fitted
            and the plain layouts alone.

    Raises:
        ValueError: an option out of range. ``encode`` also raises it for NaN/Inf values.
    """

    name = "dexp"
    wire_id = 8
    lossless = False

    def __init__(self, *, tolerance: float = 0.05, level_layout: bool = True) -> None:
        self.tolerance = check_tolerance(tolerance)
        self.level_layout = check_flag("level_layout", level_layout)

    def encode(self, values: torch.Tensor) -> bytes:
        return self.encode_with_reconstruction(values)[0]

    def encode_with_reconstruction(self, values: torch.Tensor) -> tuple[bytes, torch.Tensor]:
        return encode_fit(values, DoubleExpModel(), self.tolerance, allow_levels=self.level_layout)

    def decode(self, data: memoryview, count: int, dtype: torch.dtype) -> torch.Tensor:
        return decode_fit(data, count, dtype, _model_for)
