"""Codec pairs on whole models, for ``gradwire bench codecs``: exact byte counts, no timing.

* ``lstm``: the LSTM language model of DeepReduce's and the issue's comparison (vocabulary
  10,000, embedding and hidden size 256, two layers, tied weights: 3.6M parameters) after a
  few SGD steps on word tokens of this Python's standard library (``data.python_source_words``).
  Every parameter keeps its top 10% by magnitude (layer-wise); each codec pair encodes every
  parameter into its own payload. *Relative volume* = all payload bytes / the dense float32
  gradient's bytes, next to DeepReduce's published figures for its LSTM (PTB).
* ``embedding``: an embedding-heavy model (a 100,000 x 64 table, a mean over 20 ids per sample,
  a two-layer head; ids drawn log-uniformly, so a batch of 256 touches a few thousand rows). The
  ``nonzero`` sparsifier selects exactly the non-zero entries; each index codec with ``fp32``
  values encodes them, per parameter and joined into one tensor (the hook's bucket form).
  Reference: the non-zero rows' raw size (rows x row width x 4 bytes, a dense parameter counting
  all its rows). The decoded gradient is checked bit for bit.
"""

from __future__ import annotations

from typing import Any

import torch

from .. import codecs
from ..sparsify import get_sparsifier

#: DeepReduce (Kostopoulou et al., 2021), Table 4-style relative volumes on its LSTM at top-r 10%.
DEEPREDUCE_LSTM = {
    ("raw", "fp32"): ("Top-r COO", 0.200),
    ("bloom", "fp32"): ("Bloom-P0 + fp32", 0.1425),
    ("rice", "polyfit"): ("Fit-Poly", 0.1039),
    ("bloom", "qsgd"): ("QSGD + Bloom-P0", 0.0621),
}

#: (label, index codec, value codec, value options)
LSTM_PAIRS: list[tuple[str, str, str, dict[str, Any]]] = [
    ("raw + fp32", "raw", "fp32", {}),
    ("bloom + fp32", "bloom", "fp32", {}),
    ("rice + fp32", "rice", "fp32", {}),
    ("rice + fp16", "rice", "fp16", {}),
    ("rice + ans (lossless)", "rice", "ans", {}),
    ("rice + polyfit", "rice", "polyfit", {}),
    ("rice + dexp", "rice", "dexp", {}),
    ("bloom + qsgd-4", "bloom", "qsgd", {"seed": 0}),
    ("rice + qsgd-4", "rice", "qsgd", {"seed": 0}),
    ("bloom + qsgd-ans", "bloom", "qsgd-ans", {"seed": 0}),
    ("rice + qsgd-ans", "rice", "qsgd-ans", {"seed": 0}),
    ("rice + qsgd-ans max s=4", "rice", "qsgd-ans", {"seed": 0, "norm": "max", "levels": 4}),
    ("rice + qsgd-ans range s=1 nearest", "rice", "qsgd-ans", {"norm": "range", "levels": 1, "rounding": "nearest"}),
]


def lstm_gradient(steps: int = 3, seed: int = 0, batch: int = 20, seq_len: int = 35) -> list[tuple[str, torch.Tensor]]:
    """(name, gradient) of every parameter of the 3.6M-parameter LSTM LM after ``steps`` steps."""
    from ..harness.data import python_source_words
    from ..harness.models.lstm import LSTMLanguageModel

    tokens, vocab = python_source_words(10_000, max_bytes=2_000_000)
    torch.manual_seed(seed)
    model = LSTMLanguageModel(vocab_size=vocab, embed_dim=256, hidden_size=256, seq_len=seq_len)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    generator = torch.Generator().manual_seed(seed)
    for step in range(steps):
        starts = torch.randint(0, tokens.numel() - seq_len - 1, (batch,), generator=generator)
        window = starts[:, None] + torch.arange(seq_len + 1)
        inputs, targets = tokens[window[:, :-1]], tokens[window[:, 1:]]
        optimizer.zero_grad()
        logits = model(inputs)
        torch.nn.functional.cross_entropy(logits.reshape(-1, vocab), targets.reshape(-1)).backward()
        if step + 1 < steps:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.25)
            optimizer.step()
    return [(name, p.grad.detach().clone()) for name, p in model.named_parameters()]


def embedding_gradient(seed: int = 0, rows: int = 100_000, dim: int = 64, batch: int = 256,
                       ids_per_sample: int = 20) -> list[tuple[str, torch.Tensor]]:
    """(name, gradient) of every parameter of the embedding-heavy model on one batch."""
    torch.manual_seed(seed)
    model = torch.nn.ModuleDict({
        "table": torch.nn.Embedding(rows, dim),
        "hidden": torch.nn.Linear(dim, dim),
        "out": torch.nn.Linear(dim, 1),
    })
    generator = torch.Generator().manual_seed(seed)
    # log-uniform ids: popular rows recur, most rows stay untouched (a recommender's long tail)
    ids = (rows ** torch.rand(batch, ids_per_sample, generator=generator)).long().clamp_(1, rows) - 1
    labels = torch.rand(batch, 1, generator=generator)
    features = model["table"](ids).mean(1)
    prediction = model["out"](torch.relu(model["hidden"](features)))
    torch.nn.functional.mse_loss(prediction, labels).backward()
    return [(name, p.grad.detach().clone()) for name, p in model.named_parameters()]


def _top_fraction(flat: torch.Tensor, density: float) -> torch.Tensor:
    return get_sparsifier("topk", density=density).select(flat)


def lstm_rows(gradient: list[tuple[str, torch.Tensor]], density: float = 0.1) -> list[dict[str, Any]]:
    """One row per codec pair: relative volume and the relative L2 error of the sent values."""
    dense_bytes = 4 * sum(g.numel() for _, g in gradient)
    selections = [(g.reshape(-1), _top_fraction(g.reshape(-1), density)) for _, g in gradient]
    rows = []
    for label, index_name, value_name, options in LSTM_PAIRS:
        index_codec = codecs.get_index_codec(index_name)
        value_codec = codecs.get_value_codec(value_name, **options)
        total, error, reference = 0, 0.0, 0.0
        for flat, indices in selections:
            values = flat[indices]
            encoded = codecs.encode_tensors([(values, indices, flat.numel())], index_codec, value_codec,
                                            dense=[flat], check=False)
            total += len(encoded.payload)
            # the receiver knows each parameter's size: without max_numel the payload-size budget
            # (meant for bytes from strangers) refuses Bloom's large tensors (it scans every position)
            decoded_values, decoded_indices, _ = codecs.decode(encoded.payload, max_numel=flat.numel())
            sent = torch.zeros_like(flat).index_put_((indices,), values)
            received = torch.zeros(flat.numel(), dtype=torch.float64).index_put_(
                (decoded_indices,), decoded_values.double())
            error += float(((received - sent.double()) ** 2).sum())
            reference += float((sent.double() ** 2).sum())
        published = None if options.get("norm") else DEEPREDUCE_LSTM.get((index_name, value_name))
        rows.append({
            "pair": label, "bytes": total, "relative_volume": total / dense_bytes,
            "relative_l2_error": (error / reference) ** 0.5 if reference else 0.0,
            "deepreduce": f"{published[0]} {published[1]:.4f}" if published else "",
        })
    return rows


def _row_width(gradient: torch.Tensor) -> int:
    return gradient.shape[-1] if gradient.dim() >= 2 else gradient.numel()


def embedding_rows(gradient: list[tuple[str, torch.Tensor]],
                   index_names: tuple[str, ...] = ("rle", "rice", "eliasfano", "delta-varint", "bitmap", "raw"),
                   ) -> tuple[list[dict[str, Any]], dict[str, int]]:
    """Per index codec with ``fp32`` values on the ``nonzero`` selection: bytes per layer-wise and
    joined payload, and their ratio to the non-zero rows' raw size. Checks exactness."""
    chooser = get_sparsifier("nonzero")
    flats = [g.reshape(-1) for _, g in gradient]
    selections = [chooser.select(flat) for flat in flats]
    raw_rows = 0
    for (_, g), flat in zip(gradient, flats):
        width = _row_width(g)
        nonzero_rows = int((flat.reshape(-1, width) != 0).any(1).sum())
        raw_rows += 4 * width * nonzero_rows
    offsets = torch.tensor([0] + [f.numel() for f in flats]).cumsum(0)
    joined_values = torch.cat([f[i] for f, i in zip(flats, selections)])
    joined_indices = torch.cat([i + int(o) for i, o in zip(selections, offsets[:-1])])
    joined_flat = torch.cat(flats)
    value_codec = codecs.get_value_codec("fp32")
    rows = []
    for name in index_names:
        index_codec = codecs.get_index_codec(name)
        layer_bytes = sum(len(codecs.encode_tensors([(f[i], i, f.numel())], index_codec, value_codec,
                                                    check=False).payload) for f, i in zip(flats, selections))
        payload = codecs.encode_tensors([(joined_values, joined_indices, joined_flat.numel())], index_codec,
                                        value_codec, check=False).payload
        values, indices, numel = codecs.decode(payload, max_numel=joined_flat.numel())  # a size we know
        rebuilt = torch.zeros(numel).index_put_((indices,), values)
        exact = bool(torch.equal(rebuilt.view(torch.int32), joined_flat.view(torch.int32)))
        rows.append({"index_codec": name, "layerwise_bytes": layer_bytes, "joined_bytes": len(payload),
                     "layerwise_vs_rows": layer_bytes / raw_rows, "joined_vs_rows": len(payload) / raw_rows,
                     "exact": exact})
    info = {"dense_bytes": 4 * joined_flat.numel(), "nonzero_row_bytes": raw_rows,
            "nonzeros": int(joined_indices.numel())}
    return rows, info


#: (label, value codec, options) of the curve-fit table.
CURVEFIT_CODECS: list[tuple[str, str, dict[str, Any]]] = [
    ("fp16", "fp16", {}),
    ("polyfit (fitted or raw only)", "polyfit", {"level_layout": False}),
    ("polyfit", "polyfit", {}),
    ("dexp", "dexp", {}),
]


def curvefit_rows(exponents: tuple[int, ...] = (16, 18, 20, 22), seed: int = 0) -> list[dict[str, Any]]:
    """``polyfit``/``dexp`` at tolerance 0.05 on k = 2**e gradient-like values (N(0, 1e-3**2)):
    bits per value, the largest error as a fraction of max|v| (the stated bound is 0.05), the
    layout sent (0 plain, 1 fitted, 2 levels) and encode/decode seconds."""
    import time

    rows = []
    generator = torch.Generator().manual_seed(seed)
    for exponent in exponents:
        k = 1 << exponent
        values = torch.randn(k, generator=generator) * 1e-3
        peak = float(values.abs().max())
        for label, name, options in CURVEFIT_CODECS:
            codec = codecs.get_value_codec(name, **options)
            start = time.perf_counter()
            data, received = codec.encode_with_reconstruction(values)
            middle = time.perf_counter()
            decoded = codec.decode(memoryview(data), k, values.dtype)
            end = time.perf_counter()
            if not torch.equal(decoded, received):
                raise AssertionError(f"{label}: decode differs from the encoder's reconstruction")
            rows.append({"k": k, "codec": label, "bits_per_value": 8 * len(data) / k,
                         "max_error_vs_peak": float((decoded.double() - values.double()).abs().max()) / peak,
                         "layout": data[0] if name != "fp16" else -1,
                         "encode_s": middle - start, "decode_s": end - middle})
    return rows


LOSSLESS_CODECS: list[tuple[str, str, dict[str, Any]]] = [
    ("ans", "ans", {}),
    ("zstd (shuffle)", "zstd", {}),
    ("zstd-19 (shuffle)", "zstd", {"level": 19}),
    ("deflate (shuffle)", "deflate", {}),
]


def lossless_rows(k: int = 167_772, seed: int = 0, repeats: int = 2) -> list[dict[str, Any]]:
    """Lossless value codecs on k gradient-like values in float16, bfloat16 and float32:
    bits per value and encode/decode throughput of the dense gradient at 1% density
    (4 * 100 k bytes / seconds, best of ``repeats``), checked bit for bit."""
    import time

    generator = torch.Generator().manual_seed(seed)
    data = {"N(0,1e-3^2)": torch.randn(k, generator=generator) * 1e-3,
            "randn^3": torch.randn(k, generator=generator) ** 3}
    rows = []
    for label, base in data.items():
        for dtype in (torch.float16, torch.bfloat16, torch.float32):
            values = base.to(dtype)
            for name, codec_name, options in LOSSLESS_CODECS:
                codec = codecs.get_value_codec(codec_name, **options)
                encode_s = decode_s = float("inf")
                for _ in range(repeats):
                    start = time.perf_counter()
                    payload = codec.encode(values)
                    middle = time.perf_counter()
                    decoded = codec.decode(memoryview(payload), k, dtype)
                    encode_s, decode_s = min(encode_s, middle - start), min(decode_s, time.perf_counter() - middle)
                width = {2: torch.int16, 4: torch.int32}[values.element_size()]
                if not torch.equal(decoded.view(width), values.view(width)):
                    raise AssertionError(f"{name} is not lossless on {label} {dtype}")
                dense = 4.0 * 100 * k
                rows.append({"data": label, "dtype": str(dtype).replace("torch.", ""), "codec": name,
                             "bits_per_value": 8 * len(payload) / k, "encode_gbps": dense / encode_s / 1e9,
                             "decode_gbps": dense / decode_s / 1e9})
    return rows
