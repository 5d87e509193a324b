"""FSDP2 front-end of the compression core: a compressed reduce-scatter for
``FSDPModule.set_custom_reduce_scatter`` (and HSDP's AllReduce across replicas).

>>> import gradwire.fsdp                                            # doctest: +SKIP
>>> fully_shard(block) for each block; fully_shard(model)            # doctest: +SKIP
>>> state = gradwire.fsdp.compress(model, quantize="int8")           # doctest: +SKIP

Its groups are an FSDP module's flat unsharded gradient, laid out chunk by rank (:mod:`.layout`);
its target is this rank's shard (:mod:`.state`, docs/fsdp.md, docs/architecture.md).
"""

from __future__ import annotations

from typing import Any

__all__ = ["CompressedReduceScatter", "FSDPCompressionState", "MomentumAdamW", "compress"]


def __getattr__(name: str) -> Any:  # the layout helpers stay importable without FSDP and the core
    if name == "MomentumAdamW":
        from .momentum import MomentumAdamW

        return MomentumAdamW
    if name in __all__:
        from . import state

        return getattr(state, name)
    raise AttributeError(f"module 'gradwire.fsdp' has no attribute {name!r}")
