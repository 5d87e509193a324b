"""``gradwire bench lowrank``: parameters, compute and AllReduce bytes, full-rank vs factorized.

For each shipped model: trainable parameters; forward+backward seconds per batch on this CPU
(median of ``--repeats`` timed iterations after one untimed warm-up iteration, with
``torch.set_num_threads(--threads)``, default 1 to mimic one worker per core); the bytes one
AllReduce of the float32 gradients carries per step (4 bytes x trainable parameters), and what
each worker sends in a ring AllReduce over p workers, 2(p-1)/p of that.

    python -m gradwire bench lowrank --models resnet18 vgg19 --batch-size 32 --repeats 5 --json out.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..lowrank.factorize import factorize
from ..lowrank.report import format_table
from ..harness.models import MODELS, build_model
from ..cli.main import json_path_error

BYTES_PER_PARAMETER = 4  # float32 gradients


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``gradwire bench lowrank``'s options to ``parser`` (:mod:`gradwire.cli.main` calls it)."""
    parser.add_argument("--models", nargs="+", choices=tuple(MODELS), default=list(MODELS), metavar="MODEL",
                        help=f"models to measure (default: all of {', '.join(MODELS)})")
    parser.add_argument("--batch-size", type=int, default=32, help="batch size (default 32)")
    parser.add_argument("--repeats", type=int, default=5,
                        help="timed iterations per model, median reported (default 5)")
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads for the timing (default 1)")
    parser.add_argument("--rank-ratio", type=float, default=0.25, help="rank / full rank (default 0.25)")
    parser.add_argument("--workers", type=int, default=4, help="p for the ring AllReduce volume (default 4)")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")


def measure(name: str, batch_size: int, repeats: int, rank_ratio: float, workers: int) -> dict[str, Any]:
    """One model's row: parameters, seconds per forward+backward and bytes, full vs low rank."""
    torch.manual_seed(0)
    full = build_model(name)
    low = factorize(full, rank_ratio=rank_ratio)
    batch = full.example_input(batch_size)
    row: dict[str, Any] = {"model": name, "batch_size": batch_size, "rank_ratio": rank_ratio, "workers": workers}
    for label, model in (("full", full), ("lowrank", low)):
        params = sum(p.numel() for p in model.parameters() if p.requires_grad)
        row[f"params_{label}"] = params
        row[f"bytes_per_step_{label}"] = BYTES_PER_PARAMETER * params
        row[f"ring_bytes_per_worker_{label}"] = 2 * (workers - 1) / workers * BYTES_PER_PARAMETER * params
        row[f"seconds_{label}"] = time_forward_backward(model, batch, repeats)
    row["bytes_ratio"] = row["bytes_per_step_lowrank"] / row["bytes_per_step_full"]
    row["time_ratio"] = row["seconds_lowrank"] / row["seconds_full"]
    return row


def time_forward_backward(model: nn.Module, batch: torch.Tensor, repeats: int) -> float:
    """Median seconds of forward + cross-entropy + backward, after one untimed iteration."""
    model.train()
    with torch.no_grad():
        logits_shape = model(batch).shape  # (N, classes) or (N, T, vocab)
    generator = torch.Generator().manual_seed(0)
    targets = torch.randint(logits_shape[-1], logits_shape[:-1], generator=generator).to(batch.device)

    def step() -> None:
        model.zero_grad(set_to_none=True)
        logits = model(batch)
        F.cross_entropy(logits.flatten(0, -2), targets.flatten()).backward()

    step()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def format_rows(rows: list[dict[str, Any]]) -> str:
    """The table of :func:`measure`'s rows: parameters, time and bytes, full-rank against low-rank."""
    headers = ("model", "params", "params lr", "x", "ms fwd+bwd", "ms lr", "x", "MB/step", "MB lr",
               f"ring MB/worker p={rows[0]['workers'] if rows else 4}", "ring lr")
    mb = 1e6
    lines = [(row["model"], f"{row['params_full']:,}", f"{row['params_lowrank']:,}", f"{row['bytes_ratio']:.3f}",
              f"{row['seconds_full'] * 1e3:.1f}", f"{row['seconds_lowrank'] * 1e3:.1f}", f"{row['time_ratio']:.3f}",
              f"{row['bytes_per_step_full'] / mb:.2f}", f"{row['bytes_per_step_lowrank'] / mb:.2f}",
              f"{row['ring_bytes_per_worker_full'] / mb:.2f}", f"{row['ring_bytes_per_worker_lowrank'] / mb:.2f}")
             for row in rows]
    return format_table(headers, lines)


def run(args: argparse.Namespace) -> int:
    """Run ``gradwire bench lowrank``: measure and print the table; returns 0, or 2 on a bad option."""
    problem = json_path_error(args.json)
    if problem is not None:
        print(f"gradwire bench lowrank: {problem}", file=sys.stderr)
        return 2
    from tqdm import tqdm

    for option in ("batch_size", "repeats", "threads", "workers"):
        if getattr(args, option) < 1:
            print(f"gradwire bench lowrank: error: --{option.replace('_', '-')} must be >= 1", file=sys.stderr)
            return 2
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        rows = [measure(name, args.batch_size, args.repeats, args.rank_ratio, args.workers)
                for name in tqdm(args.models, desc="bench lowrank", unit="model", disable=None, leave=False)]
    finally:
        torch.set_num_threads(previous_threads)
    print(f"forward+backward per batch of {args.batch_size} (median of {args.repeats}, {args.threads} thread(s)); "
          f"bytes = {BYTES_PER_PARAMETER} x trainable parameters; x = low rank / full rank")
    print(format_rows(rows))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump({"threads": args.threads, "repeats": args.repeats, "rows": rows}, handle, indent=2)
    return 0
