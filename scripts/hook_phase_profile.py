"""cProfile of `gradwire bench hook`'s steps for one method on one model: where the hook's CPU goes.

    python scripts/hook_phase_profile.py [--method SPEC] [--model resnet18] [--steps 10] [--top 25] [--sort cumtime]

One process and one thread, the same buckets and core calls as `gradwire bench hook` (its `_Run`).
Prints the phase medians of `--steps` unprofiled steps (after 3 untimed ones), then the functions
with the most own time over `--steps` profiled steps (divide by the steps for per-step figures);
`--sort cumtime` orders them by their time with callees instead. Profiling adds its own per-call
cost, so compare functions within one run, not with the bench.
The gradients' ``copy_`` into the buckets is the bench's stand-in for backward, outside the hook.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import sys

import torch


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--method", default="topk:density=0.01,values=fp16,indices=rice,collective=allgather")
    parser.add_argument("--model", default="resnet18")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--sort", choices=("tottime", "cumtime"), default="tottime",
                        help="order functions by own time (tottime) or with callees (cumtime)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    from gradwire.bench import hook as bench
    from gradwire.core.config import ExchangeConfig

    with bench._one_rank_group():
        run = bench._Run(ExchangeConfig(**bench._options(args.method)), bench._gradients(args.model))
        for _ in range(3):
            run.step()
        phases = [run.step() for _ in range(args.steps)]
        print(f"{args.model}, {args.method}: ms per step (medians of {args.steps})")
        print("  " + "  ".join(f"{key} {statistics.median(p[key] for p in phases) * 1e3:.2f}" for key in phases[0]))
        profile = cProfile.Profile()
        profile.enable()
        for _ in range(args.steps):
            run.step()
        profile.disable()
        pstats.Stats(profile, stream=sys.stdout).sort_stats(args.sort).print_stats(args.top)
    return 0


if __name__ == "__main__":
    sys.exit(main())
