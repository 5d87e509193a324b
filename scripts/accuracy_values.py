"""Accuracy of lossy value codecs against fp32 values at the same top-k density (issue 12, item 5).

For each model (the MNIST-5k CNN; the byte-level LSTM LM on a Python standard-library source
file, which ships with every Python) and each seed, one ``gradwire train`` launch (2 workers)
runs every method from the same initial model; the table gives, per method, the mean and
spread over seeds of the test accuracy and (LSTM) the test perplexity exp(mean loss per byte),
and the difference to the fp32-values method of the same density.

    PYTHONPATH=src python scripts/accuracy_values.py --seeds 0,1,2 --out bench-out/accuracy-values
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import sysconfig

#: the lossy pair that meets the LSTM-LM top-10% volume target (0.0197 <= 0.02, bench codecs):
#: two magnitudes per bucket (its smallest and largest) and the sign, nearest level, ANS-coded
LOSSY = "qsgd-ans,levels=1,norm=range,rounding=nearest"


def methods(lossy: str) -> list[str]:
    return [f"topk:density={d},values={v},indices=rice" for d in ("0.01", "0.1") for v in ("fp32", lossy)]


def launch(model: str, seed: int, args: argparse.Namespace, out: str) -> list[dict]:
    path = os.path.join(out, f"{model}-seed{seed}.json")
    if os.path.exists(path):  # resume: a finished launch is not rerun
        with open(path) as handle:
            return json.load(handle)
    command = [sys.executable, "-m", "gradwire", "train", "--model", model, "--workers", "2", "--seed", str(seed),
               "--epochs", str(args.epochs), "--timeout", str(args.timeout), "--json", path]
    if model == "lstm":
        command += ["--text", args.text, "--lr", str(args.lstm_lr)]
    for method in methods(args.lossy):
        command += ["--method", method]
    print("$", " ".join(command), flush=True)
    subprocess.run(command, check=True, timeout=args.timeout + 120)
    with open(path) as handle:
        return json.load(handle)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--models", default="cnn,lstm")
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--lossy", default=LOSSY, help=f"value codec (and options) compared with fp32 (default {LOSSY})")
    parser.add_argument("--text", default=os.path.join(sysconfig.get_paths()["stdlib"], "argparse.py"))
    parser.add_argument("--lstm-lr", type=float, default=0.05)
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--out", default="bench-out/accuracy-values")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    seeds = [int(s) for s in args.seeds.split(",")]
    rows = []
    for model in args.models.split(","):
        runs = {seed: launch(model, seed, args, args.out) for seed in seeds}
        stats = {}
        for method in methods(args.lossy):
            accuracy = [next(s for s in runs[seed] if s["method"] == method)["test_accuracy"] for seed in seeds]
            loss = [next(s for s in runs[seed] if s["method"] == method)["test_loss"] for seed in seeds]
            stats[method] = (accuracy, [math.exp(x) for x in loss])
        for method, (accuracy, perplexity) in stats.items():
            base = stats[method.replace(f"values={args.lossy}", "values=fp32")]
            rows.append([model, method, f"{100 * statistics.mean(accuracy):.2f}",
                         f"{100 * (statistics.stdev(accuracy) if len(accuracy) > 1 else 0):.2f}",
                         f"{100 * (statistics.mean(accuracy) - statistics.mean(base[0])):+.2f}",
                         f"{statistics.mean(perplexity):.3f}",
                         f"{100 * (statistics.mean(perplexity) / statistics.mean(base[1]) - 1):+.2f}%"])
    from gradwire.tables import format_table

    print(f"\n2 workers, {args.epochs} epochs, seeds {args.seeds}; LSTM text: {args.text}")
    print(format_table(["model", "method", "test acc %", "sd", "vs fp32 (points)", "test ppl", "vs fp32"], rows))


if __name__ == "__main__":
    main()
