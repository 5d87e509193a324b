"""gradwire: send far fewer gradient bytes in PyTorch data-parallel training."""

from __future__ import annotations

from . import codecs
from .errors import DecodeError
from .sparse import SparseTensor

__version__ = "0.1.0"

__all__ = ["DecodeError", "SparseTensor", "codecs", "__version__"]
