"""The tables of docs/local-steps.md, from the runs' JSON files (every number there comes from here).

    python scripts/local_steps_report.py [--runs docs/lm/local-steps] [--timing docs/lm/local-steps/timing.json]
        [--plot docs/lm/local-steps/frontier.png]

``--runs``: ``gradwire simulate --json`` records named ``NAME-sSEED.json`` (scripts/local_steps_runs.sh
writes them); a run named ``ddp`` is the DDP reference, ``dense-hH`` the dense DiLoCo reference of
period H. ``--timing``: ``gradwire bench e2e`` results (``results.json``) of the emulated cluster,
whose methods the TIMED table below maps to simulated runs. Prints markdown tables. ``--plot``: the
loss–bytes frontier (held-out loss and its distance from dense outer steps of the same period, against
bytes per local step) as a PNG; needs matplotlib (the ``plot`` extra).
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import re
from typing import Any, Optional

_TOPK = "values=qsgd-ans,indices=rice,collective=allgather"
#: simulated run -> (method timed on the cluster for its local steps, for its warm-up steps)
TIMED = {
    "ddp": ("allreduce", None),
    "topk1-step": ("topk:density=0.01,values=qsgd-ans,indices=rice", None),
    # per-step top-k 1% with qsgd-ans values did not learn (docs/lm/local-steps/failed/); fp16 values
    # do, and are timed by the qsgd-ans run: its payload is smaller, so that time favours top-k
    "topk1-step-fp16": ("topk:density=0.01,values=qsgd-ans,indices=rice", None),
    "dense-h16": ("diloco:sync_every=16", "allreduce"),
    "int8-h16": ("diloco:sync_every=16+quantize:bits=8", "allreduce"),
    "int4-h16": ("diloco:sync_every=16+quantize:bits=4", "allreduce"),
    "int4-h16-warm8": ("diloco:sync_every=16+quantize:bits=4", "quantize:bits=8"),
    "int4-h16-warm8e100": ("diloco:sync_every=16+quantize:bits=4", "quantize:bits=8"),
    "int4-h16-warm8e25": ("diloco:sync_every=16+quantize:bits=4", "quantize:bits=8"),
    "int4-h16-warm8-overlap1": ("diloco:sync_every=16,overlap=1+quantize:bits=4", "quantize:bits=8"),
    "int4-h32-b1024": ("diloco:sync_every=32+quantize:bits=4,block=1024", "allreduce"),
    "streaming-f4": ("diloco:sync_every=16,fragments=4,overlap=1", "allreduce"),
    "streaming-f4-carry": ("diloco:sync_every=16,fragments=4,overlap=1,merge=carry", "allreduce"),
    "streaming-f4-carry-warm8e100": ("diloco:sync_every=16,fragments=4,overlap=1,merge=carry", "quantize:bits=8"),
    "topk3-model": (f"diloco:sync_every=16,unsent=model+topk:density=0.03,{_TOPK}", "allreduce"),
    "topk1-model": (f"diloco:sync_every=16,unsent=model+topk:density=0.01,{_TOPK}", "allreduce"),
    "topk1-model-wq8": (f"diloco:sync_every=16,unsent=model+topk:density=0.01,{_TOPK}", "quantize:bits=8"),
}

#: the per-step top-k 1% run the local-step runs are compared with at equal wall time
TOPK_RUN = "topk1-step-fp16"


def load(folder: str) -> dict[str, dict[int, dict[str, Any]]]:
    runs: dict[str, dict[int, dict[str, Any]]] = {}
    for path in sorted(glob.glob(os.path.join(folder, "*-s[0-9]*.json"))):
        match = re.match(r"(.+)-s(\d+)\.json$", os.path.basename(path))
        if match and os.path.getsize(path):  # a run in progress has created its file empty
            with open(path) as handle:
                runs.setdefault(match.group(1), {})[int(match.group(2))] = json.load(handle)
    return runs


def mean_spread(values: list[float]) -> tuple[float, float]:
    """Mean and half the range (for 2 seeds: the distance of each seed from the mean)."""
    if not values:
        return math.nan, math.nan
    return sum(values) / len(values), (max(values) - min(values)) / 2


def evaluations(record: dict[str, Any]) -> list[tuple[int, float]]:
    """(step, held-out loss) of a run. Runs recorded before diloco_sim evaluated the warm-up's model
    (commit "eval_model in the warm-up") show the initial θ inside the warm-up, its loss at step 0
    to the last bit: those evaluations are left out (dense-h16's records); the others are kept."""
    warmup = warmup_of(record)
    initial = record["evaluations"][0]["held_out_loss"]
    return [(e["step"], e["held_out_loss"]) for e in record["evaluations"]
            if e["step"] == 0 or e["step"] >= warmup or e["held_out_loss"] != initial]


def crossing(record: dict[str, Any], target: float) -> float:
    """The first step at which the held-out loss reaches ``target``, linearly interpolated between
    evaluations; NaN if it never does."""
    points = evaluations(record)
    for (s0, l0), (s1, l1) in zip(points, points[1:]):
        if l1 <= target:
            return s1 if l0 == l1 else s0 + (l0 - target) / (l0 - l1) * (s1 - s0)
    return math.nan


def loss_at(record: dict[str, Any], step: float) -> float:
    """The held-out loss at ``step`` (interpolated between evaluations; the last one beyond)."""
    points = evaluations(record)
    if step >= points[-1][0]:
        return points[-1][1]
    for (s0, l0), (s1, l1) in zip(points, points[1:]):
        if s0 <= step <= s1:
            return l0 + (l1 - l0) * (step - s0) / (s1 - s0)
    return math.nan


def warmup_of(record: dict[str, Any]) -> int:
    match = re.search(r"warmup_steps=(\d+)", record.get("method", ""))
    return int(match.group(1)) if match else 0


def quality_table(runs: dict[str, dict[int, dict[str, Any]]]) -> str:
    """One row per run. "vs DDP" and "vs dense at same H" compare means over the seeds both runs have
    (a run of seed 0 only is compared with the reference's seed 0, not with its mean over seeds)."""
    ddp = runs.get("ddp", {})
    lines = ["| run | method | seeds | held-out loss (mean ± half range) | vs DDP | vs dense at same H | "
             "bytes/step vs DDP (all steps) | (local steps) | peak sync, KB | steps to DDP's final loss |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for name in sorted(runs, key=lambda n: (n != "ddp", n)):
        seeds = runs[name]
        # the DDP calibration record (docs/lm/calibration-4x1500.json) has no method or byte counts
        first = next((r for r in seeds.values() if "bytes_per_step" in r), next(iter(seeds.values())))
        loss, spread = mean_spread([r["held_out_loss"] for r in seeds.values()])
        reference = dense_reference(runs, first)
        ratio = first["bytes_per_step"] / first["bytes_ddp_per_step"] if "bytes_per_step" in first else math.nan
        local = first.get("bytes_per_local_step")
        local_ratio = local / first["bytes_ddp_per_step"] if local is not None else math.nan
        steps = [crossing(r, ddp[s]["held_out_loss"]) for s, r in seeds.items() if s in ddp]
        lines.append(f"| {name} | `{first.get('method', 'allreduce')}` | {','.join(map(str, sorted(seeds)))} | "
                     f"{loss:.4f}{f' ± {spread:.4f}' if len(seeds) > 1 else ' (one seed)'} | {_paired(seeds, ddp)} | "
                     f"{_paired(seeds, reference) if reference is not seeds else '–'} | {_ratio(ratio)} | "
                     f"{_ratio(local_ratio)} | {_kb(first.get('bytes_peak_sync'))} | {_steps(steps)} |")
    if any(" † |" in line for line in lines):  # the footnote only where a row carries the mark
        lines.append("\n† the pair's records of a seed were computed by different float kernels (their step-0 "
                     "losses differ): the comparison carries the spread between two machines, not only the "
                     "method's (\"Two machines, two trajectories\", under \"The simulator\").")
    return "\n".join(lines)


def dense_reference(runs: dict[str, dict[int, dict[str, Any]]], record: dict[str, Any]
                    ) -> Optional[dict[int, dict[str, Any]]]:
    """The seeds of the dense run (``dense-hH``) of ``record``'s period H, or None."""
    period = re.search(r"sync_every=(\d+)", record.get("method", ""))
    return runs.get(f"dense-h{period.group(1)}") if period else None


def paired_change(seeds: dict[int, dict[str, Any]], reference: Optional[dict[int, dict[str, Any]]]) -> float:
    """The mean held-out loss over the seeds both have, relative to the reference's over the same
    seeds, in percent (NaN when they have none in common)."""
    common = sorted(set(seeds) & set(reference or {}))
    if not common:
        return math.nan
    mine = sum(seeds[s]["held_out_loss"] for s in common) / len(common)
    theirs = sum(reference[s]["held_out_loss"] for s in common) / len(common)
    return 100 * (mine / theirs - 1)


def numerics(record: dict[str, Any]) -> float:
    """The held-out loss of the initial model (step 0): the same weights, data and code give it to
    the last bit, so two records of one seed that differ in it were computed by different float
    kernels (machines whose CPUs take other vector paths: some sessions' runs of 2026-12-02 to 12-06
    against the rest), and from there on their trajectories differ as two seeds' do."""
    return record["evaluations"][0]["held_out_loss"]


def mixed_numerics(seeds: dict[int, dict[str, Any]], reference: Optional[dict[int, dict[str, Any]]]) -> bool:
    """Whether a paired comparison pairs records of one seed computed by different kernels."""
    return any(numerics(seeds[s]) != numerics(reference[s]) for s in set(seeds) & set(reference or {}))


def _paired(seeds: dict[int, dict[str, Any]], reference: Optional[dict[int, dict[str, Any]]]) -> str:
    change = paired_change(seeds, reference)
    if math.isnan(change):
        return "–"
    return f"{change:+.1f}%" + (" †" if mixed_numerics(seeds, reference) else "")


def _kb(value: Optional[float]) -> str:
    return "–" if value is None else f"{value / 1e3:.1f}"


def _ratio(value: float) -> str:
    if math.isnan(value) or value <= 0:
        return "–"
    return f"1/{1 / value:,.0f}" if value < 0.5 else f"{value:.2f}"


def _steps(values: list[float]) -> str:
    finite = [v for v in values if not math.isnan(v)]
    if not values:
        return "–"
    if len(finite) < len(values):
        return f"not reached in {len(values) - len(finite)} of {len(values)} seeds" + (
            f" ({', '.join(f'{v:.0f}' for v in finite)})" if finite else "")
    return ", ".join(f"{v:.0f}" for v in finite)


def timing_table(runs: dict[str, dict[int, dict[str, Any]]], timing: dict[str, Any],
                 mapping: dict[str, tuple[str, Optional[str]]]) -> str:
    """Seconds per step on the cluster, and the projected time to DDP's final held-out loss."""
    rows = timing["rows"]
    lines = []
    for bandwidth in sorted({r["bandwidth"] for r in rows}, key=lambda b: -_rate(b)):
        at = {r["method"]: r for r in rows if r["bandwidth"] == bandwidth}
        floor = next(iter(at.values()))["floor_seconds"]
        ddp_time = 1500 * at["allreduce"]["seconds_per_step"] if "allreduce" in at else math.nan
        lines += [f"\n**{bandwidth}** (compute-only floor {floor:.3f} s/step)\n",
                  "| run | local-step method timed | s/step | x floor | outer-step hooks, s/step | x in-run floor | "
                  "warm-up s/step | steps to DDP's final | "
                  "time to DDP's final, s | speed-up vs DDP | "
                  "held-out loss vs per-step top-k 1%'s, at the wall time of the "
                  "shorter run |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        topk = runs.get(TOPK_RUN, {})
        for name, (local, warm) in mapping.items():
            if name not in runs or local not in at or (warm is not None and warm not in at):
                continue  # a launch that did not time its warm-up's method cannot project it
            t_local = at[local]["seconds_per_step"]
            t_warm = at[warm]["seconds_per_step"] if warm is not None else t_local
            seeds = runs[name]
            ddp = runs.get("ddp", {})
            steps = [crossing(r, ddp[s]["held_out_loss"]) if name != "ddp" else 1500.0
                     for s, r in seeds.items() if s in ddp]
            t_ddp = at["allreduce"]["seconds_per_step"] if "allreduce" in at else t_warm
            times = [_time(s, phases_of(seeds[seed], t_ddp, t_warm, t_local)) for s, seed in zip(steps, seeds)]
            mean_time = mean_spread([t for t in times if not math.isnan(t)])[0]
            compare = "–"
            t_topk = at.get(TIMED[TOPK_RUN][0], {}).get("seconds_per_step", math.nan)
            if topk and name not in (TOPK_RUN, "topk1-step", "ddp") and not math.isnan(t_topk):
                # both curves at the same wall time: the shorter of the two runs' whole durations
                pairs = []
                for seed, record in seeds.items():
                    if seed not in topk:
                        continue
                    phases = phases_of(record, t_ddp, t_warm, t_local)
                    wall = min(_time(1500.0, phases), 1500 * t_topk)
                    pairs.append((loss_at(record, _steps_in(wall, phases)),
                                  loss_at(topk[seed], wall / t_topk)))
                if pairs:
                    mine = sum(p[0] for p in pairs) / len(pairs)
                    theirs = sum(p[1] for p in pairs) / len(pairs)
                    compare = f"{mine:.4f} vs {theirs:.4f}"
            hooks, in_run = _hook_seconds(at[local])
            lines.append(f"| {name} | `{local}` | {t_local:.3f} | {t_local / floor:.2f} | {hooks} | {in_run} | "
                         f"{t_warm:.3f} | {_steps(steps)} | {mean_time:.0f} | {ddp_time / mean_time:.2f}x | "
                         f"{compare} |")
    return "\n".join(lines)


def _hook_seconds(row: dict[str, Any]) -> tuple[str, str]:
    """A local-steps method's outer-step seconds per inner step (DiLoCo's own ``seconds_sync``, in its
    hooks) and the step time over the same step without them: the overhead against the compute of the
    same launch, which the machine's load moves as much between launches as it moves the floor."""
    local = row.get("local_steps")
    if not local or not local.get("inner_steps"):
        return "–", "–"
    hooks = local["seconds_sync"] / local["inner_steps"]
    step = row["seconds_per_step"]
    return f"{hooks:.4f}", f"{step / (step - hooks):.3f}"


Phases = list  # [(steps, seconds per step)], the last phase unbounded


def phases_of(record: dict[str, Any], t_exact: float, t_warm: float, t_local: float) -> Phases:
    """A run's schedule: its warm-up's exact steps (``warmup_exact``) at DDP's time, the rest of
    its warm-up at ``t_warm``, then the local steps."""
    warmup = warmup_of(record)
    match = re.search(r"warmup_exact=(\d+)", record.get("method", ""))
    exact = min(int(match.group(1)), warmup) if match else 0
    return [(exact, t_exact), (warmup - exact, t_warm), (math.inf, t_local)]


def _steps_in(seconds: float, phases: Phases) -> float:
    """How many steps the schedule ``phases`` does in ``seconds``."""
    done = 0.0
    for steps, per_step in phases:
        if seconds <= steps * per_step:
            return done + seconds / per_step
        seconds -= steps * per_step
        done += steps
    return done


def _time(steps: float, phases: Phases) -> float:
    """Seconds the schedule ``phases`` takes for ``steps`` steps (NaN for NaN)."""
    if math.isnan(steps):
        return math.nan
    total = 0.0
    for length, per_step in phases:
        taken = min(steps, length)
        total += taken * per_step
        steps -= taken
    return total


def _rate(bandwidth: str) -> float:
    match = re.match(r"([\d.]+)([kmg]?)bit", bandwidth)
    return float(match.group(1)) * {"k": 1e3, "m": 1e6, "g": 1e9, "": 1}[match.group(2)] if match else 0.0


def family(name: str, record: dict[str, Any]) -> str:
    """What a run sends: "DDP", "per-step" (a compressor every step) or, at its syncs, "dense",
    "quantized" or "sparse"."""
    method = record.get("method", "")
    if name == "ddp":
        return "DDP"
    if not method.startswith("diloco"):
        return "per-step"
    if "+" not in method:
        return "dense"
    return "quantized" if "+quantize" in method else "sparse"


def frontier_points(runs: dict[str, dict[int, dict[str, Any]]]) -> list[dict[str, Any]]:
    """One point per run that counted its bytes (DDP's at 1): its family, bytes per local step as a fraction of
    DDP's, the mean held-out loss over its seeds and, where a dense run of its period exists, the
    mean over the seeds both have relative to that run (in percent; NaN without one)."""
    points = []
    for name, seeds in sorted(runs.items()):
        first = next(iter(seeds.values()))
        kind = family(name, first)
        # a per-step compressor's every step is a local step
        local = first.get("bytes_per_local_step", first.get("bytes_per_step") if kind == "per-step" else None)
        if local is None and name != "ddp":
            continue
        reference = dense_reference(runs, first)
        points.append({"name": name, "family": kind, "seeds": len(seeds),
                       "fraction": 1.0 if local is None else local / first["bytes_ddp_per_step"],
                       "loss": mean_spread([r["held_out_loss"] for r in seeds.values()])[0],
                       "vs_dense": paired_change(seeds, reference) if reference is not seeds else math.nan})
    return points


_COLOURS = {"DDP": "black", "per-step": "tab:purple", "dense": "tab:blue", "quantized": "tab:green",
            "sparse": "tab:red"}


def plot_frontier(runs: dict[str, dict[int, dict[str, Any]]], path: str) -> None:
    """Two panels against bytes per local step (log): the held-out loss, and its distance from dense
    outer steps of the same period with issue 19's bounds (5% at ≤ 1/2000 for sparse outer steps).
    Hollow markers: one seed; filled: the mean of two or more.

    Raises:
        SystemExit: matplotlib is not installed.
    """
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("--plot needs matplotlib: pip install 'gradwire[plot]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = frontier_points(runs)
    figure, (left, right) = plt.subplots(1, 2, figsize=(13, 5.2))
    for axis, key in ((left, "loss"), (right, "vs_dense")):
        for point in points:
            if math.isnan(point[key]):
                continue
            colour = _COLOURS[point["family"]]
            axis.scatter(point["fraction"], point[key], s=30, edgecolors=colour,
                         facecolors=colour if point["seeds"] > 1 else "none", zorder=3)
            if point["family"] in ("sparse", "DDP", "per-step") or key == "loss" and point["family"] == "dense":
                axis.annotate(point["name"], (point["fraction"], point[key]), fontsize=6,
                              xytext=(3, 2), textcoords="offset points")
        axis.set_xscale("log")
        axis.axvline(1 / 2000, color="grey", linestyle=":", linewidth=1)
        axis.set_xlabel("bytes per local step / DDP's bytes per step (log)")
        axis.grid(True, which="major", alpha=0.3)
    for point in points:
        if point["family"] == "DDP":
            left.axhline(point["loss"], color="black", linestyle="--", linewidth=0.8, label="DDP's loss")
    right.axhline(5, color="tab:red", linestyle="--", linewidth=0.8, label="+5% (sparse target)")
    right.axhline(1, color="tab:green", linestyle="--", linewidth=0.8, label="+1% (quantized target)")
    left.set_ylabel("final held-out loss (mean over seeds)")
    right.set_ylabel("vs dense outer steps at the same H, %")
    right.set_yscale("symlog", linthresh=10)
    worst = max((p["vs_dense"] for p in points if not math.isnan(p["vs_dense"])), default=10.0)
    right.set_ylim(top=max(worst, 10.0) * 1.4)
    for family_name in sorted({p["family"] for p in points}, key=list(_COLOURS).index):
        left.scatter([], [], color=_COLOURS[family_name], label=family_name)
    left.legend(fontsize=7, loc="upper right")
    right.legend(fontsize=7, loc="lower left")
    figure.suptitle("DiLoCo outer steps: loss against bytes (4 simulated workers, 1500 steps; dotted: 1/2000)",
                    fontsize=10)
    figure.tight_layout()
    figure.savefig(path, dpi=130)
    plt.close(figure)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", default="docs/lm/local-steps")
    parser.add_argument("--timing", default=None, help="gradwire bench e2e results.json")
    parser.add_argument("--map", default=None, help="JSON: {run: [local method, warm-up method or null]}")
    parser.add_argument("--plot", default=None, help="write the loss-bytes frontier to this PNG")
    args = parser.parse_args()
    runs = load(args.runs)
    print(quality_table(runs))
    if args.plot:
        plot_frontier(runs, args.plot)
    if args.timing:
        with open(args.timing) as handle:
            timing = json.load(handle)
        mapping = dict(TIMED)
        if args.map:
            with open(args.map) as handle:
                mapping.update({k: tuple(v) for k, v in json.load(handle).items()})
        print(timing_table(runs, timing, mapping))


if __name__ == "__main__":
    main()
