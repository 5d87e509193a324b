"""``gradwire bench scaling``: exchange strategies vs worker count, measured and projected.

**Measured** (needs root: the emulated cluster of :mod:`gradwire.cluster`). For each layout —
flat ``p`` workers (``8``) or ``N`` nodes of ``L`` workers (``2x4``) — and each bandwidth, one
launch trains a communication-bound workload (the wide MLP, 4.7M parameters, small batch, one
thread per worker, synthetic data) with every strategy: dense AllReduce, top-k through the payload
AllGather, through the sparse AllReduce, ``auto``, and on node layouts the hierarchical exchange.
Within the launch the methods run ``--rounds`` times, the order reversed every other round, so a
slow spell of a shared machine does not always hit the same method. Per strategy:

* wire bytes per worker per step: the kernel's counters of every worker's interface between two
  barriers around the measured steps (exact; TCP/IP headers included), mean and max over
  workers; with nodes also the bytes that crossed each node's shaped link, per worker;
* step time: the median of the per-round medians of the measured steps;
* hook CPU time: sparsify + encode + decode seconds per step (median), and the strategy ``auto``
  took (buckets per strategy).

**Projected**: :mod:`.projection` takes the constants measured at the largest flat p (wire bytes
per AllGather'ed entry, decode seconds per entry; α is modelled) to p = 16 … 1024 at 10 / 25 / 100
Gbit/s for ResNet-50 and a 1B-parameter model, and checks ``auto``'s choice against the winner.
``--projection-only`` runs just that (no cluster; defaults or ``--from`` a saved results.json).

Writes ``results.json`` and, with matplotlib, ``bytes_vs_p.png`` and ``projection.png`` to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from typing import Any, Optional

from ..tables import format_table
from ..harness.training import median
from .projection import (
    PROJECTED_LINKS_GBIT,
    PROJECTED_MODELS,
    STRATEGY_NAMES,
    SPARSE_VOLUME_TARGET_K,
    Constants,
    decode_seconds_per_entry,
    project,
)

DEFAULT_LAYOUTS = "2,4,8,2x2,2x4"
DEFAULT_BANDWIDTHS = "100mbit,1gbit"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``gradwire bench scaling``'s options to ``parser`` (:mod:`gradwire.cli.main` calls it)."""
    parser.add_argument("--layouts", default=DEFAULT_LAYOUTS,
                        help="comma-separated: P (flat, P workers) or NxL (N nodes of L workers) "
                             f"(default {DEFAULT_LAYOUTS})")
    parser.add_argument("--bandwidths", default=DEFAULT_BANDWIDTHS,
                        help=f"comma-separated tc rates (default {DEFAULT_BANDWIDTHS})")
    parser.add_argument("--strategies", default=None,
                        help="comma-separated subset of dense, allgather, sparse-allreduce, auto, hierarchical "
                             "(default all; hierarchical only on node layouts)")
    parser.add_argument("--compressor", default="topk", help="sparsifier of the sparse strategies (default topk)")
    parser.add_argument("--density", type=float, default=0.01)
    parser.add_argument("--values", default="fp16", help="value codec (default fp16)")
    parser.add_argument("--indices", default="rice", help="index codec (default rice)")
    parser.add_argument("--model", default="mlp", help="workload (default mlp: wide MLP, 4.7M parameters)")
    parser.add_argument("--batch-size", type=int, default=8, help="per worker (default 8)")
    parser.add_argument("--steps", type=int, default=4, help="measured steps per method and round (default 4)")
    parser.add_argument("--warmup-steps", type=int, default=2, help="steps left out before them (default 2)")
    parser.add_argument("--rounds", type=int, default=2, help="method order reversed every other round (default 2)")
    parser.add_argument("--latency", default="0", help="added one-way latency (default 0: α is modelled, not emulated)")
    parser.add_argument("--alpha", type=float, default=20e-6,
                        help="seconds per round for the projection (default 20e-6)")
    parser.add_argument("--gamma", type=float, default=None,
                        help="decode seconds per entry for the projection (default: timed here, one thread)")
    parser.add_argument("--local-size", type=int, default=8, help="workers per node in the projection (default 8)")
    parser.add_argument("--projection-only", action="store_true", help="skip the cluster runs; project only")
    parser.add_argument("--from", dest="from_json", default=None, metavar="PATH",
                        help="take measured rows from a saved results.json (with --projection-only: its constants)")
    parser.add_argument("--no-plot", action="store_true", help="write no PNG files")
    parser.add_argument("--out", default="bench-out/scaling", metavar="DIR")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per launch")


def parse_layout(text: str) -> tuple[int, int]:
    """``"8"`` -> (8 workers, 1 per node); ``"2x4"`` -> (8 workers, 4 per node)."""
    text = text.strip().lower()
    try:
        if "x" in text:
            nodes, per_node = (int(part) for part in text.split("x"))
        else:
            nodes, per_node = int(text), 1
    except ValueError:
        raise ValueError(f"--layouts: {text!r} is not a layout; "
                         "allowed: P or NxL with integers (e.g. 8, 2x4)") from None
    if nodes < 1 or per_node < 1 or nodes * per_node < 2:
        raise ValueError(f"--layouts: {text!r} needs at least 2 workers")
    return nodes * per_node, per_node


def strategy_specs(args: argparse.Namespace, per_node: int) -> dict[str, str]:
    """Strategy label -> method spec for ``gradwire train``."""
    base = f"{args.compressor}:density={args.density:g},values={args.values},indices={args.indices}"
    specs = {"dense": "allreduce", "allgather": f"{base},collective=allgather",
             "sparse-allreduce": f"{base},collective=sparse-allreduce",
             "auto": f"{base},collective=auto" + (f",hierarchy={per_node}" if per_node > 1 else "")}
    if per_node > 1:
        specs["hierarchical"] = f"{base},collective=sparse-allreduce,hierarchy={per_node}"
    if args.strategies:
        wanted = [name.strip() for name in args.strategies.split(",") if name.strip()]
        allowed = ("dense", "allgather", "sparse-allreduce", "auto", "hierarchical")
        for name in wanted:
            if name not in allowed:
                raise ValueError(f"--strategies: {name!r} is not a strategy; allowed: {', '.join(allowed)}")
        specs = {name: spec for name, spec in specs.items() if name in wanted}
    return specs


def _method_order(labels: list[str], rounds: int) -> list[str]:
    order: list[str] = []
    for round_index in range(rounds):
        order += labels if round_index % 2 == 0 else labels[::-1]
    return order


def measure_layout(args: argparse.Namespace, workers: int, per_node: int, bandwidth: str) -> list[dict[str, Any]]:
    """One launch on a temporary cluster; one row per strategy."""
    from ..cli.launch import launch
    from ..cluster import ClusterSpec, temporary_prefix
    from ..harness.training import TrainConfig

    specs = strategy_specs(args, per_node)
    order = _method_order(list(specs), args.rounds)
    config = TrainConfig(methods=[specs[label] for label in order], model=args.model, epochs=1,
                         steps_per_epoch=args.steps + args.warmup_steps, warmup_steps=args.warmup_steps,
                         batch_size=args.batch_size, evaluate=False, progress=False, threads=1,
                         synthetic_size=max(256, args.batch_size * workers * (args.steps + args.warmup_steps + 1)))
    config.validate()
    spec = ClusterSpec(workers=workers, bandwidth=bandwidth, latency=args.latency, workers_per_node=per_node,
                       prefix=temporary_prefix())
    started = time.time()
    summaries = launch(config, workers, timeout=args.timeout, cluster=spec)
    load = os.getloadavg()[0]
    rows = []
    for label, method in specs.items():
        runs = [s for s in summaries if s["method"] == method]
        rows.append(_row(label, method, runs, workers, per_node, bandwidth, load, started))
    return rows


def _row(label: str, method: str, runs: list[dict[str, Any]], workers: int, per_node: int, bandwidth: str,
         load: float, started: float) -> dict[str, Any]:
    wires = [run["wire"] for run in runs if run.get("wire")]
    steps = sum(wire["steps"] for wire in wires)
    per_rank = [sum(wire["tx_bytes"][rank] for wire in wires) / steps for rank in range(workers)] if steps else []
    cross = []
    if steps and per_node > 1 and all(len(wire["node_tx_bytes"]) == workers // per_node for wire in wires):
        cross = [sum(wire["node_tx_bytes"][node] for wire in wires) / steps / per_node
                 for node in range(workers // per_node)]
    phases = [run["phases"] for run in runs]
    cpu = [sum(p.get(f"seconds_{key}", math.nan) for key in ("compress", "decompress")) for p in phases]
    buckets: dict[str, float] = {}
    for run in runs:
        for name, count in run.get("strategy_buckets", {}).items():
            buckets[name] = buckets.get(name, 0.0) + count
    return {
        "strategy": label, "method": method, "workers": workers, "workers_per_node": per_node,
        "layout": f"{workers // per_node}x{per_node}" if per_node > 1 else str(workers), "bandwidth": bandwidth,
        "parameters": runs[0]["parameters"] if runs else None, "rounds": len(runs), "measured_steps": steps,
        "wire_bytes_per_step": sum(per_rank) / len(per_rank) if per_rank else math.nan,
        "wire_bytes_per_step_max": max(per_rank) if per_rank else math.nan,
        "cross_node_bytes_per_worker_step": sum(cross) / len(cross) if cross else math.nan,
        "hook_bytes_per_step": median([run["bytes_per_step"] for run in runs]),
        "seconds_per_step": median([run["seconds_per_step"] for run in runs]),
        "seconds_per_step_rounds": [run["seconds_per_step"] for run in runs],
        "hook_cpu_seconds": median([c for c in cpu if c == c]) if any(c == c for c in cpu) else math.nan,
        "decode_seconds": median([p.get("seconds_decompress", math.nan) for p in phases]),
        "strategy_buckets": buckets, "load_average": load, "started": started,
    }


def constants_from_rows(rows: list[dict[str, Any]], args: argparse.Namespace) -> tuple[Constants, dict[str, Any]]:
    """The projection's constants and where they came from.

    Bytes per entry: the wire bytes per step of the AllGather at the largest flat p measured
    (slowest bandwidth) over the entries it carries, ``(p-1) k``: exact, framing and TCP/IP
    included. Decode seconds per entry: ``--gamma``, else timed here on one thread (best of 5);
    the in-run figure (the hook's decode seconds over ``(p-1) k``) is also recorded, but with p
    workers sharing two cores it is inflated by the contention, not by the decoder."""
    flat = [r for r in rows if r["strategy"] == "allgather" and r["workers_per_node"] == 1
            and r["wire_bytes_per_step"] == r["wire_bytes_per_step"] and r["parameters"]]
    gamma = args.gamma if args.gamma is not None else decode_seconds_per_entry(args.values, args.indices,
                                                                                density=args.density)
    notes: dict[str, Any] = {"gamma_source": "--gamma" if args.gamma is not None else "timed in the bench process"}
    common = dict(decode_seconds_per_entry=gamma, alpha=args.alpha, local_size=args.local_size, values=args.values,
                  indices=args.indices)
    if not flat:
        return Constants(**common, source="default bytes per entry; " + notes["gamma_source"]), notes
    best = max(flat, key=lambda r: (r["workers"], -_rate(r["bandwidth"])))
    received = (best["workers"] - 1) * args.density * best["parameters"]  # entries each worker receives
    notes["in_run_decode_seconds_per_entry"] = best["decode_seconds"] / received
    return Constants(bytes_per_entry=best["wire_bytes_per_step"] / received, **common,
                     source=f"bytes/entry measured: allgather wire, p={best['workers']}, {best['bandwidth']}; "
                            f"decode {notes['gamma_source']}; alpha modelled"), notes


def _rate(bandwidth: str) -> float:
    from ..cluster.netns import parse_rate

    return float(parse_rate("bandwidth", bandwidth))


def check_targets(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The issue's measured targets, per bandwidth: met / not met with the numbers."""
    checks = []

    def find(strategy: str, layout: str, bandwidth: str) -> Optional[dict[str, Any]]:
        return next((r for r in rows if r["strategy"] == strategy and r["layout"] == layout
                     and r["bandwidth"] == bandwidth), None)

    for bandwidth in sorted({r["bandwidth"] for r in rows}):
        sparse8, gather8 = find("sparse-allreduce", "8", bandwidth), find("allgather", "8", bandwidth)
        sparse4, gather4 = find("sparse-allreduce", "4", bandwidth), find("allgather", "4", bandwidth)
        if sparse8 and gather8:
            ratio = sparse8["wire_bytes_per_step"] / gather8["wire_bytes_per_step"]
            checks.append({"target": f"p=8 {bandwidth}: sparse-allreduce wire bytes <= 0.35x allgather",
                           "value": ratio, "met": ratio <= 0.35})
            time_ratio = sparse8["seconds_per_step"] / gather8["seconds_per_step"]
            checks.append({"target": f"p=8 {bandwidth}: sparse-allreduce step time <= 0.5x allgather (one run)",
                           "value": time_ratio, "met": time_ratio <= 0.5})
        if sparse8 and sparse4 and gather8 and gather4:
            growth = sparse8["wire_bytes_per_step"] / sparse4["wire_bytes_per_step"]
            gather_growth = gather8["wire_bytes_per_step"] / gather4["wire_bytes_per_step"]
            checks.append({"target": f"{bandwidth}: sparse-allreduce bytes p=8 / p=4 within 0.8..1.2 while "
                                     f"allgather grows ({gather_growth:.2f}x)",
                           "value": growth, "met": 0.8 <= growth <= 1.2 and gather_growth > 1.2})
    return checks


def print_measured(rows: list[dict[str, Any]]) -> None:
    """Print the measured table: wire and hook bytes, step time and hook CPU per layout, link and strategy."""
    headers = ["layout", "bandwidth", "strategy", "wire KB/step/worker ↓", "max", "cross-node KB/worker ↓",
               "hook KB ↓", "s/step ↓", "hook CPU s ↓", "auto took", "load"]
    table = []
    for r in rows:
        took = ", ".join(f"{name}:{count:g}" for name, count in sorted(r["strategy_buckets"].items())) \
            if r["strategy"] == "auto" else ""
        table.append([r["layout"], r["bandwidth"], r["strategy"], _fmt(r["wire_bytes_per_step"] / 1e3, ".1f"),
                      _fmt(r["wire_bytes_per_step_max"] / 1e3, ".1f"),
                      _fmt(r["cross_node_bytes_per_worker_step"] / 1e3, ".1f"),
                      _fmt(r["hook_bytes_per_step"] / 1e3, ".1f"),
                      _fmt(r["seconds_per_step"], ".3f"), _fmt(r["hook_cpu_seconds"], ".3f"), took,
                      _fmt(r["load_average"], ".1f")])
    print(format_table(headers, table))


def print_projection(result: dict[str, Any]) -> None:
    """Print the α–β–γ projection: its constants, then milliseconds per strategy and world size."""
    c = result["constants"]
    print(f"\nα–β–γ projection, density {result['density']:g}: {c['bytes_per_entry']:.3f} wire bytes/entry, "
          f"{c['decode_seconds_per_entry'] * 1e9:.1f} ns decode/entry, α {c['alpha'] * 1e6:g} µs/round "
          f"(modelled), nodes of {c['local_size']} on a {c['intra_gbit']:g} Gbit/s in-node link [{c['source']}]")
    for layout in sorted({p["local_size"] for p in result["points"]}):
        names = [n for n in STRATEGY_NAMES if layout > 1 or n != "hierarchical"]
        title = "flat" if layout == 1 else f"{layout} workers per node"
        print(f"\nms of the exchange per step (whole model as one bucket) ({title}); "
              "* = predicted winner, auto = the hook's choice")
        table = []
        for point in (p for p in result["points"] if p["local_size"] == layout):
            cells = [_fmt(point["seconds"].get(n, math.nan) * 1e3, ".1f") + ("*" if point["winner"] == n else "")
                     for n in names]
            table.append([point["model"], f"{point['gbit']:g}", point["world_size"], *cells, point["auto"],
                          "yes" if point["auto_ok"] else "NO", f"{point['sparse_allreduce_volume_k']:.2f}"])
        print(format_table(["model", "Gbit/s", "p", *names, "auto", "auto = winner", "sparse-AR volume (x k)"], table))
    print("\nsmallest p at which allgather top-k is slower than dense AllReduce (bytes: per-worker bytes only)")
    crossings = result["allgather_loses_at"]
    keys = list(next(iter(crossings.values())))
    print(format_table(["model", *keys], [[m, *(str(v) if v else "never" for v in row.values())]
                                          for m, row in crossings.items()]))
    worst = max(result["max_sparse_allreduce_volume_k"], result.get("max_sparse_allreduce_volume_k_unhinted", 0.0))
    print(f"\nsparse-allreduce volume <= {SPARSE_VOLUME_TARGET_K:g}k entries for every projected p: "
          f"{'met' if worst <= SPARSE_VOLUME_TARGET_K else 'NOT met'} "
          f"(max {result['max_sparse_allreduce_volume_k']:.2f} k with the hook's hint, "
          f"{result.get('max_sparse_allreduce_volume_k_unhinted', math.nan):.2f} k without); "
          f"auto picks the winner everywhere: {'yes' if result['auto_picks_winner'] else 'NO'}")


def _fmt(value: Any, spec: str) -> str:
    return "–" if value is None or value != value else format(value, spec)


def plot(rows: list[dict[str, Any]], result: dict[str, Any], out: str) -> list[str]:
    """bytes_vs_p.png (measured, flat layouts) and projection.png; [] without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    written = []
    bandwidths = sorted({r["bandwidth"] for r in rows}, key=_rate)
    if rows:
        figure, axes = plt.subplots(1, len(bandwidths), figsize=(5 * len(bandwidths), 4), squeeze=False)
        for axis, bandwidth in zip(axes[0], bandwidths):
            for strategy in ("dense", "allgather", "sparse-allreduce", "auto"):
                points = sorted((r["workers"], r["wire_bytes_per_step"] / 1e3) for r in rows
                                if r["strategy"] == strategy and r["bandwidth"] == bandwidth
                                and r["workers_per_node"] == 1)
                if points:
                    axis.plot(*zip(*points), marker="o", label=strategy)
            axis.set(xlabel="workers p (flat)", ylabel="wire KB per worker per step", yscale="log",
                     title=f"measured, {bandwidth}")
            if axis.get_legend_handles_labels()[0]:
                axis.legend()
        figure.tight_layout()
        path = os.path.join(out, "bytes_vs_p.png")
        figure.savefig(path, dpi=110)
        plt.close(figure)
        written.append(path)
    models = list(dict.fromkeys(p["model"] for p in result["points"]))
    links = sorted({p["gbit"] for p in result["points"]})
    figure, axes = plt.subplots(len(models), len(links), figsize=(4.5 * len(links), 3.8 * len(models)), squeeze=False)
    local = max(p["local_size"] for p in result["points"])
    for i, model in enumerate(models):
        for j, gbit in enumerate(links):
            axis = axes[i][j]
            here = [p for p in result["points"] if p["model"] == model and p["gbit"] == gbit]
            flat = [p for p in here if p["local_size"] == 1]
            nodes = [p for p in here if p["local_size"] == local]
            for name in STRATEGY_NAMES:
                source = nodes if name == "hierarchical" else flat
                points = [(p["world_size"], p["seconds"][name] * 1e3) for p in source if name in p["seconds"]]
                if points:
                    label = name if name != "hierarchical" else f"hierarchical ({local}/node)"
                    axis.plot(*zip(*points), marker="o", label=label)
            for p in flat:  # auto's choice on the flat layout, ringed
                axis.scatter([p["world_size"]], [p["seconds"][p["auto"]] * 1e3], s=140, facecolors="none",
                             edgecolors="black", zorder=5)
            axis.set(xscale="log", yscale="log", xlabel="workers p", ylabel="ms per step (model)",
                     title=f"{model}, {gbit:g} Gbit/s")
            if i == 0 and j == 0:
                axis.legend(fontsize=7)
    figure.suptitle("α–β–γ projection (ringed: auto's choice, flat layout)")
    figure.tight_layout()
    path = os.path.join(out, "projection.png")
    figure.savefig(path, dpi=110)
    plt.close(figure)
    written.append(path)
    return written


def run(args: argparse.Namespace) -> int:
    """Run ``gradwire bench scaling`` (module docstring); returns 0, or 2 on a bad option or without a
    cluster (unless ``--projection-only``).
    """
    try:
        layouts = [parse_layout(text) for text in args.layouts.split(",") if text.strip()]
        bandwidths = [b.strip() for b in args.bandwidths.split(",") if b.strip()]
        for bandwidth in bandwidths:
            _rate(bandwidth)
        for layout in layouts:
            strategy_specs(args, layout[1])
        for name in ("steps", "rounds", "batch_size", "local_size"):
            if getattr(args, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')}={getattr(args, name)} must be >= 1")
        if not 0 < args.density <= 1:
            raise ValueError(f"--density={args.density} must be in (0, 1]")
    except ValueError as error:
        print(f"gradwire bench scaling: {error}", file=sys.stderr)
        return 2
    os.makedirs(args.out, exist_ok=True)
    rows: list[dict[str, Any]] = []
    if args.from_json:
        with open(args.from_json) as handle:
            rows = json.load(handle)["rows"]
    if not args.projection_only:
        from ..cluster import cluster_available

        available, why = cluster_available()
        if not available:
            print(f"gradwire bench scaling: {why} (or pass --projection-only)", file=sys.stderr)
            return 2
        for workers, per_node in layouts:
            for bandwidth in bandwidths:
                print(f"gradwire bench scaling: {workers} workers ({per_node} per node), {bandwidth} ...",
                      file=sys.stderr, flush=True)
                rows = [r for r in rows if not (r["workers"] == workers and r["workers_per_node"] == per_node
                                                and r["bandwidth"] == bandwidth)]
                rows += measure_layout(args, workers, per_node, bandwidth)
                _save(args.out, rows, None, [])  # keep what is measured if a later layout fails
    order = {name: i for i, name in enumerate(("dense", "allgather", "sparse-allreduce", "hierarchical", "auto"))}
    rows.sort(key=lambda r: (_rate(r["bandwidth"]), r["workers_per_node"] > 1, r["workers"],
                             order.get(r["strategy"], 9)))
    checks = check_targets(rows)
    if rows:
        print_measured(rows)
        for check in checks:
            print(f"{'met    ' if check['met'] else 'NOT met'}  {check['target']}: {check['value']:.3f}")
    constants, notes = constants_from_rows(rows, args)
    result = project(constants, density=args.density)
    result["notes"] = notes
    print_projection(result)
    plots = [] if args.no_plot else plot(rows, result, args.out)
    _save(args.out, rows, result, checks)
    print(f"\nwrote {os.path.join(args.out, 'results.json')}" + (f" and {', '.join(plots)}" if plots else ""))
    return 0


def _save(out: str, rows: list[dict[str, Any]], projection: Optional[dict[str, Any]],
          checks: list[dict[str, Any]]) -> None:
    path = os.path.join(out, "results.json")
    with open(f"{path}.partial", "w") as handle:
        json.dump({"rows": rows, "targets": checks, "projection": projection,
                   "projected_models": PROJECTED_MODELS, "projected_links_gbit": PROJECTED_LINKS_GBIT}, handle,
                  indent=1, default=str)
    os.replace(f"{path}.partial", path)
