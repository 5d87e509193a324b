"""Encode/decode time of one ResNet-18 step's payload: joined (one record) vs one record per parameter.

Top-k 1% of every parameter of ResNet-18 (random gradients, one bucket holding all 62 tensors,
one thread), the way the hook encodes a bucket now (``gradwire.core.payload``, joined for lossless
index codecs) and the way it did before (``codecs.encode_tensors`` with one record per tensor).

    python scripts/bucket_payload_timing.py
"""

from __future__ import annotations

import time
from typing import Any, Callable

import torch

from gradwire import codecs
from gradwire.core.payload import Part, decode_bucket, encode_bucket
from gradwire.harness.models import build_model
from gradwire.sparsify import get_sparsifier


def _milliseconds(run: Callable[[], Any], repeats: int = 10) -> float:
    run()
    start = time.perf_counter()
    for _ in range(repeats):
        run()
    return (time.perf_counter() - start) / repeats * 1e3


def main() -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    parameters = list(build_model("resnet18", num_classes=10).parameters())
    sparsifier = get_sparsifier("topk", density=0.01)
    dense = [torch.randn(p.numel()) for p in parameters]
    offsets, total = [], 0
    for tensor in dense:
        offsets.append(total)
        total += tensor.numel()
    parts = [Part(tensor, sparsifier.select(tensor), offset) for tensor, offset in zip(dense, offsets)]
    numels = [tensor.numel() for tensor in dense]
    print(f"ResNet-18: {len(parts)} tensors, {total:,} elements, "
          f"{sum(p.indices.numel() for p in parts):,} selected; ms per payload, 1 thread")
    print(f"{'codecs':18s} {'form':10s} {'encode':>7s} {'decode':>7s} {'bytes':>9s}")
    for value_name, index_name in (("fp16", "rice"), ("fp16", "eliasfano"), ("fp32", "raw")):
        value_codec, index_codec = codecs.resolve_codecs(value_name, index_name, {})
        joined = encode_bucket(parts, total, index_codec=index_codec, value_codec=value_codec)
        encode_ms = _milliseconds(lambda: encode_bucket(parts, total, index_codec=index_codec, value_codec=value_codec))
        decode_ms = _milliseconds(lambda: decode_bucket(memoryview(joined.payload), numels, offsets, total,
                                                        index_codec=index_codec))
        label = f"{value_name}/{index_name}"
        print(f"{label:18s} {'joined':10s} {encode_ms:7.2f} {decode_ms:7.2f} {len(joined.payload):9,d}")
        def per_tensor() -> Any:  # what the hook did before: gather each tensor's values, one record each
            triples = [(p.compensated[p.indices], p.indices, p.compensated.numel()) for p in parts]
            return codecs.encode_tensors(triples, index_codec, value_codec, check=False)

        separate = per_tensor()
        encode_ms = _milliseconds(per_tensor)
        decode_ms = _milliseconds(lambda: codecs.decode_tensors(memoryview(separate.payload), expected_numels=numels))
        print(f"{label:18s} {'per-tensor':10s} {encode_ms:7.2f} {decode_ms:7.2f} {len(separate.payload):9,d}")


if __name__ == "__main__":
    main()
