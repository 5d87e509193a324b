"""``gradwire bench e2e``: methods x bandwidths x worker counts, on real rate-limited links.

For each worker count and bandwidth it brings up an emulated cluster (one network namespace per
worker, tc-limited links; ``--local`` uses loopback instead), runs every method for a fixed
number of steps after a few warm-up steps, and also measures the compute-only floor
(forward+backward under ``no_sync``, no communication). Times are reported as ratios to
AllReduce measured in the same run, and as communication overhead ``step / compute_only - 1``.

Writes ``results.json``, ``report.md`` and PNG plots into ``--out``: per-iteration time stacked
by phase, speedup vs AllReduce, bytes per step, and (with ``--accuracy``) test accuracy vs wall
time of MNIST-5k runs.
"""

from __future__ import annotations

import argparse
import json
import math
import os
from typing import Any

from ..training import file_slug
from ..tables import format_table

DEFAULT_METHODS = [
    "allreduce",
    "torch-fp16",
    "torch-powersgd:rank=4",
    "topk:density=0.01,values=fp16,indices=rice",
    "sampled-topk:density=0.01,values=fp16,indices=rice",
    "randomblock:density=0.01,values=fp16",
    "pufferfish:rank_ratio=0.25,warmup_epochs=0",
    "pufferfish:rank_ratio=0.25,warmup_epochs=0+sampled-topk:density=0.01,values=fp16,indices=rice",
]
#: Stacked in the phase plot; the hook's compress/decompress run inside backward and are shown
#: apart from the rest of it (communication overlaps backward and is not subtracted).
PHASES = ("seconds_forward", "seconds_backward", "seconds_compress", "seconds_decompress", "seconds_optimizer")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="resnet18")
    parser.add_argument("--data", default=None)
    parser.add_argument("--method", action="append", dest="methods", metavar="SPEC", help="repeatable (default: a set of 8)")
    parser.add_argument("--bandwidths", default="100mbit,1gbit,10gbit", help="comma-separated tc rates")
    parser.add_argument("--latency", default="0.5ms")
    parser.add_argument("--workers", default="4", help="comma-separated worker counts")
    parser.add_argument("--steps", type=int, default=5, help="measured steps per method")
    parser.add_argument("--warmup-steps", type=int, default=2, help="steps run first and left out")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--local", action="store_true", help="loopback instead of namespaces (no root needed; no rate limit)")
    parser.add_argument("--accuracy", action="store_true",
                        help="also run MNIST-5k accuracy runs (cnn, 2 workers, --accuracy-epochs epochs) per method")
    parser.add_argument("--accuracy-epochs", type=int, default=5)
    parser.add_argument("--accuracy-methods", default="allreduce;topk:density=0.01,values=fp16,indices=rice;"
                        "pufferfish:rank_ratio=0.25,warmup_epochs=1", help="';'-separated specs")
    parser.add_argument("--report-only", action="store_true", help="rebuild report.md and plots from results.json")
    parser.add_argument("--accuracy-only", action="store_true", help="skip the timing sweep; only the accuracy runs")
    parser.add_argument("--out", default="bench-out/e2e", metavar="DIR")
    parser.add_argument("--timeout", type=float, default=3000, help="seconds per launch")


def _launch(methods: list[str], args: argparse.Namespace, workers: int, bandwidth: str | None, *,
            compute_only: bool = False, barrier: bool = False, model: str | None = None, epochs: int = 1, full_epochs: bool = False,
            out: str | None = None, data: str | None = None, warmup_steps: int | None = None) -> list[dict[str, Any]]:
    from ..cli.train import launch
    from ..training import TrainConfig

    config = TrainConfig(methods=methods, model=model or args.model, data=data if data is not None else args.data,
                         epochs=epochs, steps_per_epoch=None if full_epochs else args.steps + args.warmup_steps,
                         warmup_steps=args.warmup_steps if warmup_steps is None else warmup_steps,
                         batch_size=args.batch_size, evaluate=model is not None, compute_only=compute_only,
                         barrier_each_step=barrier,
                         out=out, progress=False, synthetic_size=max(256, args.batch_size * workers * 16))
    config.validate()
    cluster = None if bandwidth is None else (bandwidth, args.latency)
    return launch(config, workers, timeout=args.timeout, cluster=cluster)


def run(args: argparse.Namespace) -> int:
    methods = args.methods or list(DEFAULT_METHODS)
    if "allreduce" not in methods:
        methods = ["allreduce", *methods]  # every ratio is to AllReduce of the same run
    bandwidths: list[str | None] = [None] if args.local else [b.strip() for b in args.bandwidths.split(",")]
    worker_counts = [int(w) for w in args.workers.split(",")]
    if not args.local and not args.accuracy_only and not args.report_only:
        from ..cluster import cluster_available

        available, why = cluster_available()
        if not available:
            raise SystemExit(f"gradwire bench e2e: {why} (or pass --local)")
    os.makedirs(args.out, exist_ok=True)
    rows: list[dict[str, Any]] = []
    if args.report_only:
        with open(os.path.join(args.out, "results.json")) as handle:
            saved = json.load(handle)
        _write(saved["rows"], saved["accuracy"], args.out)
        print(f"rewrote {args.out}/report.md and plots from results.json")
        return 0
    if args.accuracy_only:
        args.accuracy, worker_counts = True, []
        results_path = os.path.join(args.out, "results.json")
        if os.path.exists(results_path):  # keep an earlier sweep's rows in the report
            with open(results_path) as handle:
                rows = json.load(handle)["rows"]
    for workers in worker_counts:
        for bandwidth in bandwidths:
            label = bandwidth or "loopback"
            print(f"== {workers} workers, {label}: compute-only floor", flush=True)
            floor = _launch(["allreduce"], args, workers, bandwidth, compute_only=True)[0]
            synced_floor = _launch(["allreduce"], args, workers, bandwidth, compute_only=True, barrier=True)[0]
            print(f"== {workers} workers, {label}: {len(methods)} methods", flush=True)
            for summary in _launch(methods, args, workers, bandwidth):
                rows.append({"workers": workers, "bandwidth": label, "floor_seconds": floor["seconds_per_step"],
                             "synced_floor_seconds": synced_floor["seconds_per_step"], **summary})
            _normalize(rows)
            _write(rows, [], args.out)
            print_table([r for r in rows if r["workers"] == workers and r["bandwidth"] == label])
    accuracy: list[dict[str, Any]] = []
    if args.accuracy:
        for spec in filter(None, (s.strip() for s in args.accuracy_methods.split(";"))):
            print(f"== accuracy run: {spec}", flush=True)
            run_out = os.path.join(args.out, "accuracy", file_slug(spec))
            summary = _launch([spec], args, 2, None, model="cnn", data="mnist5k", epochs=args.accuracy_epochs,
                              full_epochs=True, out=run_out, warmup_steps=0)[0]
            summary["metrics_path"] = os.path.join(run_out, f"metrics-{file_slug(spec)}.jsonl")
            accuracy.append(summary)
    _write(rows, accuracy, args.out)
    print(f"\nwrote {args.out}/report.md, results.json and plots")
    return 0


def _normalize(rows: list[dict[str, Any]]) -> None:
    for row in rows:
        baseline = next(r for r in rows if r["workers"] == row["workers"] and r["bandwidth"] == row["bandwidth"]
                        and r["method"] == "allreduce")
        row["ratio_to_allreduce"] = row["seconds_per_step"] / baseline["seconds_per_step"]
        row["speedup_vs_allreduce"] = baseline["seconds_per_step"] / row["seconds_per_step"]
        row["communication_overhead"] = row["seconds_per_step"] / row["floor_seconds"] - 1.0
        if "synced_floor_seconds" in row:
            row["overhead_vs_synced_floor"] = row["seconds_per_step"] / row["synced_floor_seconds"] - 1.0


def print_table(rows: list[dict[str, Any]]) -> None:
    print(format_table(
        ["workers", "link", "method", "s/step", "x allreduce", "overhead", "MB/step", "params", "status"],
        [[r["workers"], r["bandwidth"], r["method"], f"{r['seconds_per_step']:.3f}", f"{r['ratio_to_allreduce']:.2f}",
          f"{100 * r['communication_overhead']:.0f}%", _megabytes(r["bytes_per_step"]), f"{r['parameters']:,}",
          r.get("status", "ok")] for r in rows]))
    if rows:
        synced = rows[0].get("synced_floor_seconds")
        print(f"compute-only floor: {rows[0]['floor_seconds']:.3f} s/step"
              + (f"; with a barrier per step: {synced:.3f} s/step" if synced else ""))


def _megabytes(value: float) -> str:
    return "n/a" if value != value else f"{value / 1e6:.3f}"


def _wrap_label(method: str) -> str:
    return method.replace(":", ":\n").replace(",", ",\n").replace("+", "+\n")


def _phase(row: dict[str, Any], phase: str) -> float:
    """Median seconds of ``phase``; backward without the hook's compress and decompress."""
    def value(key: str) -> float:
        number = row["phases"].get(key, 0.0) or 0.0
        return 0.0 if number != number else number

    if phase == "seconds_backward":
        return max(0.0, value(phase) - value("seconds_compress") - value("seconds_decompress"))
    return value(phase)


def _write(rows: list[dict[str, Any]], accuracy: list[dict[str, Any]], out: str) -> None:
    with open(os.path.join(out, "results.json"), "w") as handle:
        json.dump({"rows": rows, "accuracy": accuracy}, handle, indent=1, default=str)
    plots = _plots(rows, accuracy, out)
    lines = ["# gradwire bench e2e", "", "Ratios are to AllReduce in the same run; overhead is step time over the",
             "compute-only floor (forward+backward under no_sync) minus one.", ""]
    for (workers, link) in dict.fromkeys((r["workers"], r["bandwidth"]) for r in rows):
        group = [r for r in rows if r["workers"] == workers and r["bandwidth"] == link]
        synced = group[0].get("synced_floor_seconds")
        floors = f"floor {group[0]['floor_seconds']:.3f} s/step" + (f", with a barrier per step {synced:.3f}" if synced else "")
        lines += [f"## {workers} workers, {link} ({floors})", "",
                  "| method | s/step | x allreduce | overhead | MB/step | params | status |", "|---|---|---|---|---|---|---|"]
        lines += [f"| {r['method']} | {r['seconds_per_step']:.3f} | {r['ratio_to_allreduce']:.2f} | "
                  f"{100 * r['communication_overhead']:.0f}% | {_megabytes(r['bytes_per_step'])} | {r['parameters']:,} | "
                  f"{r.get('status', 'ok')} |" for r in group]
        lines.append("")
    if accuracy:
        lines += ["## Accuracy (cnn, MNIST-5k, 2 workers)", "", "| method | test accuracy | wall s | status |",
                  "|---|---|---|---|"]
        lines += [f"| {a['method']} | {a['test_accuracy']:.4f} | {a['wall_seconds']:.1f} | {a.get('status', 'ok')} |"
                  for a in accuracy]
        lines.append("")
    lines += [f"![{name}]({name})" for name in plots]
    with open(os.path.join(out, "report.md"), "w") as handle:
        handle.write("\n".join(lines) + "\n")


def _plots(rows: list[dict[str, Any]], accuracy: list[dict[str, Any]], out: str) -> list[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    names: list[str] = []
    for (workers, link) in dict.fromkeys((r["workers"], r["bandwidth"]) for r in rows):
        group = [r for r in rows if r["workers"] == workers and r["bandwidth"] == link]
        labels = [_wrap_label(r["method"]) for r in group]
        figure, axis = plt.subplots(figsize=(max(7, 1.5 * len(group)), 5.5))
        bottom = [0.0] * len(group)
        for phase, color in zip(PHASES, ("#4c72b0", "#dd8452", "#c44e52", "#8172b3", "#55a868")):
            heights = [_phase(r, phase) for r in group]
            axis.bar(labels, heights, bottom=bottom, label=phase.replace("seconds_", ""), color=color)
            bottom = [b + h for b, h in zip(bottom, heights)]
        axis.axhline(group[0]["floor_seconds"], color="black", linestyle="--", label="compute-only floor")
        axis.set_ylabel("seconds per step (median)")
        axis.set_title(f"Time per step by phase — {workers} workers, {link}\n(backward includes waiting for the exchange)")
        axis.legend(fontsize=8)
        axis.tick_params(axis="x", labelsize=7)
        figure.tight_layout()
        name = f"phases-{workers}w-{link}.png"
        figure.savefig(os.path.join(out, name), dpi=110)
        plt.close(figure)
        names.append(name)
    if rows:
        methods = list(dict.fromkeys(r["method"] for r in rows))
        settings = list(dict.fromkeys((r["workers"], r["bandwidth"]) for r in rows))  # run order
        for metric, ylabel, fname in (("speedup_vs_allreduce", "speedup vs AllReduce (same run)", "speedup.png"),
                                      ("bytes_per_step", "bytes sent per worker per step", "bytes.png")):
            figure, axis = plt.subplots(figsize=(max(6, 1.2 * len(methods)), 4.5))
            width = 0.8 / max(1, len(settings))
            for index, (workers, link) in enumerate(settings):
                values = []
                for method in methods:
                    match = [r for r in rows if r["method"] == method and r["workers"] == workers and r["bandwidth"] == link]
                    value = match[0][metric] if match else math.nan
                    values.append(0.0 if value != value else value)
                axis.bar([i + index * width for i in range(len(methods))], values, width, label=f"{workers}w {link}")
            axis.set_xticks([i + width * (len(settings) - 1) / 2 for i in range(len(methods))])
            axis.set_xticklabels([_wrap_label(m) for m in methods], fontsize=7)
            axis.set_ylabel(ylabel)
            if metric == "bytes_per_step":
                axis.set_yscale("log")
            else:
                axis.axhline(1.0, color="black", linewidth=0.8)
            axis.legend(fontsize=8)
            figure.tight_layout()
            figure.savefig(os.path.join(out, fname), dpi=110)
            plt.close(figure)
            names.append(fname)
    if accuracy:
        figure, axis = plt.subplots(figsize=(6.5, 4.5))
        for summary in accuracy:
            path = summary.get("metrics_path")
            if not path or not os.path.exists(path):
                continue
            records = [json.loads(line) for line in open(path)]
            elapsed, total = [], 0.0
            for record in records:
                total += record["seconds_step"]
                elapsed.append(total)
            losses = [r["loss"] for r in records]
            window = 20  # steps: the raw per-batch loss is too jumpy to compare methods by eye
            smoothed = [sum(losses[max(0, i - window + 1): i + 1]) / (i + 1 - max(0, i - window + 1))
                        for i in range(len(losses))]
            axis.plot(elapsed, smoothed, label=f"{summary['method']} (test acc {summary['test_accuracy']:.3f})")
        axis.set_xlabel("training seconds (sum of step times)")
        axis.set_ylabel("training loss (mean of the last 20 steps)")
        axis.set_title("MNIST-5k, 2 workers: loss against training time")
        axis.set_yscale("log")
        axis.legend(fontsize=7)
        figure.tight_layout()
        figure.savefig(os.path.join(out, "accuracy.png"), dpi=110)
        plt.close(figure)
        names.append("accuracy.png")
    return names
