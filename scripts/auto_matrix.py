"""``collective="auto"`` against every fixed strategy, in one launch per cell (issue 17's matrix).

    python scripts/auto_matrix.py [--out bench-out/auto-matrix] [--steps 8] [--warmup-steps 32] [--rounds 3]
        [--models mlp,resnet18] [--workers 2,4] [--links loopback,cluster] [--bandwidths 1gbit,100mbit]

For each model in {mlp, resnet18} and each link in {loopback, 1 Gbit/s, 100 Mbit/s} (the emulated
cluster; root) and p in {2, 4}, ``gradwire bench e2e`` trains, in one launch, dense AllReduce,
top-k 1% (fp16/Rice) through the payload AllGather, through the sparse AllReduce, and under
``collective=auto``; the cell reports auto's seconds per step over the fastest fixed strategy's
and over dense's (both measured in the same launch), and what auto ended on.

The warm-up steps are untimed and long enough for auto's first trial (it starts 8 rounds after
the first and takes two passes of 3 rounds per candidate, less the second pass's first warm-in, at
most 4 candidates on one host — model, dense, and the AllGather and the sparse AllReduce forced when
the model mixed them: 23 rounds, so from step 31 on auto runs what it chose): the matrix compares
steady states. The trial's own cost — 6 rounds under each losing candidate, once per 200 rounds —
follows from the trial's measured times, which the matrix keeps.
With ``--rounds N`` each launch repeats the floors and the methods N times, every other round in
reverse order, and each figure is the median over the rounds (one 8-step run per method swung by
up to 17% between runs of the same exchange on 2 shared cores); auto's policy is each round's.
Prints a table and writes
``matrix.json`` (each cell with its rounds' times, floors, bytes and auto's trials); the raw runs
stay in ``--out/<model>-<links>/results.json``, every run's steps in ``--out/<model>-<links>/steps/``
(``metrics_by_round`` names them).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

METHODS = {
    "dense": "allreduce",
    "allgather": "topk:density=0.01,values=fp16,indices=rice,collective=allgather",
    "sparse-allreduce": "topk:density=0.01,values=fp16,indices=rice,collective=sparse-allreduce",
    "auto": "topk:density=0.01,values=fp16,indices=rice,collective=auto",
}


def _steps(by_method: dict[str, dict]) -> dict[str, dict]:
    """Every step of every round's run (warm-up included), from the runs' per-step records, so that
    matrix.json alone shows when in a run a method was slow: ``step_seconds_by_round`` (rank 0's
    step times) and ``auto_ran_by_round`` (the policy each of auto's steps ran; a trial shows as
    its candidates). Empty where the records are gone (``--report-only`` on another machine)."""
    seconds: dict[str, list[list[float]]] = {}
    ran: list[list[object]] = []
    for name, spec in METHODS.items():
        paths = by_method[spec].get("metrics_path_by_round") or []
        if not paths or not all(path and Path(path).exists() for path in paths):
            return {}
        rounds = [[json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()] for path in paths]
        seconds[name] = [[round(r["seconds_step"], 4) for r in records] for records in rounds]
        if name == "auto":
            ran = [[r.get("auto_ran") for r in records] for records in rounds]
    return {"step_seconds_by_round": seconds, "auto_ran_by_round": ran}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="bench-out/auto-matrix")
    parser.add_argument("--models", default="mlp,resnet18")
    parser.add_argument("--workers", default="2,4")
    parser.add_argument("--links", default="loopback,cluster", help="loopback and/or cluster (default both)")
    parser.add_argument("--bandwidths", default="1gbit,100mbit", help="the cluster's links (default 1gbit,100mbit)")
    parser.add_argument("--steps", type=int, default=8, help="measured steps per method (default 8)")
    parser.add_argument("--warmup-steps", type=int, default=32, help="untimed steps first (default 32)")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3, help="rounds per launch, medians reported (default 3)")
    parser.add_argument("--report-only", action="store_true", help="rebuild the table from the saved runs")
    args = parser.parse_args(argv)
    out = Path(args.out)
    links_flags = {"loopback": ["--local"], "cluster": ["--bandwidths", args.bandwidths]}
    unknown = set(args.links.split(",")) - set(links_flags)
    if unknown:
        parser.error(f"--links: {sorted(unknown)} not in loopback, cluster")
    cells = []
    for model in args.models.split(","):
        for links in args.links.split(","):
            flags = links_flags[links]
            folder = out / f"{model}-{links}"
            if not args.report_only:
                command = [sys.executable, "-m", "gradwire", "bench", "e2e", "--model", model, "--data", "synthetic",
                           "--workers", args.workers, "--steps", str(args.steps), "--warmup-steps",
                           str(args.warmup_steps), "--batch-size", str(args.batch_size), "--out", str(folder),
                           "--rounds", str(args.rounds),
                           *flags, *[arg for spec in METHODS.values() for arg in ("--method", spec)]]
                print("+", " ".join(command), flush=True)
                subprocess.run(command, check=True)
            rows = json.loads((folder / "results.json").read_text())["rows"]
            for key in sorted({(r["workers"], r["bandwidth"]) for r in rows}):
                by_method = {r["method"]: r for r in rows if (r["workers"], r["bandwidth"]) == key}
                seconds = {name: by_method[spec]["seconds_per_step"] for name, spec in METHODS.items()}
                fixed = {name: value for name, value in seconds.items() if name != "auto"}
                fastest = min(fixed, key=fixed.get)
                auto_summary = by_method[METHODS["auto"]].get("auto") or {}
                cells.append({"model": model, "link": key[1], "workers": key[0],
                              **{f"{n}_s": v for n, v in seconds.items()},
                              "fastest_fixed": fastest, "auto_over_fastest": seconds["auto"] / fixed[fastest],
                              "auto_over_dense": seconds["auto"] / seconds["dense"],
                              "auto_policy": "/".join(str(a.get("policy")) for a in
                                                      by_method[METHODS["auto"]].get("auto_by_round", [auto_summary])),
                              "auto_trial": {k: v for k, v in auto_summary.items()
                                             if k.startswith(("seconds_", "rounds_"))},
                              # what the medians were taken over: each round's run, floor, bytes and trial
                              "seconds_by_round": {n: by_method[spec].get("seconds_per_step_by_round")
                                                   for n, spec in METHODS.items()},
                              "bytes_per_step": {n: by_method[spec]["bytes_per_step"] for n, spec in METHODS.items()},
                              "floor_seconds_by_round": by_method[METHODS["dense"]].get("floor_seconds_by_round"),
                              # each round's per-step records (step times, bytes, auto's policy per step)
                              "metrics_by_round": {n: by_method[spec].get("metrics_path_by_round")
                                                   for n, spec in METHODS.items()},
                              **_steps(by_method),
                              "auto_by_round": by_method[METHODS["auto"]].get("auto_by_round")})
    out.mkdir(parents=True, exist_ok=True)
    (out / "matrix.json").write_text(json.dumps(cells, indent=2))
    print("\n| model | link | p | dense s | allgather s | sparse-allreduce s | auto s | auto policy | "
          "auto / fastest fixed | auto / dense |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for c in cells:
        print(f"| {c['model']} | {c['link']} | {c['workers']} | {c['dense_s']:.3f} | {c['allgather_s']:.3f} | "
              f"{c['sparse-allreduce_s']:.3f} | {c['auto_s']:.3f} | {c['auto_policy']} | "
              f"{c['auto_over_fastest']:.3f} ({c['fastest_fixed']}) | {c['auto_over_dense']:.3f} |")
    met = all(c["auto_over_fastest"] <= 1.05 and c["auto_over_dense"] <= 1.05 for c in cells)
    print(f"\ntarget (every cell: auto <= 1.05x the fastest fixed and <= 1.05x dense): {'met' if met else 'NOT met'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
