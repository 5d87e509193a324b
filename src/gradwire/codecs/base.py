"""Codec base classes and the registries, in the manner of numcodecs.

Two kinds of codec, each with its own registry:

* :class:`IndexCodec` turns a strictly ascending set of positions (numpy int64) into bytes and
  back. It knows the dense size ``numel``; on decode it is also told how many positions to
  produce (``count``, carried by the payload header).
* :class:`ValueCodec` turns a 1-D float tensor (on the CPU) into bytes and back. On decode it is
  told ``count`` and the dtype to return.

A codec is a small object holding its parameters. ``get_config()`` returns a plain dict with an
``"id"`` key; ``from_config`` rebuilds an equal codec. Everything a decoder needs that the
header does not carry (a bit width, a seed, fitted coefficients) travels inside the codec's own
section, so a payload decodes with no configuration at all.

Codecs know nothing of sparsifiers, ranks or torch.distributed.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar, Optional, TypeVar

import numpy as np
import torch

from ..configurable import Configurable, instantiate


class Codec(Configurable, ABC):
    """Parameters, config round-trip, equality and repr shared by every codec.

    Subclasses take their parameters as keyword arguments of ``__init__``, validate them there
    (``ValueError`` naming the option and what is allowed) and keep each under the same
    attribute name, so :meth:`get_config` can read them back.
    """

    #: Registry name, e.g. ``"eliasfano"``.
    name: ClassVar[str]
    #: One byte naming the codec inside a payload; unique within its registry, never reused.
    wire_id: ClassVar[int]
    #: Whether decode(encode(x)) == x bit for bit.
    lossless: ClassVar[bool] = True

    @classmethod
    def from_config(cls: type[_C], config: dict[str, Any]) -> _C:
        """Rebuild a codec from :meth:`get_config` output.

        Args:
            config: ``{"id": name, **options}``; the ``"id"`` may be left out.

        Returns:
            A codec equal to the one the config came from.

        Raises:
            ValueError: ``config["id"]`` names another codec, or an option's value is not allowed.
            TypeError: an option the codec does not take.
        """
        config = dict(config)
        codec_id = config.pop("id", cls.name)
        if codec_id != cls.name:
            raise ValueError(f"config id {codec_id!r} does not name codec {cls.name!r}")
        return cls(**config)


_C = TypeVar("_C", bound=Codec)


@dataclass
class IndexEncoding:
    """What an index codec produced.

    Attributes:
        data: the section bytes.
        positions: int64 array, shape (count,), strictly ascending: the positions the decoder
            will reconstruct — the input itself for lossless codecs; for a Bloom filter the
            positives the chosen policy sends.
        stats: codec-specific counters (e.g. false positives).
    """

    data: bytes
    positions: np.ndarray
    stats: dict[str, float] = field(default_factory=dict)


class IndexCodec(Codec):
    """Strictly ascending int64 positions in ``[0, numel)`` <-> bytes.

    What every index codec promises (``tests/codecs/contract.py`` checks it for each registered
    one): a lossless codec decodes exactly the positions it was given; a lossy one (Bloom)
    returns, in :attr:`IndexEncoding.positions`, exactly the positions its decoder will produce.
    Subclasses document their options, whether they are lossless, the bits per index they reach
    and their decode bound (the constants are in docs/wire-format.md, "Decode cost bounds").
    Their ``encode``/``decode`` implement the two methods below and keep these docstrings.
    """

    #: True for codecs whose decoder queries every one of the ``numel`` positions (Bloom): their
    #: cost grows with ``numel``, not with the number of indices.
    scans_every_position: ClassVar[bool] = False

    @abstractmethod
    def encode(self, indices: np.ndarray, numel: int) -> IndexEncoding:
        """Encode the positions of one sparse tensor into this codec's section.

        Args:
            indices: int64, shape (k,), strictly ascending, in ``[0, numel)`` (not checked here:
                the payload layer checks them unless told not to).
            numel: the dense tensor's size in elements, at most 2**40.

        Returns:
            The section bytes and the positions the decoder will reconstruct (``indices`` itself
            for a lossless codec), with codec-specific counters in ``stats``.

        Raises:
            ValueError: the codec cannot represent this input (e.g. Bloom beyond 2**32 positions).
        """

    def max_section_bytes(self, most: int, numel: int) -> Optional[int]:
        """The most bytes :meth:`encode` writes for *at most* ``most`` positions of a tensor of
        ``numel`` (whatever the positions), or None where the codec cannot say in advance.

        A bound lets a receiver size its buffer before anything arrives, so an exchange of such
        sections needs no round of lengths first (``exchange.sparse_reduce_scatter``'s fixed
        frames). Codecs without one (the default) are sent after their lengths.

        Args:
            most: the largest count the sender may have, ``0 <= most <= numel``.
            numel: the dense size in elements.

        Returns:
            Bytes, or None.
        """
        return None

    @abstractmethod
    def decode(self, data: memoryview, numel: int, count: int) -> np.ndarray:
        """Read ``count`` positions back from a section.

        Work and memory are linear in ``len(data) + count``
        (``tests/codecs/contract.py::check_decode_bounded``: at most
        ``64 * (len(data) + count) + 12 MiB``), never sized by a field read from ``data``; codecs
        that by design query every one of the ``numel`` positions (Bloom) set
        :attr:`scans_every_position`, and the payload layer bounds ``count`` and such ``numel``
        before calling (docs/wire-format.md, "Decode cost bounds").

        Args:
            data: the section's bytes, untrusted.
            numel: the dense size from the payload header (at most 2**40).
            count: how many positions to produce, from the payload header (at most ``numel``).

        Returns:
            int64, shape (count,), strictly ascending, in ``[0, numel)``.

        Raises:
            DecodeError: on any inconsistency between ``data``, ``numel`` and ``count``.
        """


class ValueCodec(Codec):
    """1-D float tensor (CPU) <-> bytes.

    What every value codec promises (``tests/codecs/contract.py`` checks it for each registered
    one): :meth:`encode_with_reconstruction` returns bit for bit what :meth:`decode` produces
    from the same bytes, and a lossless codec (``lossless = True``) returns its input. Values
    follow their positions' ascending order on the wire; a codec that reorders them internally
    carries the permutation in its own section. Subclasses document their options, the error
    bound of a lossy codec, the bits per value they reach and their decode bound (the constants
    are in docs/wire-format.md, "Decode cost bounds"); their ``encode``/``decode`` implement the
    methods below and keep these docstrings.
    """

    @abstractmethod
    def encode(self, values: torch.Tensor) -> bytes:
        """Encode the values of one sparse tensor into this codec's section.

        Args:
            values: shape (k,), dtype float16/bfloat16/float32/float64, on the CPU.

        Returns:
            The section bytes; the payload header records the dtype and ``k``.

        Raises:
            ValueError: the codec cannot represent this input (e.g. NaN/Inf for the
                quantizers and curve fits).
        """

    def max_section_bytes(self, most: int) -> Optional[int]:
        """The most bytes :meth:`encode` writes for at most ``most`` values (any float input), or
        None where the codec cannot say in advance (the default; see
        :meth:`IndexCodec.max_section_bytes`).

        Args:
            most: the largest count the sender may have, ``>= 0``.

        Returns:
            Bytes, or None.
        """
        return None

    @abstractmethod
    def decode(self, data: memoryview, count: int, dtype: torch.dtype) -> torch.Tensor:
        """Read ``count`` values of ``dtype`` back from a section.

        Work and memory linear in ``len(data) + count``, never sized by a field read from
        ``data`` (see :meth:`IndexCodec.decode`; the payload layer bounds ``count``).

        Args:
            data: the section's bytes, untrusted.
            count: how many values to produce, from the payload header.
            dtype: the dtype the sender's values had (float16/bfloat16/float32/float64).

        Returns:
            shape (count,), ``dtype``, on the CPU.

        Raises:
            DecodeError: on bad bytes.
        """

    def encode_with_reconstruction(self, values: torch.Tensor) -> tuple[bytes, torch.Tensor]:
        """Encode and also return exactly what the receiver will decode.

        Error feedback needs the latter: the residual is what was meant minus what arrives.
        Lossless codecs return ``values`` itself; lossy ones decode their own bytes unless they
        override this with something cheaper.

        Args:
            values: as for :meth:`encode`.

        Returns:
            ``(section bytes, reconstruction)``; the reconstruction has ``values``' shape and
            dtype and equals bit for bit what :meth:`decode` returns for those bytes.

        Raises:
            ValueError: as for :meth:`encode`.
        """
        data = self.encode(values)
        if self.lossless:
            return data, values
        return data, self.decode(memoryview(data), values.numel(), values.dtype)


_INDEX_CODECS: dict[str, type[IndexCodec]] = {}
_VALUE_CODECS: dict[str, type[ValueCodec]] = {}


def _register(registry: dict[str, type], cls: type) -> type:
    for existing in registry.values():
        if existing.wire_id == cls.wire_id and existing is not cls:
            raise ValueError(f"wire id {cls.wire_id} of {cls.name!r} is taken by {existing.name!r}")
    if not 1 <= cls.wire_id <= 255:
        raise ValueError(f"wire id of {cls.name!r} must be in 1..255")
    registry[cls.name] = cls
    return cls


def register_index_codec(cls: type[IndexCodec]) -> type[IndexCodec]:
    """Class decorator: make ``cls`` available by ``cls.name`` and ``cls.wire_id``.

    Raises:
        ValueError: another index codec holds ``cls.wire_id``, or it is not in 1..255.
    """
    return _register(_INDEX_CODECS, cls)


def register_value_codec(cls: type[ValueCodec]) -> type[ValueCodec]:
    """Class decorator: make ``cls`` available by ``cls.name`` and ``cls.wire_id``.

    Raises:
        ValueError: another value codec holds ``cls.wire_id``, or it is not in 1..255.
    """
    return _register(_VALUE_CODECS, cls)


def index_codec_classes() -> dict[str, type[IndexCodec]]:
    """The registered index codec classes by name (a copy)."""
    return dict(_INDEX_CODECS)


def value_codec_classes() -> dict[str, type[ValueCodec]]:
    """The registered value codec classes by name (a copy)."""
    return dict(_VALUE_CODECS)


def _resolve(kind: str, registry: dict[str, type], spec: Any, params: dict[str, Any]) -> Any:
    if isinstance(spec, Codec):
        if params:
            raise ValueError(f"{kind} was given as an instance; pass its options to its constructor")
        return spec
    if isinstance(spec, dict):
        spec = dict(spec)
        name = spec.pop("id", None)
        params = {**spec, **params}
    else:
        name = spec
    return instantiate(kind, registry, name, params)


def get_index_codec(spec: "str | dict[str, Any] | IndexCodec", **params: Any) -> IndexCodec:
    """An index codec from a name (+ options), a config dict, or an instance (returned as is).

    Args:
        spec: a registered name (``"rice"``), a :meth:`~Codec.get_config` dict, or an instance.
        **params: options of the named codec; merged over a dict's own.

    Returns:
        The codec.

    Raises:
        ValueError: an unknown name, an option the codec does not take or does not allow, or
            options given with an instance.
    """
    return _resolve("index_codec", _INDEX_CODECS, spec, params)


def get_value_codec(spec: "str | dict[str, Any] | ValueCodec", **params: Any) -> ValueCodec:
    """A value codec from a name (+ options), a config dict, or an instance (returned as is).

    Args:
        spec: a registered name (``"fp16"``), a :meth:`~Codec.get_config` dict, or an instance.
        **params: options of the named codec; merged over a dict's own.

    Returns:
        The codec.

    Raises:
        ValueError: an unknown name, an option the codec does not take or does not allow, or
            options given with an instance.
    """
    return _resolve("value_codec", _VALUE_CODECS, spec, params)


def index_codec_by_wire_id(wire_id: int) -> "type[IndexCodec] | None":
    """The index codec class a payload record names by its one-byte id; None if unknown."""
    return next((c for c in _INDEX_CODECS.values() if c.wire_id == wire_id), None)


def value_codec_by_wire_id(wire_id: int) -> "type[ValueCodec] | None":
    """The value codec class a payload record names by its one-byte id; None if unknown."""
    return next((c for c in _VALUE_CODECS.values() if c.wire_id == wire_id), None)
