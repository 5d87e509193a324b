"""``gradwire bench sparsify``: how fast each sparsifier selects, against exact ``torch.topk``.

The gradient is synthetic: ``--numel`` (default 2**24) float32 values ~ N(0, 1) from a fixed
seed, on the CPU. For each density and each sparsifier (``threshold`` gets the magnitude that
keeps ``density`` of a standard normal, ``Phi^-1(1 - density / 2)``): the median and best time
of ``--repeats`` rounds after one warm-up run, throughput in GB/s of the dense float32 gradient
(``4 * numel`` bytes / median seconds), the speedup over ``torch.topk(x.abs(), k)`` (baseline
median / median, and baseline best / best), and the achieved count over the target k.

Timings on a shared machine are noisy: rounds interleave the baseline and every sparsifier so
that a burst of load hits them alike, and the best-of-rounds columns are the least disturbed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any, Callable

import torch

from .. import sparsify
from ..tables import format_table
from ..cli.main import json_path_error

DEFAULT_DENSITIES = (0.001, 0.01, 0.1)
BASELINE = "torch.topk"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``gradwire bench sparsify``'s options to ``parser`` (:mod:`gradwire.cli.main` calls it)."""
    parser.add_argument("--numel", type=int, default=1 << 24, help="elements of the gradient (default 2**24)")
    parser.add_argument("--densities", default=",".join(map(str, DEFAULT_DENSITIES)), help="comma-separated, in (0, 1]")
    parser.add_argument("--sparsifiers", default="all", help="comma-separated names or 'all'")
    parser.add_argument("--repeats", type=int, default=5,
                        help="timed rounds, each running every sparsifier once (median and best reported)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the synthetic gradient")
    parser.add_argument("--json", metavar="PATH", help="also write every row as JSON")


def time_interleaved(runs: list[Callable[[], Any]], repeats: int) -> tuple[list[list[float]], list[Any]]:
    """Seconds of each of ``repeats`` rounds per run, and each run's last result.

    Every run is warmed up once; then each round times every run once, in turn, so that a burst
    of load from other processes slows all of them alike rather than one.
    """
    results = [run() for run in runs]
    seconds: list[list[float]] = [[] for _ in runs]
    for _ in range(max(1, repeats)):
        for position, run in enumerate(runs):
            start = time.perf_counter()
            results[position] = run()
            seconds[position].append(time.perf_counter() - start)
    return seconds, results


def _parse_densities(text: str) -> list[float]:
    try:
        densities = [float(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ValueError(f"densities={text!r} must be comma-separated numbers in (0, 1]") from None
    for density in densities:
        if not 0.0 < density <= 1.0:
            raise ValueError(f"density={density!r} must be in (0, 1]")
    return densities


def _parse_names(text: str) -> list[str]:
    available = sparsify.sparsifiers()
    if text == "all":
        return available
    names = [part.strip() for part in text.split(",") if part.strip()]
    for name in names:
        if name not in available:
            raise ValueError(f"sparsifier={name!r} is not supported; allowed: all, {', '.join(available)}")
    return names


def _make(name: str, density: float, seed: int) -> sparsify.Sparsifier:
    if name == "threshold":
        # The magnitude a standard normal exceeds with probability `density`.
        quantile = torch.special.ndtri(torch.tensor(1.0 - density / 2.0, dtype=torch.float64))
        return sparsify.get_sparsifier(name, threshold=max(float(quantile), 1e-12), seed=seed)
    return sparsify.get_sparsifier(name, density=density, seed=seed)


def _row(name: str, density: float, numel: int, seconds: list[float], count: int, target_k: int,
         baseline: list[float]) -> dict[str, Any]:
    median = statistics.median(seconds)
    return {
        "sparsifier": name,
        "density": density,
        "numel": numel,
        "target_k": target_k,
        "k": count,
        "k_ratio": count / target_k,
        "median_s": median,
        "best_s": min(seconds),
        "gbps": 4 * numel / median / 1e9,  # dense float32 bytes per second
        "speedup": statistics.median(baseline) / median,
        "speedup_best": min(baseline) / min(seconds),
        "repeats": len(seconds),
    }


def measure(numel: int, densities: list[float], names: list[str], repeats: int, seed: int) -> list[dict[str, Any]]:
    """One row per (density, sparsifier), after the ``torch.topk`` baseline row of each density."""
    flat = torch.randn(numel, generator=torch.Generator().manual_seed(seed))
    rows: list[dict[str, Any]] = []
    for density in densities:
        k = min(numel, max(1, round(density * numel)))
        chosen = [_make(name, density, seed) for name in names]
        runs: list[Callable[[], Any]] = [lambda: torch.topk(flat.abs(), k, sorted=False).indices]
        runs += [lambda s=sparsifier: s.select(flat, step=1, tensor_id=0) for sparsifier in chosen]
        seconds, results = time_interleaved(runs, repeats)
        rows.append(_row(BASELINE, density, numel, seconds[0], k, k, seconds[0]))
        for sparsifier, times, indices in zip(chosen, seconds[1:], results[1:]):
            target = sparsifier.target_k(numel) or k  # threshold has no target: compare with k
            rows.append(_row(sparsifier.name, density, numel, times, int(indices.numel()), target, seconds[0]))
    return rows


def run(args: argparse.Namespace) -> int:
    """Run ``gradwire bench sparsify``: measure and print the table; returns 0, or 2 on a bad option."""
    problem = json_path_error(args.json)
    if problem is not None:
        print(f"gradwire bench sparsify: {problem}", file=sys.stderr)
        return 2
    try:
        densities = _parse_densities(args.densities)
        names = _parse_names(args.sparsifiers)
    except ValueError as error:
        print(f"gradwire bench sparsify: {error}", file=sys.stderr)
        return 2
    if args.numel < 1:
        print(f"gradwire bench sparsify: numel={args.numel} must be >= 1", file=sys.stderr)
        return 2
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    rows = measure(args.numel, densities, names, args.repeats, args.seed)

    print(f"numel={args.numel} float32 on cpu, torch {torch.__version__}, {threads} thread(s)"
          f"{'' if args.threads > 0 else ' (torch default)'}, {args.repeats} interleaved rounds after 1 warm-up")
    print("threshold: fixed magnitude Phi^-1(1 - density/2), so its target k is the expected count on N(0, 1) data")
    headers = ["density", "sparsifier", "median ms", "best ms", "GB/s", "speedup", "best speedup", "k", "target k",
               "k/target"]
    table = [
        [f"{row['density']:g}", row["sparsifier"], f"{row['median_s'] * 1e3:.1f}", f"{row['best_s'] * 1e3:.1f}",
         f"{row['gbps']:.2f}", f"{row['speedup']:.1f}x", f"{row['speedup_best']:.1f}x", row["k"], row["target_k"],
         f"{row['k_ratio']:.3f}"]
        for row in rows
    ]
    print(format_table(headers, table))
    if args.json:
        document = {"numel": args.numel, "threads": threads, "torch": torch.__version__, "repeats": args.repeats,
                    "baseline": "torch.topk(x.abs(), k, sorted=False)", "rows": rows}
        with open(args.json, "w") as handle:
            json.dump(document, handle, indent=2)
    return 0
