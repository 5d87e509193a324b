"""Which strategy a group takes, and what selection it needs first: :class:`Planner`.

The fixed rules (warm-up and ``compressor="none"`` go dense, ``quantize`` takes the quantized
AllReduce, shared supports take the AllReduce of values or the payload AllGather,
``collective=...`` names one) and, for ``collective="auto"``, the cost model's per-layout choice
(:mod:`.costs`) checked on real rounds (:mod:`.online`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence

import torch.distributed as dist

from ..exchange.alphabeta import Link
from ..exchange.checked import group_rank
from ..sparsify.base import Sparsifier
from .config import CAST_VALUE_CODECS, ExchangeConfig
from .costs import Calibration, calibrate, candidates, entry_bytes, predicted_seconds
from .group import Group
from .online import DENSE, FIRST_TRIAL_AFTER, MODEL, OnlineChoice
from .strategies.hierarchical import local_size_of

#: In-node links for the hierarchical candidate of ``auto`` (shared memory or NVLink class: an
#: assumption, not a measurement — the model only needs them far faster than the network).
IN_NODE_LINK = Link(5e-6, 1e-10)

#: What a group needs before its strategy starts.
NO_SELECTION, COMPENSATE, SELECT = "none", "compensate", "select"


@dataclass(frozen=True)
class Plan:
    """A group's strategy (a key of the pipeline's strategies) and the selection it needs first:
    ``"none"`` (raw gradients), ``"compensate"`` (``grad + residual`` only: a dense send of what is
    owed, or an exchange that selects on something else) or ``"select"`` (compensate, then the
    sparsifier). ``detect_unused``: an all-zero gradient keeps its residual whole (see
    :class:`~.selection.Selection`); off where the exchange sums before it selects."""

    strategy: str
    selection: str
    detect_unused: bool = True


class Planner:
    """Chooses, the same way on every rank, how each group travels.

    1. ``quantize`` (after the warm-up): the quantized dense AllReduce; no sparsifier, a warm-up
       step, or ``collective="dense"``: dense AllReduce of the raw gradients;
    2. a shared support (randomk, randomblock): select (even on a non-finite rank, so the supports
       agree in size), then the AllReduce of values when the value codec is a cast, else the
       payload AllGather;
    3. a per-rank support: the configured collective, or for ``"auto"`` the cost model's choice for
       the group's layout (computed once per layout; the link and CPU costs are calibrated at
       first use, a blocking collective every rank runs at the same group); a non-finite rank does
       not select (the pipeline drops the selection once its check found NaN/Inf: its exchange
       announces NaN instead);
    4. with ``collective="auto"`` (2 and 3) on more than one rank, the round's *policy*
       (:class:`~.online.OnlineChoice`) may override the model: ``"dense"``, or one strategy forced
       on every layout, while a trial measures them, or after it, when one measured faster;
       a dense send needs compensation only, no selection.

    ``group.k`` (the second selection's count: the sum of the sparsifier's per-entry targets) is
    set here for the strategies that reduce before they select.
    """

    def __init__(self, config: ExchangeConfig, sparsifier: Optional[Sparsifier],
                 process_group: Optional[dist.ProcessGroup], world_size: int) -> None:
        self.config = config
        self.sparsifier = sparsifier
        self.process_group = process_group
        self.world_size = world_size
        self.calibration: Optional[Calibration] = None
        #: the ``auto`` choice per group layout (``Group.signature()``)
        self.choices: dict[tuple[int, ...], str] = {}
        #: the model's predicted seconds per strategy, per layout
        self.predictions: dict[tuple[int, ...], dict[str, float]] = {}
        self.online: Optional[OnlineChoice] = (
            self._new_online() if config.collective == "auto" and sparsifier is not None and world_size > 1 else None)
        self._first_online_round: Optional[int] = None
        self._last_agreement: Optional[float] = None
        #: the online policy of the latest round that asked for one (a trial's candidate, or the current)
        self._last_policy: Optional[str] = None

    def _new_online(self) -> OnlineChoice:
        """The online check; rank 0 of the process group says when dense won (once, not per rank)."""
        return OnlineChoice(announce=group_rank(self.process_group) == 0)

    def reset(self) -> None:
        """Forget the per-layout choices and measurements (a checkpoint was loaded: every rank
        chooses again from the same point)."""
        self.choices, self.predictions = {}, {}
        if self.online is not None:
            self.online = self._new_online()
        self._first_online_round, self._last_agreement, self._last_policy = None, None, None

    # ---------------------------------------------------------------------------- choosing
    def plan(self, group: Group, step: int) -> Plan:
        config = self.config
        if group.sharded:  # FSDP2's reduce-scatter (strategies/reduce_scatter.py)
            # a shard group's strategy is fixed by its family (dense, quantized or sparse
            # reduce-scatter): there is nothing for auto's online check to time against
            self.online = None
            return plan_shard_group(config, self.sparsifier, group, step)
        if config.quantize is not None and step >= config.warmup_steps:
            return Plan("quantized", NO_SELECTION)
        if self.sparsifier is None or step < config.warmup_steps or config.collective == "dense":
            return Plan("dense", NO_SELECTION)
        policy = self._policy(step)
        if policy == DENSE:
            return Plan("dense", COMPENSATE)
        if self.sparsifier.shared_support:
            cast = config.value_codec.name in CAST_VALUE_CODECS
            strategy = "allreduce" if config.collective == "allreduce" or (config.collective == "auto" and cast) \
                else "allgather"
            return Plan(strategy, SELECT)
        strategy = self._per_rank_strategy(group, policy)
        if strategy == "dense":
            return Plan("dense", COMPENSATE)
        if strategy in ("sparse-allreduce", "hierarchical"):
            group.k = self.target_k(group)
        if strategy == "hierarchical":
            return Plan(strategy, COMPENSATE, detect_unused=False)
        return Plan(strategy, SELECT)  # the pipeline drops the selection on a non-finite rank

    def target_k(self, group: Group) -> int:
        """The group's k for a second selection: the sum of the sparsifier's per-entry targets
        (the same on every rank); every entry when the sparsifier has no target (threshold)."""
        assert self.sparsifier is not None
        return target_k(self.sparsifier, group)

    def local_size(self) -> int:
        """Ranks per node (1 without ``hierarchy``)."""
        if self.config.hierarchy is None:
            return 1
        return local_size_of(self.config.hierarchy, self.world_size)

    # ------------------------------------------------------------------ measured rounds
    def round_extras(self) -> list[int]:
        """What this rank adds to the round's agreement: nanoseconds since the last agreement
        (0 before the first), when the online check runs; nothing otherwise (every rank alike)."""
        if self.online is None:
            return []
        now = time.perf_counter()
        elapsed = 0.0 if self._last_agreement is None else now - self._last_agreement
        self._last_agreement = now
        return [int(elapsed * 1e9)]

    def observe(self, step: int, extras: Sequence[Sequence[int]], applied: bool) -> None:
        """The agreed extras of round ``step`` (every rank's), after its agreement."""
        if self.online is None or not extras:
            return
        seconds = [row[0] / 1e9 for row in extras] if applied and all(row[0] > 0 for row in extras) else None
        if seconds is None:  # a failed or skipped round, or the first: it ran, but its time does not count
            self.online.observe(step, [])
        else:
            self.online.observe(step, seconds)

    def summary(self) -> dict[str, object]:
        """``auto``'s policy and measured times for ``stats()`` (empty when not measuring), and
        ``auto_ran``: the policy the latest round ran under — during a trial, the candidate it timed
        (``auto_policy`` is the one kept), so per-step records show where a trial ran."""
        if self.online is None:
            return {}
        out = self.online.summary()
        if self._last_policy is not None:
            out["auto_ran"] = self._last_policy
        return out

    def state_dict(self) -> Optional[dict[str, Any]]:
        """What a checkpoint keeps of the planner, or None when it keeps nothing (not ``auto``):
        the per-layout choices and predictions and the online state — numbers and strings, the same
        on every rank —, so a resumed run continues with the choices it had, not a new
        calibration's (timed on another machine state, it may differ)."""
        if self.config.collective != "auto":
            return None
        return {"choices": [[list(layout), name] for layout, name in self.choices.items()],
                "predictions": [[list(layout), dict(seconds)] for layout, seconds in self.predictions.items()],
                "online": self.online.state_dict() if self.online is not None else None,
                "first_online_round": -1 if self._first_online_round is None else self._first_online_round}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` output. Raises ``ValueError`` naming a malformed field."""
        try:
            choices = {tuple(int(x) for x in layout): str(name) for layout, name in state.get("choices", [])}
            predictions = {tuple(int(x) for x in layout): {str(n): float(v) for n, v in seconds.items()}
                           for layout, seconds in state.get("predictions", [])}
            first = int(state.get("first_online_round", -1))
        except (TypeError, ValueError, AttributeError) as error:
            raise ValueError(f"hook state: 'planner' is malformed ({error!r})") from None
        online = None
        if self.online is not None and state.get("online") is not None:
            online = self._new_online()
            online.load_state_dict(state["online"])
        self.choices, self.predictions = choices, predictions
        if online is not None:
            self.online = online
        self._first_online_round = None if first < 0 else first

    def _policy(self, step: int) -> str:
        """The online policy of round ``step``: trials start ``FIRST_TRIAL_AFTER`` rounds under the
        model after the first (the model's per-layout choices are then known, and so is its
        strongest competitor)."""
        online = self.online
        if online is None:
            return MODEL
        if self._first_online_round is None:
            self._first_online_round = step
        if step >= self._first_online_round + FIRST_TRIAL_AFTER and online.due(step):
            online.start_trial(step, self._candidates(online.current))
        self._last_policy = online.policy(step)
        return self._last_policy

    def _candidates(self, current: str) -> list[str]:
        """The current policy, dense, the model's choices, the model's best non-dense strategy
        that it did not choose (its runner-up, forced on every layout): the strongest competitor
        whether the model chose dense everywhere or a sparse path; and, where the model mixed two
        or more non-dense strategies over its layouts, each of them forced on every layout.

        Why the last: the model prices each layout alone, and a mix runs two kinds of rounds in one
        step (the sparse AllReduce's extra length and threshold rounds beside the AllGather's one),
        which no per-layout price sees. ResNet-18 at 1 Gbit/s, p = 4, kept such a mix at 1.06x the
        AllGather forced everywhere (docs/benchmarks.md, 2026-12-07), a candidate it never tried."""
        chosen = set(self.choices.values())
        names = [current, DENSE, MODEL]
        totals: dict[str, float] = {}
        for seconds in self.predictions.values():
            for name, value in seconds.items():
                if name != "dense" and name not in chosen and name in self._forceable():
                    totals[name] = totals.get(name, 0.0) + value
        if totals:
            names.append(min(totals, key=totals.get))
        mixed = sorted(chosen - {"dense"})
        if len(mixed) > 1:
            names.extend(mixed)
        if chosen <= {"dense"}:
            names = [name for name in names if name != MODEL]  # the model is dense here
        return list(dict.fromkeys(name for name in names if name in (DENSE, MODEL) or name in self._forceable()))

    def _forceable(self) -> set[str]:
        names = {"allgather"}
        if self.config.index_codec.lossless:
            names.add("sparse-allreduce")
            if self.local_size() > 1:
                names.add("hierarchical")
        return names

    def _per_rank_strategy(self, group: Group, policy: str) -> str:
        """allgather / sparse-allreduce / hierarchical / dense for a per-rank support."""
        config = self.config
        if config.collective == "sparse-allreduce":
            return "hierarchical" if self.local_size() > 1 else "sparse-allreduce"
        if config.collective != "auto" or self.world_size == 1:
            return "allgather"
        signature = group.signature()
        if signature not in self.choices:  # a new layout (choices of known ones come back from checkpoints)
            if self.calibration is None:
                self.calibration = calibrate(self.process_group, self.world_size, index_codec=config.index_codec,
                                             value_codec=config.value_codec, link_gbit=config.link_gbit,
                                             link_alpha=config.link_alpha, sparsifier=self.sparsifier,
                                             device=group.device)
            k = self.target_k(group)
            costs = candidates(numel=group.numel, k=k, world_size=self.world_size,
                               bytes_per_entry=entry_bytes(config.index_codec, config.value_codec, numel=group.numel,
                                                           k=k),
                               sparse_allreduce=config.index_codec.lossless, local_size=self.local_size(),
                               calibration=self.calibration)
            self.predictions[signature] = predicted_seconds(self.calibration, costs, intra=IN_NODE_LINK)
            self.choices[signature] = _cheapest(self.predictions[signature])
        if policy == MODEL:
            return self.choices[signature]
        return policy


def _cheapest(seconds: dict[str, float]) -> str:
    """:func:`~gradwire.exchange.alphabeta.choose` over predicted seconds: never a strategy
    predicted no faster than dense; ties go to the earlier name."""
    from ..exchange.alphabeta import STRATEGIES

    order = {name: i for i, name in enumerate(STRATEGIES)}
    best = min(seconds, key=lambda name: (seconds[name], order.get(name, len(order))))
    return best if seconds[best] < seconds["dense"] else "dense"


def plan_shard_group(config: ExchangeConfig, sparsifier: Optional[Sparsifier], group: Group, step: int) -> Plan:
    """A shard group's reduce-scatter (strategies/reduce_scatter.py): quantized when ``quantize`` is
    set, sparse with a sparsifier (selection per entry, i.e. per parameter and destination; none
    on a non-finite rank, which announces NaN instead), else, and during the warm-up, dense."""
    if step < config.warmup_steps:
        return Plan("dense-reduce-scatter", NO_SELECTION)
    if config.quantize is not None:
        return Plan("quantized-reduce-scatter", NO_SELECTION)
    if sparsifier is None or config.collective == "dense":
        return Plan("dense-reduce-scatter", NO_SELECTION)
    return Plan("sparse-reduce-scatter", SELECT)  # none on a non-finite rank: the pipeline drops it


def target_k(sparsifier: Sparsifier, group: Group) -> int:
    """The sum of ``sparsifier``'s per-entry targets over ``group`` (every entry when it has none)."""
    total = 0
    for entry in group.entries:
        target = sparsifier.target_k(entry.numel)
        if target is None:
            return group.numel
        total += target
    return total
