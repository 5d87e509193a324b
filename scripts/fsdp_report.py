"""The measurement tables of docs/fsdp.md, from the JSON files in docs/fsdp/ (every number there comes from here).

    python scripts/fsdp_report.py [--dir docs/fsdp] [--plain PATH]

Reads:

* ``sim-NAME-sSEED.json``: ``gradwire simulate --fsdp SPEC --json`` records (held-out loss);
  the plain FSDP2 reference is ``--plain`` (default: the DDP calibration record of the same setting,
  docs/lm/calibration-4x1500.json, which ``--fsdp plain`` reproduces bit for bit, see
  ``plain-check-250steps-s0.json``) for seed 0, ``ddp-s1.json`` (gradwire simulate --method allreduce
  --seed 1 on the diloco branch, docs/lm/local-steps/ddp-s1.json there) for seed 1, and
  ``sim-plain-sSEED.json`` where present;
* ``train-bytes-*.json``: ``gradwire train --fsdp --json`` summaries (bytes per step and rank);
* ``memory-NAME-rROUND.json``: ``scripts/fsdp_memory.py`` lines (peak memory per rank);
* ``hsdp-2x2-NAME.json``: ``scripts/fsdp_hsdp.py`` lines (bytes on a 2 x 2 mesh);
* ``timing-*.json``: ``gradwire train --fsdp --cluster --json`` summaries (seconds per step, each
  launch against the mean of its own plain FSDP2 rows).

Prints markdown tables.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
from typing import Any


def _load(path: str) -> Any:
    with open(path) as handle:
        return json.load(handle)


def quality(folder: str, plain_path: str) -> str:
    runs: dict[str, dict[int, dict[str, Any]]] = {}
    for path in sorted(glob.glob(os.path.join(folder, "sim-*-s[0-9]*.json"))):
        match = re.match(r"sim-(.+)-s(\d+)\.json$", os.path.basename(path))
        if match and os.path.getsize(path):
            runs.setdefault(match.group(1), {})[int(match.group(2))] = _load(path)
    plain = dict(runs.pop("plain", {}))
    if 0 not in plain and os.path.exists(plain_path):
        plain[0] = _load(plain_path)
    ddp1 = os.path.join(folder, "ddp-s1.json")
    if 1 not in plain and os.path.exists(ddp1):
        plain[1] = _load(ddp1)
    lines = ["| run | `--fsdp` spec | seed | held-out loss, step 500 | 1000 | 1500 (final) "
             "| vs plain FSDP2 (same seed) | bytes over the run x plain FSDP2 |",
             "|---|---|---|---|---|---|---|---|"]
    rows = [("plain", seed, record) for seed, record in sorted(plain.items())]
    rows += [(name, seed, record) for name in sorted(runs) for seed, record in sorted(runs[name].items())]
    for name, seed, record in rows:
        at = {e["step"]: e["held_out_loss"] for e in record["evaluations"]}
        plain_spec = f"plain (DDP record, {record.get('method', 'allreduce')})" if name == "plain" else "?"
        spec = record.get("fsdp", {}).get("spec", plain_spec)
        reference = plain.get(seed)
        versus = "–" if name == "plain" or reference is None else \
            f"{100 * (record['held_out_loss'] / reference['held_out_loss'] - 1):+.2f}%"
        lines.append(f"| {name} | `{spec}` | {seed} | {at.get(500, float('nan')):.4f} | "
                     f"{at.get(1000, float('nan')):.4f} | "
                     f"{record['held_out_loss']:.4f} | {versus} | {_run_bytes(record)} |")
    several = {name: seeds for name, seeds in runs.items() if len(set(seeds) & set(plain)) > 1}
    if several:
        lines += ["\n| run | seeds | final held-out loss, mean ± half range | plain FSDP2's, same seeds | "
                  "vs plain, mean ± half range over seeds |", "|---|---|---|---|---|"]
        for name, seeds in sorted(several.items()):
            common = sorted(set(seeds) & set(plain))
            mine = [seeds[s]["held_out_loss"] for s in common]
            theirs = [plain[s]["held_out_loss"] for s in common]
            rel = [100 * (a / b - 1) for a, b in zip(mine, theirs)]
            lines.append(f"| {name} | {','.join(map(str, common))} | {_ms(mine, '.4f')} | {_ms(theirs, '.4f')} | "
                         f"{_ms(rel, '+.2f', '.2f')} % |")
    return "\n".join(lines)


def _run_bytes(record: dict[str, Any]) -> str:
    """The reduce-scatter's bytes averaged over every step, warm-up included, against plain FSDP2's.

    Records written since 2026-12-03 carry the ratio (``fsdp.bytes_vs_plain``). Older ones carry
    ``bytes_per_step`` only, which counted a warm-up's dense steps as zero until then: it is used
    where the spec has no warm-up (``bytes_ddp_per_step`` is a float32 AllReduce, twice the
    reduce-scatter; ByteGPT's shards need no padding at 4 ranks). Otherwise "–"."""
    fsdp = record.get("fsdp", {})
    if "bytes_vs_plain" in fsdp:
        return f"{fsdp['bytes_vs_plain']:.4f}"
    spec = fsdp.get("spec")
    if record.get("bytes_per_step") and spec is not None and "warmup_steps" not in spec:
        return f"{2 * record['bytes_per_step'] / record['bytes_ddp_per_step']:.4f}"
    return "–"


def _ms(values: list[float], fmt: str, spread: str = ".4f") -> str:
    """Mean ± half the range."""
    mean = sum(values) / len(values)
    return f"{mean:{fmt}} ± {(max(values) - min(values)) / 2:{spread}}"


def bytes_table(folder: str) -> str:
    lines = []
    for path in sorted(glob.glob(os.path.join(folder, "train-bytes-*.json"))):
        summaries = _load(path)
        plain = next(s for s in summaries if s["method"] == "allreduce")
        lines += [f"\n`{os.path.basename(path)}` ({plain['world_size']} ranks, {plain['parameters']:,} parameters, "
                  f"{plain['steps']} steps)\n",
                  "| method | bytes sent per rank and step | x plain FSDP2 |", "|---|---|---|"]
        for s in summaries:
            name = "plain FSDP2 (`allreduce`)" if s["method"] == "allreduce" else f"`{s['method']}`"
            ratio = s["bytes_per_step"] / plain["bytes_per_step"]
            lines.append(f"| {name} | {s['bytes_per_step']:,.0f} | {ratio:.4f} |")
    hsdp = sorted(glob.glob(os.path.join(folder, "hsdp-2x2-*.json")))
    if hsdp:
        lines += ["\nHSDP, 2 replicas x 2 shards (`scripts/fsdp_hsdp.py`, last of 3 steps, max over ranks)\n",
                  "| method | bytes sent per rank and step | plain HSDP | x plain HSDP |", "|---|---|---|---|"]
        for path in hsdp:
            row = _load(path)
            lines.append(f"| `{row['method']}` | {row['bytes_sent']:,.0f} | {row['bytes_plain_hsdp']:,.0f} | "
                         f"{row['bytes_sent'] / row['bytes_plain_hsdp']:.4f} |")
    return "\n".join(lines)


def memory_table(folder: str) -> str:
    rows: dict[str, list[dict[str, Any]]] = {}
    for path in sorted(glob.glob(os.path.join(folder, "memory-*-r[0-9]*.json"))):
        record = _load(path)
        rows.setdefault(record["method"], []).append(record)
    if not rows:
        return ""
    first = next(iter(rows.values()))[0]
    plain = rows.get("plain", [])
    plain_step = sum(r["step_memory_mb"] for r in plain) / len(plain) if plain else float("nan")
    lines = [f"\n`scripts/fsdp_memory.py`: {first['world_size']} ranks, gpt d_model {first['d_model']}, "
             f"{first['layers']} layers ({first['parameters']:,} parameters), {first['steps']} steps; "
             "MB = MiB, max over ranks, per launch\n",
             "| method | launches | peak RSS, MB | step memory, MB | step memory − plain's mean, MB | residuals, MB |",
             "|---|---|---|---|---|---|"]
    order = sorted(rows, key=lambda m: (m != "plain", m))
    for method in order:
        records = rows[method]
        peak = ", ".join(f"{r['peak_rss_mb']:.0f}" for r in records)
        step = ", ".join(f"{r['step_memory_mb']:.0f}" for r in records)
        extra = ", ".join(f"{r['step_memory_mb'] - plain_step:+.0f}" for r in records)
        lines.append(f"| `{method}` | {len(records)} | {peak} | {step} | {extra} | {records[0]['residual_mb']:.1f} |")
    return "\n".join(lines)


def timing_table(folder: str) -> str:
    paths = sorted(glob.glob(os.path.join(folder, "timing-*.json")))
    if not paths:
        return ""
    launches = [_load(path) for path in paths]
    methods: list[str] = []
    for summaries in launches:
        for summary in summaries:
            if summary["method"] not in methods:
                methods.append(summary["method"])
    names = [os.path.basename(p).removesuffix(".json") for p in paths]
    lines = ["\n| method | " + " | ".join(f"s/step ({n})" for n in names) + " | x plain FSDP2 per launch | median |",
             "|---|" + "---|" * len(names) + "---|---|"]
    for method in methods:
        cells, ratios = [], []
        for summaries in launches:
            plain = [s["seconds_per_step"] for s in summaries if s["method"] == "allreduce"]
            mine = [s["seconds_per_step"] for s in summaries if s["method"] == method]
            cells.append(", ".join(f"{v:.3f}" for v in mine) or "–")
            if plain and mine:
                ratios.append(sum(mine) / len(mine) / (sum(plain) / len(plain)))
        ordered = sorted(ratios)
        median = (ordered[(len(ordered) - 1) // 2] + ordered[len(ordered) // 2]) / 2 if ordered else float("nan")
        name = "plain FSDP2 (`allreduce`)" if method == "allreduce" else f"`{method}`"
        lines.append(f"| {name} | " + " | ".join(cells) + " | " + ", ".join(f"{r:.3f}" for r in ratios)
                     + f" | {median:.3f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", default="docs/fsdp")
    parser.add_argument("--plain", default="docs/fsdp/calibration-4x1500.json")
    args = parser.parse_args()
    print(quality(args.dir, args.plain))
    print(bytes_table(args.dir))
    print(memory_table(args.dir))
    print(timing_table(args.dir))


if __name__ == "__main__":
    main()
