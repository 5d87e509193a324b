"""Pufferfish: train full-rank for a short warm-up, then factorize layers into SVD-initialised
low-rank pairs and keep training the smaller model (Wang, Agarwal, Papailiopoulos, MLSys 2021).

>>> from gradwire.lowrank import factorize, Warmup, summarize
"""

from __future__ import annotations

from .factorize import LayerDecision, check_options, factorize, find_candidates
from .layers import (LowRankConv1D, LowRankConv2d, LowRankLinear, LowRankLSTM, LowRankMultiheadAttention, rank_for,
                     svd_factors)
from .report import Summary, summarize
from .warmup import Warmup

__all__ = [
    "LayerDecision", "LowRankConv1D", "LowRankConv2d", "LowRankLSTM", "LowRankLinear", "LowRankMultiheadAttention",
    "Summary", "Warmup", "check_options", "factorize", "find_candidates", "rank_for", "summarize", "svd_factors",
]
