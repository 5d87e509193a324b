"""Sparse-gradient codecs (DeepReduce): values and indices compressed each by its own codec.

>>> import torch, gradwire.codecs as codecs
>>> payload = codecs.encode(torch.ones(3), torch.tensor([1, 5, 9]), 16, index_codec="rice", value_codec="fp16")
>>> values, indices, numel = codecs.decode(payload)
>>> indices.tolist(), numel
([1, 5, 9], 16)

Decoding is bounded by the payload: a payload of ``L`` bytes may ask for ``element_budget(L) =
2**19 + 8 * L`` elements; pass ``max_numel=`` (the largest tensor you accept) to decode larger
ones, e.g. a few-byte ``rle`` payload of 10**7 consecutive indices.
"""

from __future__ import annotations

import importlib
import pkgutil

from ..errors import DecodeError
from .base import (
    Codec,
    IndexCodec,
    IndexEncoding,
    ValueCodec,
    get_index_codec,
    get_value_codec,
    index_codec_classes,
    register_index_codec,
    register_value_codec,
    value_codec_classes,
)
from .payload import (
    EncodedPayload,
    EncodedTensor,
    decode,
    decode_tensors,
    element_budget,
    encode,
    encode_sparse,
    encode_tensors,
    max_payload_bytes,
    resolve_codecs,
)


def _import_codec_modules() -> None:
    # Every module under codecs/index and codecs/values registers itself on import; importing
    # them all here keeps the registry complete without a hand-kept list.
    for package in ("index", "values"):
        module = importlib.import_module(f"{__name__}.{package}")
        for info in pkgutil.iter_modules(module.__path__):
            importlib.import_module(f"{module.__name__}.{info.name}")


_import_codec_modules()


def index_codecs() -> list[str]:
    """Names of the registered index codecs."""
    return sorted(index_codec_classes())


def value_codecs() -> list[str]:
    """Names of the registered value codecs."""
    return sorted(value_codec_classes())


__all__ = [
    "Codec",
    "DecodeError",
    "EncodedPayload",
    "EncodedTensor",
    "IndexCodec",
    "IndexEncoding",
    "ValueCodec",
    "decode",
    "decode_tensors",
    "element_budget",
    "encode",
    "encode_sparse",
    "encode_tensors",
    "get_index_codec",
    "get_value_codec",
    "index_codecs",
    "max_payload_bytes",
    "register_index_codec",
    "register_value_codec",
    "resolve_codecs",
    "value_codecs",
]
