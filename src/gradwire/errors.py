"""Exceptions raised by gradwire.

Invalid options raise plain ``ValueError`` naming the option and the allowed values.
Bytes that cannot be decoded raise :class:`DecodeError`, a ``ValueError`` subclass, so a
caller that already guards against bad input with ``except ValueError`` stays correct.
"""

from __future__ import annotations


class DecodeError(ValueError):
    """A payload is truncated, corrupt, of an unknown version, or hostile.

    Decoders raise this and nothing else on bad bytes: never another exception type,
    never a silently wrong tensor, never an allocation far beyond the payload's size.
    """


def require(condition: bool, message: str) -> None:
    """Raise :class:`DecodeError` with ``message`` unless ``condition`` holds."""
    if not condition:
        raise DecodeError(message)


def check_choice(option: str, value: object, allowed: "list[str] | tuple[str, ...]") -> None:
    """Raise ``ValueError`` naming ``option`` and the ``allowed`` values unless ``value`` is one."""
    if value not in allowed:
        raise ValueError(f"{option}={value!r} is not supported; allowed: {', '.join(map(str, allowed))}")
