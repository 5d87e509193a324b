"""``collective="auto"`` checks its choice on real steps: :class:`OnlineChoice`.

The cost model (:mod:`.costs`) predicts; on a shared CPU, a loaded link or an unusual model the
prediction can be wrong by far (it once chose a sparse path 1.84x slower than dense). So
``FIRST_TRIAL_AFTER`` rounds after the warm-up, and again every ``recheck_every`` rounds, the
planner runs real rounds with each candidate *policy* and keeps the fastest:

* ``"model"`` — the cost model's per-layout choices;
* ``"dense"`` — every group through the dense AllReduce (what compression must beat);
* the model's runner-up: its best predicted non-dense strategy that it chose for no layout,
  forced on every layout (the strongest competitor; when the model chose dense everywhere it
  replaces ``"model"``, which is then ``"dense"``);
* where the model mixed non-dense strategies over its layouts (some buckets through the
  AllGather, some through the sparse AllReduce), each of them forced on every layout: a mix runs
  both kinds of rounds in one step, a cost no per-layout price sees.

1. A trial runs every candidate in two passes, the second in reverse order (A A A B B B | B B A A A):
   each block is one warm-in round and ``trial_rounds`` counted ones (the pass's middle block runs
   on without a second warm-in). The first round of a block is not counted — it pays for the
   switch (a dense round flushes every residual; a sparse one starts from empty residuals, a first
   length round, a first threshold search) — so the counted rounds are each policy's steady state.
   (Interleaving the rounds, tried first, made every dense round a flush and every sparse round a
   restart: it measured neither as it runs.) Why two passes: on a shared machine a step's time
   drifts over tens of seconds (ResNet-18 at p = 4 on 2 cores: one fixed exchange at 2.58 s per
   step in one round of a launch and 3.03 s in the next, docs/benchmarks.md, 2026-12-07), and in
   one pass the last candidate drew whatever the machine did last. Mirrored, every candidate's
   counted rounds centre on the same round, so a drift linear over the trial moves every
   candidate's median alike and decides nothing, and a slow spell lands in one of a candidate's
   two blocks, not all of its rounds.
2. A round's time is this rank's wall time from the previous round's agreement to this one's: a
   whole training step (forward, backward with the exchanges, optimizer), measured where every
   front-end ends a round. It travels in the round's agreement, so every rank holds every rank's
   time; the round counts at the slowest rank (the maximum), which is what the step costs.
3. After the trial the candidate with the lowest median wins; another policy replaces the current
   one only when it is at least ``margin`` faster (a tie must not flip it). The margin is small
   (2%) on purpose: it is a band in which ``auto`` keeps a slower policy, so it adds to what
   ``auto`` may lose against the fastest one. At 5% it was the whole of issue 17's budget:
   ResNet-18 at 1 Gbit/s, p = 4, two trials measured the AllGather 3.6% and 2.7% faster than the
   model, kept the model, and the fixed AllGather then ran 7% faster than ``auto`` in the same
   launches (docs/benchmarks.md, 2026-12-07, r7). A switch on noise costs at most the noise; the
   trial's counted rounds agreed with the fixed rows timed over the same steps within 4%. The
   decision is a pure function of agreed numbers: every rank switches on the same round.
4. When dense wins, that is said once in the log, by one rank (the planner's rank 0; the decision
   is every rank's, and 64 identical warnings say nothing more): compression cannot win on this
   link (the hook's work costs more than the bytes it saves).
"""

from __future__ import annotations

import logging
import statistics
from typing import Any, Mapping, Optional, Sequence

logger = logging.getLogger("gradwire")

MODEL, DENSE = "model", "dense"
#: counted rounds per candidate and pass of a trial (after one warm-in round each; two passes)
TRIAL_ROUNDS = 2
#: rounds under the model before the first trial: the first rounds pay one-off costs (frame sizes,
#: first threshold searches, allocations, the calibration itself) that say nothing of the steady state
FIRST_TRIAL_AFTER = 8
#: rounds between two trials
RECHECK_EVERY = 200
#: another policy must be this much faster (relative) to replace the current one (module docstring, 3)
MARGIN = 0.02


def trial_schedule(candidates: Sequence[str], counted: int) -> list[str]:
    """The policy of each round of a trial: two passes over ``candidates``, the second reversed,
    each block a warm-in round and ``counted`` counted ones; the second pass's first block continues
    the first pass's last (no warm-in: its policy did not change). Every candidate gets ``2 *
    counted`` counted rounds whose mean position is the same for all."""
    first = [name for name in candidates for _ in range(1 + counted)]
    mirrored = list(reversed(candidates))
    second = [mirrored[0]] * counted + [name for name in mirrored[1:] for _ in range(1 + counted)]
    return first + second


class OnlineChoice:
    """The policy each round runs under, and the measured times that decide it (module docstring).

    Args:
        trial_rounds: counted rounds per candidate in each of a trial's two passes.
        recheck_every: rounds between trials (after the first).
        margin: relative speed-up another policy needs to replace the current one.
        announce: whether this rank logs that dense won (module docstring, 4).
    """

    def __init__(self, *, trial_rounds: int = TRIAL_ROUNDS, recheck_every: int = RECHECK_EVERY,
                 margin: float = MARGIN, announce: bool = True) -> None:
        if trial_rounds < 1 or recheck_every < 1 or not 0 <= margin < 1:
            raise ValueError(f"trial_rounds={trial_rounds} and recheck_every={recheck_every} must be >= 1 and "
                             f"margin={margin} in [0, 1)")
        self.trial_rounds, self.recheck_every, self.margin = trial_rounds, recheck_every, margin
        #: whether this instance logs the decision (step 4): one rank's, as the decision is every rank's
        self.announce = announce
        self.current = MODEL
        self.candidates: list[str] = []
        #: round index -> the policy it ran under, for the rounds of the current trial
        self._schedule: dict[int, str] = {}
        self._trial_start: Optional[int] = None
        self._samples: dict[str, list[float]] = {}
        #: the last finished trial's median seconds per candidate
        self.measured: dict[str, float] = {}
        #: the last finished trial's counted rounds per candidate, in the order they ran (seconds,
        #: at the slowest rank): what the medians were taken over, for stats(); not checkpointed
        self.counted: dict[str, list[float]] = {}
        self.trials = 0
        self.switches: list[tuple[int, str]] = []
        self._said_dense = False

    def start_trial(self, round_index: int, candidates: Sequence[str]) -> None:
        """Plan a trial from ``round_index`` on over ``candidates`` (the current policy first)."""
        self.candidates = list(dict.fromkeys(candidates))
        self._samples = {name: [] for name in self.candidates}
        self._trial_start = round_index
        # in blocks: a policy's first round pays for the switch (dense flushes every residual, a
        # sparse path starts from empty ones and learns frame sizes); its next rounds are its steady
        # state. The second pass mirrors the first, its first block continuing the last one's policy
        self._schedule = {round_index + i: name for i, name in enumerate(trial_schedule(self.candidates,
                                                                                        self.trial_rounds))}

    @property
    def in_trial(self) -> bool:
        return self._trial_start is not None

    def due(self, round_index: int) -> bool:
        """Whether a trial should start at ``round_index`` (the first one, or a recheck)."""
        if self.in_trial:
            return False
        return self.trials == 0 or round_index - self._last_trial_end >= self.recheck_every

    def policy(self, round_index: int) -> str:
        """The policy ``round_index`` runs under."""
        return self._schedule.get(round_index, self.current)

    def observe(self, round_index: int, seconds_by_rank: Sequence[float]) -> None:
        """The agreed times of round ``round_index`` (every rank's, from the agreement; empty: the
        round ran but its time does not count — it failed, or no earlier round was timed)."""
        if not self.in_trial or round_index not in self._schedule:
            return
        assert self._trial_start is not None
        name = self._schedule[round_index]
        if seconds_by_rank and self._schedule.get(round_index - 1) == name:  # not its block's warm-in
            self._samples[name].append(max(seconds_by_rank))
        if round_index == max(self._schedule):
            self._decide(round_index)

    def summary(self) -> dict[str, object]:
        """``auto_policy``, the last trial's ``auto_seconds_<candidate>`` (per round, the slowest
        rank's median) and ``auto_rounds_<candidate>`` (the counted rounds it is the median of, in
        the order they ran), for ``stats()``."""
        out: dict[str, object] = {"auto_policy": self.current, "auto_trials": float(self.trials)}
        for name, seconds in self.measured.items():
            out[f"auto_seconds_{name}"] = seconds
        for name, rounds in self.counted.items():
            out[f"auto_rounds_{name}"] = list(rounds)
        return out

    def _decide(self, round_index: int) -> None:
        self.measured = {name: statistics.median(times) for name, times in self._samples.items() if times}
        self.counted = {name: list(times) for name, times in self._samples.items() if times}
        best = min(self.measured, key=lambda name: (self.measured[name], name != self.current), default=self.current)
        if (best != self.current and self.current in self.measured
                and self.measured[best] < (1.0 - self.margin) * self.measured[self.current]):
            self.current = best
            self.switches.append((round_index + 1, best))
        self.trials += 1
        self._last_trial_end = round_index
        self._trial_start, self._schedule = None, {}
        if self.current == DENSE and not self._said_dense and self.announce:
            self._said_dense = True
            shown = ", ".join(f"{name} {seconds:.3f} s" for name, seconds in sorted(self.measured.items()))
            logger.warning("gradwire auto: the dense AllReduce measured fastest per step (%s): compression cannot "
                           "win on this link (the hook's work costs more than the bytes it saves); staying dense",
                           shown)

    _last_trial_end = 0

    # ------------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """Everything that decides later rounds' policies, as numbers and strings (identical on every
        rank), so a resumed run continues the same schedule. A decision still to come depends on
        times measured after the resume: ``auto`` resumes exactly only where no trial ends."""
        return {"current": self.current, "trials": self.trials, "last_trial_end": self._last_trial_end,
                "trial_start": -1 if self._trial_start is None else self._trial_start,
                "candidates": list(self.candidates), "schedule": [[r, n] for r, n in sorted(self._schedule.items())],
                "samples": {n: list(v) for n, v in self._samples.items()}, "measured": dict(self.measured)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` output. Raises ``ValueError`` naming a malformed field (nothing
        is changed then)."""
        try:
            current, trials, last = str(state["current"]), int(state["trials"]), int(state["last_trial_end"])
            start = int(state["trial_start"])
            candidates = [str(n) for n in state["candidates"]]
            schedule = {int(r): str(n) for r, n in state["schedule"]}
            samples = {str(n): [float(x) for x in v] for n, v in state["samples"].items()}
            measured = {str(n): float(v) for n, v in state["measured"].items()}
        except (KeyError, TypeError, ValueError, AttributeError) as error:
            raise ValueError(f"hook state: 'planner' online state is malformed ({error!r})") from None
        self.current, self.trials, self._last_trial_end = current, trials, last
        self._trial_start = None if start < 0 else start
        self.candidates, self._schedule, self._samples, self.measured = candidates, schedule, samples, measured
