"""Measure every value codec on k = 167,772 gradient-like values (not a unit test).

For each codec and data set: bits per value on the wire (section bytes * 8 / k), relative L2
error ||decoded - v|| / ||v||, max error relative to max|v|, and median encode / decode time
of a few runs. ``polyfit*`` / ``dexp*`` rows marked "(fit)" force the fitted layout
(sorted-curve parameters + the permutation) that the codecs skip when plain float16 is smaller.

    .venv/bin/python scripts/measure_value_codecs.py [--k 167772] [--repeat 3]
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable

import torch

import gradwire.codecs as codecs
from gradwire.codecs.values import _fit
from gradwire.codecs.values.dexp import DoubleExpModel
from gradwire.codecs.values.polyfit import ChebyshevModel


def timed(run: Callable[[], object], repeat: int) -> tuple[object, float]:
    times, result = [], None
    for _ in range(repeat):
        start = time.perf_counter()
        result = run()
        times.append(time.perf_counter() - start)
    return result, statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--k", type=int, default=167_772)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    generator = torch.Generator().manual_seed(0)
    data = {
        "normal*1e-3": torch.randn(args.k, generator=generator) * 1e-3,
        "randn**3": torch.randn(args.k, generator=generator) ** 3,
    }
    entries: list[tuple[str, Callable[[torch.Tensor], bytes], Callable[[bytes, torch.Tensor], torch.Tensor]]] = []
    for spec in [
        ("fp32", {}), ("fp16", {}), ("bf16", {}),
        ("zstd", {}), ("zstd", {"shuffle": False}), ("deflate", {}),
        ("qsgd", {"bits": 2, "seed": 0}), ("qsgd", {"bits": 4, "seed": 0}), ("qsgd", {"bits": 8, "seed": 0}),
        ("polyfit", {}), ("polyfit", {"tolerance": 0.001}), ("dexp", {}),
    ]:
        codec = codecs.get_value_codec(spec[0], **spec[1])
        shown = [f"{k}={v}" for k, v in spec[1].items() if k != "seed"]
        label = spec[0] + ("(" + ",".join(shown) + ")" if shown else "")
        entries.append((label, codec.encode, lambda d, v, c=codec: type(c)().decode(memoryview(d), v.numel(), v.dtype)))
    for label, model, tolerance in [
        ("polyfit(fit,tol=0.05)", ChebyshevModel(4), 0.05),
        ("polyfit(fit,tol=0.01)", ChebyshevModel(4), 0.01),
        ("dexp(fit,tol=0.05)", DoubleExpModel(), 0.05),
    ]:
        entries.append((
            label,
            lambda v, m=model, t=tolerance: _fit.encode_fit(v, m, t, allow_plain=False)[0],
            lambda d, v, m=model: _fit.decode_fit(memoryview(d), v.numel(), v.dtype, lambda p, m=m: m),
        ))
    print(f"k = {args.k}, median of {args.repeat} runs, 1 torch thread\n")
    print(f"| {'codec':28s} | {'data':11s} | bits/value | rel. L2 err | max err/max|v| | encode ms | decode ms |")
    print(f"|{'-' * 30}|{'-' * 13}|-----------:|------------:|---------------:|----------:|----------:|")
    for label, encode, decode in entries:
        for name, values in data.items():
            section, encode_s = timed(lambda: encode(values), args.repeat)
            decoded, decode_s = timed(lambda: decode(section, values), args.repeat)
            diff = decoded.double() - values.double()
            rel_l2 = (diff.norm() / values.double().norm()).item()
            rel_max = (diff.abs().max() / values.double().abs().max()).item()
            print(f"| {label:28s} | {name:11s} | {len(section) * 8 / values.numel():10.2f} | {rel_l2:11.2e} | "
                  f"{rel_max:14.2e} | {encode_s * 1e3:9.1f} | {decode_s * 1e3:9.1f} |")


if __name__ == "__main__":
    main()
