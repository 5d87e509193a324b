"""Exceptions raised by gradwire.

Invalid options raise plain ``ValueError`` naming the option and the allowed values.
Bytes that cannot be decoded raise :class:`DecodeError`, a ``ValueError`` subclass, so a
caller that already guards against bad input with ``except ValueError`` stays correct.
"""

from __future__ import annotations

import numbers
from typing import Any


class DecodeError(ValueError):
    """A payload is truncated, corrupt, of an unknown version, or hostile.

    Decoders raise this and nothing else on bad bytes: never another exception type,
    never a silently wrong tensor, never an allocation far beyond the payload's size.
    """


def require(condition: bool, message: str) -> None:
    """Raise :class:`DecodeError` with ``message`` unless ``condition`` holds (the decoders' check)."""
    if not condition:
        raise DecodeError(message)


def is_integer(value: object) -> bool:
    """Whether ``value`` is an integer (Python's or numpy's) and not a bool: ``True`` is an int to
    Python, but never a count, a level or a seed here."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_real(value: object) -> bool:
    """Whether ``value`` is a real number (Python's or numpy's) and not a bool."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def check_choice(option: str, value: object, allowed: "list[str] | tuple[str, ...]") -> None:
    """Raise ``ValueError`` naming ``option`` and the ``allowed`` values unless ``value`` is one."""
    if value not in allowed:
        raise ValueError(f"{option}={value!r} is not supported; allowed: {', '.join(map(str, allowed))}")


def check_int(option: str, value: Any, low: int, high: "int | None" = None, *,
              optional: bool = False) -> "int | None":
    """Validate an integer option and return it as a Python int.

    The one wording of a bad integer option: ``"bits=9 is not supported; allowed: an int in
    [2, 8]"``. Booleans are refused (see :func:`is_integer`).

    Args:
        option: the option's name, as the caller spells it.
        value: what the caller passed.
        low: the smallest allowed value.
        high: the largest allowed value; None for no upper bound.
        optional: None is allowed too, and returned as is.

    Returns:
        ``int(value)``, or None when ``optional`` and ``value`` is None.

    Raises:
        ValueError: ``value`` is not an integer in ``[low, high]``, naming ``option`` and the range.
    """
    if optional and value is None:
        return None
    if not is_integer(value) or value < low or (high is not None and value > high):
        allowed = f"an int in [{low}, {high}]" if high is not None else f"an int >= {low}"
        raise ValueError(f"{option}={value!r} is not supported; allowed: {'None or ' if optional else ''}{allowed}")
    return int(value)


def check_flag(option: str, value: object) -> bool:
    """Validate a boolean option: ``ValueError`` naming ``option`` unless ``value`` is a bool."""
    if not isinstance(value, bool):
        raise ValueError(f"{option}={value!r} is not supported; allowed: True, False")
    return value


class CollectiveError(RuntimeError):
    """A collective failed or timed out (a peer died, left, or runs without the gradwire hook).

    Raised on every surviving rank for the same step; the message names the collective and
    the step.
    """


def collective_failed(what: str, step: int, error: BaseException) -> CollectiveError:
    """The one wording of a failed collective: which one, at which step, and why."""
    return CollectiveError(f"{what} failed at step {step}: {error}")


class StepFailedError(RuntimeError):
    """Some rank could not finish this step's exchange (its error is named); every rank raises."""


class DivergenceError(RuntimeError):
    """Ranks computed different averaged gradients for the same step (a corrupted payload that
    still passed its checksum, or a bug): every rank raises before any of them steps."""


class NonFiniteGradientError(FloatingPointError):
    """A gradient held NaN or Inf on some rank (raised on every rank, together)."""
