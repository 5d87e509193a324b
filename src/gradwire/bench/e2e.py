"""``gradwire bench e2e``: methods x bandwidths x worker counts, on real rate-limited links.

For each worker count and bandwidth it brings up an emulated cluster (one network namespace per
worker, tc-limited links; ``--local`` uses loopback instead), runs every method for a fixed
number of steps after a few warm-up steps, and also measures the compute-only floor
(forward+backward under ``no_sync``, no communication). Times are reported as ratios to
AllReduce measured in the same run, and as communication overhead ``step / compute_only - 1``.
Four workers on two cores swing by 10-25% between launches, so ``--rounds N`` repeats the
floors and the methods N times (the method order reversed every other round, so that a slow
spell does not always hit the same methods) and reports medians over the rounds.
Accuracy runs repeat over ``--accuracy-seeds`` and report mean and spread.

Writes ``results.json``, ``report.md`` and PNG plots into ``--out``: per-iteration time stacked
by phase, speedup vs AllReduce, bytes per step, and (with ``--accuracy``) test accuracy vs wall
time of MNIST-5k runs. Every method run's per-step records (rank 0's step times, phases, bytes and,
under ``collective=auto``, the policy each step ran) stay in
``--out/steps/<workers>w-<link>-round<N>/metrics-<method>.jsonl``; a row's ``metrics_path_by_round``
names them. A median over a run's steps hides when in the run a method was slow; these show it.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from typing import Any

from ..harness.data import DEFAULT_TEST_FRACTION
from ..harness.training import file_slug, median
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
    """Add ``gradwire bench e2e``'s options to ``parser`` (:mod:`gradwire.cli.main` calls it)."""
    parser.add_argument("--model", default="resnet18")
    parser.add_argument("--data", default=None)
    parser.add_argument("--method", action="append", dest="methods", metavar="SPEC",
                        help="repeatable (default: a set of 8)")
    parser.add_argument("--bandwidths", default="100mbit,1gbit,10gbit", help="comma-separated tc rates")
    parser.add_argument("--latency", default="0.5ms")
    parser.add_argument("--workers", default="4", help="comma-separated worker counts")
    parser.add_argument("--steps", type=int, default=5, help="measured steps per method")
    parser.add_argument("--warmup-steps", type=int, default=2, help="steps run first and left out")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--optimizer", default="sgd", help="sgd (momentum 0.9) or adamw (default sgd)")
    parser.add_argument("--lr", type=float, default=None, help="default: sgd 0.05, adamw 2e-3")
    parser.add_argument("--rounds", type=int, default=1,
                        help="repeat floors and methods this many times; report medians over rounds")
    parser.add_argument("--local", action="store_true",
                        help="loopback instead of namespaces (no root needed; no rate limit)")
    parser.add_argument("--accuracy", action="store_true",
                        help="also run MNIST-5k accuracy runs (cnn, 2 workers, --accuracy-epochs epochs) per method")
    parser.add_argument("--accuracy-epochs", type=int, default=5)
    parser.add_argument("--accuracy-seeds", default="0,1,2",
                        help="comma-separated seeds; each accuracy method runs once per seed")
    parser.add_argument("--accuracy-methods", default="allreduce;topk:density=0.01,values=fp16,indices=rice;"
                        "pufferfish:rank_ratio=0.25,warmup_epochs=1", help="';'-separated specs")
    parser.add_argument("--report-only", action="store_true", help="rebuild report.md and plots from results.json")
    parser.add_argument("--accuracy-only", action="store_true", help="skip the timing sweep; only the accuracy runs")
    parser.add_argument("--out", default="bench-out/e2e", metavar="DIR")
    parser.add_argument("--timeout", type=float, default=3000, help="seconds per launch")


def _launch(methods: list[str], args: argparse.Namespace, workers: int, bandwidth: str | None, *,
            compute_only: bool = False, barrier: bool = False, model: str | None = None, epochs: int = 1,
            full_epochs: bool = False, out: str | None = None, data: str | None = None,
            warmup_steps: int | None = None, seed: int = 0) -> list[dict[str, Any]]:
    from ..cli.train import launch
    from ..harness.training import TrainConfig

    config = TrainConfig(methods=methods, model=model or args.model, data=data if data is not None else args.data,
                         epochs=epochs, steps_per_epoch=None if full_epochs else args.steps + args.warmup_steps,
                         warmup_steps=args.warmup_steps if warmup_steps is None else warmup_steps,
                         batch_size=args.batch_size, optimizer=getattr(args, "optimizer", "sgd"),
                         lr=getattr(args, "lr", None), evaluate=model is not None, compute_only=compute_only,
                         barrier_each_step=barrier, seed=seed,
                         out=out, progress=False,
                         synthetic_size=_synthetic_size(args.batch_size, workers, args.steps + args.warmup_steps))
    config.validate()
    cluster = None if bandwidth is None else (bandwidth, args.latency)
    return launch(config, workers, timeout=args.timeout, cluster=cluster)


def _synthetic_size(batch_size: int, workers: int, steps: int) -> int:
    """Synthetic examples enough for ``steps`` batches on every worker *after* the held-out split
    (:func:`gradwire.harness.data.load` keeps ``DEFAULT_TEST_FRACTION`` of the images apart). Short
    data cut runs: 16 batches per worker cut a 30-step run to 16, and sizing the images without the
    split cut ResNet-18's 30-step runs to 24, their medians then over the warm-up."""
    train_examples = batch_size * workers * max(16, steps)
    return max(256, math.ceil(train_examples / (1.0 - DEFAULT_TEST_FRACTION)) + batch_size * workers)


def run(args: argparse.Namespace) -> int:
    """Run ``gradwire bench e2e`` (module docstring); returns 0, or 2 on a bad option.

    Raises:
        SystemExit: no emulated cluster can be built here and ``--local`` was not given.
    """
    methods = args.methods or list(DEFAULT_METHODS)
    if "allreduce" not in methods:
        methods = ["allreduce", *methods]  # every ratio is to AllReduce of the same run
    bandwidths: list[str | None] = [None] if args.local else [b.strip() for b in args.bandwidths.split(",")]
    try:  # a bad option is the user's to fix: one line, not a traceback (as every bench command)
        worker_counts = [int(w) for w in args.workers.split(",")]
        if args.rounds < 1:
            raise ValueError(f"--rounds={args.rounds} must be >= 1")
        seeds = [int(seed) for seed in args.accuracy_seeds.split(",") if seed.strip()]
        if not seeds:
            raise ValueError("--accuracy-seeds needs at least one seed")
    except ValueError as error:
        print(f"gradwire bench e2e: {error}", file=sys.stderr)
        return 2
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
            floors, synced_floors, runs = [], [], {method: [] for method in methods}
            for round_index in range(args.rounds):
                tag = f" (round {round_index + 1}/{args.rounds})" if args.rounds > 1 else ""
                print(f"== {workers} workers, {label}: compute-only floor{tag}", flush=True)
                floors.append(_launch(["allreduce"], args, workers, bandwidth, compute_only=True)[0])
                synced_floors.append(_launch(["allreduce"], args, workers, bandwidth, compute_only=True,
                                             barrier=True)[0])
                order = methods if round_index % 2 == 0 else methods[::-1]
                print(f"== {workers} workers, {label}: {len(methods)} methods{tag}", flush=True)
                steps_out = os.path.join(args.out, "steps", f"{workers}w-{label}-round{round_index + 1}")
                for summary in _launch(order, args, workers, bandwidth, out=steps_out):
                    summary["metrics_path"] = os.path.join(steps_out, f"metrics-{file_slug(summary['method'])}.jsonl")
                    runs[summary["method"]].append(summary)
            floor = median([f["seconds_per_step"] for f in floors])
            synced_floor = median([f["seconds_per_step"] for f in synced_floors])
            for method in methods:
                rows.append({"workers": workers, "bandwidth": label, "floor_seconds": floor,
                             "synced_floor_seconds": synced_floor, "rounds": len(runs[method]),
                             "floor_seconds_by_round": [f["seconds_per_step"] for f in floors],
                             **_over_rounds(runs[method])})
            _normalize(rows)
            _write(rows, [], args.out)
            print_table([r for r in rows if r["workers"] == workers and r["bandwidth"] == label])
    accuracy: list[dict[str, Any]] = []
    if args.accuracy:
        for spec in filter(None, (s.strip() for s in args.accuracy_methods.split(";"))):
            for seed in seeds:
                print(f"== accuracy run: {spec}, seed {seed}", flush=True)
                run_out = os.path.join(args.out, "accuracy", f"seed{seed}", file_slug(spec))
                summary = _launch([spec], args, 2, None, model="cnn", data="mnist5k", epochs=args.accuracy_epochs,
                                  full_epochs=True, out=run_out, warmup_steps=0, seed=seed)[0]
                summary["metrics_path"] = os.path.join(run_out, f"metrics-{file_slug(spec)}.jsonl")
                summary["seed"] = seed
                accuracy.append(summary)
        print(format_accuracy(accuracy))
    _write(rows, accuracy, args.out)
    print(f"\nwrote {args.out}/report.md, results.json and plots")
    return 0


def _over_rounds(summaries: list[dict[str, Any]]) -> dict[str, Any]:
    """One method's summary over rounds: medians of the per-round medians; the rest from round one."""
    merged = dict(summaries[0])
    merged["seconds_per_step_by_round"] = [s["seconds_per_step"] for s in summaries]
    merged["seconds_per_step"] = median(merged["seconds_per_step_by_round"])
    merged["metrics_path_by_round"] = [s.get("metrics_path") for s in summaries]
    merged["phases"] = {key: median([s["phases"][key] for s in summaries]) for key in summaries[0]["phases"]}
    if any(s.get("auto") for s in summaries):  # auto may end on another strategy in another round
        merged["auto_by_round"] = [s.get("auto") or {} for s in summaries]
    failed = [s["status"] for s in summaries if s.get("status", "ok") != "ok"]
    merged["status"] = failed[0] if failed else "ok"
    return merged


def accuracy_by_method(accuracy: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per method: accuracies by seed, their mean and sample standard deviation, and the mean's
    difference to AllReduce's (in points, i.e. percent of the test set)."""
    methods = list(dict.fromkeys(a["method"] for a in accuracy))
    table = []
    for method in methods:
        values = [a["test_accuracy"] for a in accuracy if a["method"] == method and a.get("status", "ok") == "ok"]
        mean = sum(values) / len(values) if values else math.nan
        spread = math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1)) if len(values) > 1 else math.nan
        table.append({"method": method, "accuracies": values, "mean": mean, "std": spread,
                      "runs": sum(1 for a in accuracy if a["method"] == method)})
    baseline = next((row["mean"] for row in table if row["method"] == "allreduce"), math.nan)
    for row in table:
        row["points_vs_allreduce"] = 100 * (row["mean"] - baseline)
    return table


def format_accuracy(accuracy: list[dict[str, Any]]) -> str:
    """The accuracy table: per method, the accuracy of every seed, mean, spread and points vs AllReduce."""
    return format_table(
        ["method", "accuracy by seed", "mean", "sd", "points vs allreduce"],
        [[row["method"], " ".join(f"{v:.4f}" for v in row["accuracies"]) + ("" if len(row["accuracies"]) == row["runs"]
          else f" ({row['runs'] - len(row['accuracies'])} failed)"), f"{row['mean']:.4f}", f"{row['std']:.4f}",
          f"{row['points_vs_allreduce']:+.2f}"] for row in accuracy_by_method(accuracy)])


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
    """Print one line per (workers, link, method): step time, ratio and overhead, bytes."""
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
        floors = f"floor {group[0]['floor_seconds']:.3f} s/step"
        if synced:
            floors += f", with a barrier per step {synced:.3f}"
        if group[0].get("rounds", 1) > 1:
            floors += f"; medians of {group[0]['rounds']} rounds"
        lines += [f"## {workers} workers, {link} ({floors})", "",
                  "| method | s/step | x allreduce | overhead | MB/step | params | status |",
                  "|---|---|---|---|---|---|---|"]
        lines += [f"| {r['method']} | {r['seconds_per_step']:.3f} | {r['ratio_to_allreduce']:.2f} | "
                  f"{100 * r['communication_overhead']:.0f}% | {_megabytes(r['bytes_per_step'])} | "
                  f"{r['parameters']:,} | {r.get('status', 'ok')} |" for r in group]
        lines.append("")
    if accuracy:
        epochs = accuracy[0].get("config", {}).get("epochs", "?")
        lines += [f"## Accuracy (cnn, MNIST-5k, 2 workers, {epochs} epochs, one run per seed)", "",
                  "| method | accuracy by seed | mean | sd | points vs allreduce |", "|---|---|---|---|---|"]
        lines += [f"| {row['method']} | {' '.join(f'{v:.4f}' for v in row['accuracies'])} | {row['mean']:.4f} | "
                  f"{row['std']:.4f} | {row['points_vs_allreduce']:+.2f} |" for row in accuracy_by_method(accuracy)]
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
        axis.set_title(f"Time per step by phase — {workers} workers, {link}\n"
                       "(backward includes waiting for the exchange)")
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
                    match = [r for r in rows
                             if r["method"] == method and r["workers"] == workers and r["bandwidth"] == link]
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
        first_seed = accuracy[0].get("seed")
        for summary in accuracy:
            if summary.get("seed") != first_seed:
                continue
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
        axis.set_title("MNIST-5k, 2 workers: loss against training time"
                       + (f" (seed {first_seed})" if first_seed is not None else ""))
        axis.set_yscale("log")
        axis.legend(fontsize=7)
        figure.tight_layout()
        figure.savefig(os.path.join(out, "accuracy.png"), dpi=110)
        plt.close(figure)
        names.append("accuracy.png")
    return names
