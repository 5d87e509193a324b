"""FSDP2 front-end of the compression core: a compressed reduce-scatter for
``FSDPModule.set_custom_reduce_scatter`` (and the cross-replica all-reduce of HSDP).

Its groups are an FSDP module's flat unsharded gradient, laid out chunk by rank; its target is
this rank's shard (see docs/architecture.md).
"""
