"""Helpers shared by the per-codec value tests (fuzzing decoders, error bounds)."""

from __future__ import annotations

from typing import Callable

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gradwire.codecs.base import ValueCodec
from gradwire.errors import DecodeError

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]


def decode_or_decode_error(codec: ValueCodec, data: bytes, count: int, dtype: torch.dtype) -> None:
    """Decoding arbitrary bytes either raises DecodeError or yields ``count`` values of ``dtype``."""
    try:
        out = codec.decode(memoryview(data), count, dtype)
    except DecodeError:
        return
    assert isinstance(out, torch.Tensor) and out.shape == (count,) and out.dtype == dtype


Seed = tuple[bytes, int, torch.dtype]


def fuzz_decoder(make: Callable[[], ValueCodec], seeds: list[Seed], max_examples: int = 150) -> None:
    """Hypothesis: arbitrary bytes, and valid sections ``(bytes, count, dtype)`` in ``seeds``
    with bytes overwritten, truncated or extended, decoded with their own or an arbitrary count
    and dtype. A default-constructed codec decodes, as the payload decoder does."""
    codec = make()

    @settings(max_examples=max_examples, deadline=None, suppress_health_check=list(HealthCheck))
    @given(
        data=st.data(),
        count=st.one_of(st.integers(0, 3000), st.integers(0, 1 << 41)),
        dtype=st.sampled_from(DTYPES),
    )
    def run(data: st.DataObject, count: int, dtype: torch.dtype) -> None:
        if not seeds or data.draw(st.booleans()):
            raw = data.draw(st.binary(max_size=400))
        else:
            seed, seed_count, seed_dtype = data.draw(st.sampled_from(seeds))
            if data.draw(st.booleans()):
                count, dtype = seed_count, seed_dtype
            raw = bytearray(seed)
            for _ in range(data.draw(st.integers(0, 4))):
                if raw:
                    raw[data.draw(st.integers(0, len(raw) - 1))] = data.draw(st.integers(0, 255))
            edit = data.draw(st.sampled_from(["keep", "cut", "extend"]))
            if edit == "cut":
                raw = raw[: data.draw(st.integers(0, len(raw)))]
            elif edit == "extend":
                raw = raw + data.draw(st.binary(min_size=1, max_size=8))
            raw = bytes(raw)
        decode_or_decode_error(codec, raw, count, dtype)

    run()


def relative_bound(tolerance: float) -> Callable[[torch.Tensor], torch.Tensor]:
    """``tolerance * max|v|`` for every element: the curve-fitting codecs' guarantee."""

    def bound(values: torch.Tensor) -> torch.Tensor:
        return torch.full((values.numel(),), tolerance * values.double().abs().max().item(), dtype=torch.float64)

    return bound
