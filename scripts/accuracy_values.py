"""Accuracy of lossy value codecs against fp32 values at the same top-k density (issue 12, item 5).

For each model (the MNIST-5k CNN; the byte-level LSTM LM on a Python standard-library source
file, which ships with every Python) and each seed, one ``gradwire train`` launch (2 workers)
runs every method from the same initial model; the table gives, per method, the mean and
spread over seeds of the test accuracy and (LSTM) the test perplexity exp(mean loss per byte),
and the difference to the fp32-values method of the same density.

    PYTHONPATH=src python scripts/accuracy_values.py --seeds 0,1,2 --out bench-out/accuracy-values \
        --lossy "qsgd-ans,levels=1,norm=range,rounding=nearest;polyfit"
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import json
import math
import os
import statistics
import subprocess
import sys
import sysconfig

#: the lossy value codecs that meet the LSTM-LM top-10% volume target with Rice indices (bench
#: codecs): qsgd-ans with two magnitudes per bucket and the sign (0.0197), polyfit's levels (0.0182)
LOSSY = "qsgd-ans,levels=1,norm=range,rounding=nearest;polyfit"


def methods(lossy: list[str], with_fp32: bool = True) -> list[str]:
    values = (["fp32"] if with_fp32 else []) + lossy
    return [f"topk:density={d},values={v},indices=rice" for d in ("0.01", "0.1") for v in values]


def saved(model: str, seed: int, out: str) -> dict[str, dict]:
    """Summaries by method from every finished launch of (model, seed) under ``out``."""
    found: dict[str, dict] = {}
    for path in sorted(glob.glob(os.path.join(out, f"{model}-seed{seed}*.json"))):
        with open(path) as handle:
            found.update({summary["method"]: summary for summary in json.load(handle)})
    return found


def launch(model: str, seed: int, wanted: list[str], args: argparse.Namespace) -> dict[str, dict]:
    """Run the methods of ``wanted`` not yet saved (resumable; several copies may share ``out``
    when they want different methods)."""
    missing = [m for m in wanted if m not in saved(model, seed, args.out)]
    if missing and not args.report_only:
        tag = hashlib.sha256("\n".join(missing).encode()).hexdigest()[:8]
        path = os.path.join(args.out, f"{model}-seed{seed}-{tag}.json")
        command = [sys.executable, "-m", "gradwire", "train", "--model", model, "--workers", "2", "--seed", str(seed),
                   "--epochs", str(args.epochs), "--timeout", str(args.timeout), "--json", path + ".part"]
        if model == "lstm":
            command += ["--text", args.text, "--lr", str(args.lstm_lr)]
        for method in missing:
            command += ["--method", method]
        print("$", " ".join(command), flush=True)
        subprocess.run(command, check=True, timeout=args.timeout + 120)
        os.replace(path + ".part", path)
    return saved(model, seed, args.out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--models", default="cnn,lstm")
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--lossy", default=LOSSY,
                        help=f"';'-separated value codecs (and options) compared with fp32 (default {LOSSY})")
    parser.add_argument("--no-fp32", action="store_true", help="run only the lossy methods (another copy runs fp32)")
    parser.add_argument("--report-only", action="store_true", help="print the table of what is saved; run nothing")
    parser.add_argument("--text", default=os.path.join(sysconfig.get_paths()["stdlib"], "argparse.py"))
    parser.add_argument("--lstm-lr", type=float, default=0.05)
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--out", default="bench-out/accuracy-values")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    seeds = [int(s) for s in args.seeds.split(",")]
    lossy = [spec for spec in args.lossy.split(";") if spec]
    rows = []
    for model in args.models.split(","):
        runs = {seed: launch(model, seed, methods(lossy, not args.no_fp32), args) for seed in seeds}
        stats = {}
        for method in methods(lossy):
            have = [runs[seed][method] for seed in seeds if method in runs[seed]]
            if have:
                stats[method] = ([s["test_accuracy"] for s in have], [math.exp(s["test_loss"]) for s in have])
        for method, (accuracy, perplexity) in stats.items():
            base_name = next((method.replace(f"values={spec}", "values=fp32") for spec in lossy
                              if f"values={spec}," in method), method)
            base = stats.get(base_name, (accuracy, perplexity))
            rows.append([model, method, str(len(accuracy)), f"{100 * statistics.mean(accuracy):.2f}",
                         f"{100 * (statistics.stdev(accuracy) if len(accuracy) > 1 else 0):.2f}",
                         f"{100 * (statistics.mean(accuracy) - statistics.mean(base[0])):+.2f}",
                         f"{statistics.mean(perplexity):.3f}",
                         f"{100 * (statistics.mean(perplexity) / statistics.mean(base[1]) - 1):+.2f}%"])
    from gradwire.tables import format_table

    print(f"\n2 workers, {args.epochs} epochs, seeds {args.seeds}; LSTM text: {args.text}")
    print(format_table(["model", "method", "seeds", "test acc %", "sd", "vs fp32 (points)", "test ppl", "vs fp32"],
                       rows))


if __name__ == "__main__":
    main()
