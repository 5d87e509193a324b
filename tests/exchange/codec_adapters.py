"""Region codec adapters for the exchange tests (the exchange layer must not import gradwire.codecs)."""

from __future__ import annotations

import struct

import numpy as np
import torch

from gradwire.errors import DecodeError


class Fp16Adapter:
    """Lossy values: ``[int64 n | n int64 relative indices | n fp16 values]``."""

    def encode(self, *, indices: torch.Tensor, values: torch.Tensor, numel: int) -> tuple[bytes, torch.Tensor]:
        half = values.half()
        data = struct.pack("<q", indices.numel()) + indices.numpy().astype("<i8").tobytes() + half.numpy().tobytes()
        return data, half.float()

    def max_payload_bytes(self, *, most: int, numel: int) -> int:
        return 8 + 10 * most

    def decode(self, data: bytes, numel: int) -> tuple[torch.Tensor, torch.Tensor]:
        if len(data) < 8:
            raise DecodeError("short payload")
        (count,) = struct.unpack_from("<q", data)
        if count < 0 or len(data) != 8 + 10 * count:
            raise DecodeError(f"payload of {len(data)} bytes cannot hold {count} entries")
        indices = np.frombuffer(data, dtype="<i8", count=count, offset=8).astype(np.int64)
        values = np.frombuffer(data, dtype="<f2", count=count, offset=8 + 8 * count).astype(np.float32)
        return torch.from_numpy(indices.copy()), torch.from_numpy(values.copy())


class FailingOnRank(Fp16Adapter):
    """Raises DecodeError in every decode on one rank (as a corrupt payload would)."""

    def __init__(self, failing_rank: int) -> None:
        self.failing_rank = failing_rank

    def decode(self, data: bytes, numel: int) -> tuple[torch.Tensor, torch.Tensor]:
        if torch.distributed.get_rank() == self.failing_rank:
            raise DecodeError("corrupt payload (test)")
        return super().decode(data, numel)


class DyingOnRank(Fp16Adapter):
    """The process of one rank dies when it starts decoding (mid-exchange, after the reduce-scatter)."""

    def __init__(self, dying_rank: int) -> None:
        self.dying_rank = dying_rank

    def decode(self, data: bytes, numel: int) -> tuple[torch.Tensor, torch.Tensor]:
        if torch.distributed.get_rank() == self.dying_rank:
            import os

            os._exit(1)
        return super().decode(data, numel)
