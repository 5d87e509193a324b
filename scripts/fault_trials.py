"""Kill one of 3 gloo ranks mid-training, many times, and report how the survivors fail.

    python scripts/fault_trials.py --trials 10               # every collective
    python scripts/fault_trials.py --trials 3 --collectives dense,auto

Per collective: trials, survivors that raised, the slowest survivor's seconds from the death to
its raise, and optimizer steps taken after the death (must be 0). Uses the test suite's worker
(tests/test_faults.py), so the script and the test measure the same thing.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.test_faults import KILL_CASES, kill_trial  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=10)
    parser.add_argument("--collectives", default=",".join(sorted(KILL_CASES)))
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    print(f"{'collective':<16} {'trials':>6} {'raised':>7} {'max s after death':>18} {'steps after death':>18}")
    for case in args.collectives.split(","):
        raised = total = late_steps = 0
        slowest = 0.0
        for trial in range(args.trials):
            victim = 1 + trial % 2  # alternate which rank dies
            for report in kill_trial(case, victim=victim):
                total += 1
                raised += report["error"] is not None
                late_steps += max(0, report["steps"] - 3)
                if report["seconds_after_death"] is not None:
                    slowest = max(slowest, report["seconds_after_death"])
        print(f"{case:<16} {args.trials:>6} {raised:>3}/{total:<3} {slowest:>18.2f} {late_steps:>18}", flush=True)


if __name__ == "__main__":
    main()
