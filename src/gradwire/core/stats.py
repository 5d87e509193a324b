"""Bytes and seconds, counted in one place.

Every exchange adds to an :class:`ExchangeStats`: bytes this rank sent, bytes a dense ring
AllReduce would have sent for the same tensors, and seconds per phase. ``snapshot()`` returns a
plain dict with the last step's numbers and the running totals.
"""

from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager
from typing import Iterator

#: Phases timed on the hot path (seconds_<phase>); ``sparsify`` is reported as compensate + select.
PHASES = ("check", "compensate", "select", "sparsify", "encode", "communicate", "decode", "agree")


class ExchangeStats:
    """Per-step and cumulative counters. Units: bytes and seconds (wall clock, this rank)."""

    def __init__(self) -> None:
        self.steps = 0
        self.total: dict[str, float] = defaultdict(float)
        self.current: dict[str, float] = defaultdict(float)
        self.last: dict[str, float] = {}
        self.residual_norm = 0.0
        self.skipped_steps = 0

    def add(self, name: str, amount: float) -> None:
        self.current[name] += amount
        self.total[name] += amount

    @contextmanager
    def timer(self, phase: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.add(f"seconds_{phase}", time.perf_counter() - start)

    def end_step(self) -> None:
        self.last = dict(self.current)
        self.current = defaultdict(float)
        self.steps += 1

    def snapshot(self) -> dict[str, float]:
        """``{"step": ..., "bytes_sent": last step, "bytes_dense": ..., "compression_ratio": ...,
        "seconds_<phase>": ..., "total_bytes_sent": ..., ...}``."""
        out: dict[str, float] = {"step": self.steps, "skipped_steps": self.skipped_steps,
                                 "residual_norm": self.residual_norm}
        for prefix, source in (("", self.last), ("total_", self.total)):
            for key in ("bytes_sent", "bytes_dense", *(f"seconds_{p}" for p in PHASES)):
                out[prefix + key] = float(source.get(key, 0.0))
            out[prefix + "seconds_sparsify"] = float(source.get("seconds_compensate", 0.0)
                                                     + source.get("seconds_select", 0.0))
            sent = source.get("bytes_sent", 0.0)
            out[prefix + "compression_ratio"] = float(source.get("bytes_dense", 0.0) / sent) if sent else 0.0
        for key, value in self.total.items():
            if key.startswith("count_"):
                out[key] = value
        return out
