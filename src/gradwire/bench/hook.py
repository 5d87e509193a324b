"""``gradwire bench hook``: the hook's CPU per step, by phase, against a one-pass memory floor.

One process, one thread (``--threads``), a process group of one rank, so what is timed is the
hook's own work and nothing on the wire. For each model (its real parameter shapes; the gradients
are real backward passes of ``--batches`` different synthetic batches, taken in turn step after
step: one gradient repeated would hand the sparse AllReduce's threshold search the very
threshold of the step before) and each method (a method
spec, as ``gradwire train`` takes it), the model's gradients are cut into DDP-like buckets
(reverse order, 25 MiB) and every step runs the core exactly as the DDP hook does: each bucket's
``Pipeline.start``, then the round's ``Pipeline.finish``. Reported per step (medians of
``--repeats`` steps after ``--warmup`` untimed ones):

* the phases the core times itself: ``check`` (finite/unused), ``compensate`` (error feedback),
  ``select`` (the sparsifier), ``encode``, ``decode`` (this rank's own result), ``agree`` (the
  round's end: digest, agreement);
* ``decode/peer``: decoding one peer's payload, as every rank does ``p - 1`` times per step with
  the payload AllGather (a one-rank group has no peers, so it is timed here on this rank's own
  payloads, outside the hook);
* ``hook`` = the wall time of the step's hook calls plus one ``decode/peer`` (a 2-rank step);
* ``floor``: one ``torch.add(a, b, out=c)`` over the model's numel, timed in the same rounds;
  ``passes`` = hook / floor.

Rounds interleave the floor and every method, the methods in reverse order every other round,
so a burst of load from other processes, and what the previous method left in the caches, hit
them alike; on a shared machine compare rows of one run, not runs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist

from ..core.config import ExchangeConfig
from ..core.group import BufferTarget, Entry, Group
from ..core.payload import Part, decode_bucket, encode_bucket
from ..core.pipeline import Pipeline
from ..tables import format_table
from ..cli.main import json_path_error

DEFAULT_MODELS = ("resnet18", "mlp", "lstm", "transformer")
DEFAULT_METHODS = (
    "topk:density=0.01,values=fp16,indices=rice,collective=allgather",
    "topk:density=0.01,values=fp16,indices=rice,collective=sparse-allreduce",
    "topk:density=0.01,values=fp32,indices=eliasfano,collective=allgather",
    "randomblock:density=0.01,values=fp16,collective=allreduce",
    "none",
)
TIMED_PHASES = ("check", "compensate", "select", "encode", "decode", "agree")
BUCKET_BYTES = 25 * 2**20


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``gradwire bench hook``'s options to ``parser`` (:mod:`gradwire.cli.main` calls it)."""
    parser.add_argument("--models", default=",".join(DEFAULT_MODELS),
                        help=f"comma-separated shipped models (default {','.join(DEFAULT_MODELS)})")
    parser.add_argument("--methods", action="append", default=None, metavar="SPEC",
                        help="a method spec as gradwire train takes it (repeatable; 'none' is the dense AllReduce); "
                             "default: top-k 1%% fp16/Rice AllGather and sparse AllReduce, top-k 1%% fp32/Elias-Fano, "
                             "randomblock 1%% fp16 AllReduce, none")
    parser.add_argument("--repeats", type=int, default=7, help="timed steps per method (median reported; default 7)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first (frame sizes, buffers; default 2)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument("--batches", type=int, default=4,
                        help="distinct gradients (backward passes of different synthetic batches), taken in turn "
                             "step after step (default 4)")
    parser.add_argument("--json", metavar="PATH", help="also write every row as JSON")


def run(args: argparse.Namespace) -> int:
    """Run ``gradwire bench hook``: measure and print the table; returns 0, or 2 on a bad option."""
    problem = json_path_error(args.json)
    if problem is not None:
        print(f"gradwire bench hook: {problem}", file=sys.stderr)
        return 2
    try:
        models = [m.strip() for m in args.models.split(",") if m.strip()]
        methods = list(args.methods or DEFAULT_METHODS)
        options = {method: _options(method) for method in methods}
        if args.repeats < 1 or args.warmup < 0 or args.threads < 1 or args.batches < 1:
            raise ValueError(f"--repeats={args.repeats} must be >= 1, --warmup={args.warmup} >= 0, "
                             f"--threads={args.threads} >= 1 and --batches={args.batches} >= 1")
        from ..harness.models import MODELS

        for model in models:
            if model not in MODELS:
                raise ValueError(f"--models: {model!r} is not supported; allowed: {', '.join(MODELS)}")
    except ValueError as error:
        print(f"gradwire bench hook: error: {error}", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    rows: list[dict[str, Any]] = []
    with _one_rank_group():
        for model in models:
            gradients = _gradients(model, args.batches)
            rows.extend(measure(model, gradients, options, repeats=args.repeats, warmup=args.warmup))
    print(format_table(("model", "method", "numel", "floor ms", *(f"{p} ms" for p in TIMED_PHASES),
                        "decode/peer ms", "hook ms", "passes"),
                       [(r["model"], r["method"], f"{r['numel']:,}", f"{r['floor_ms']:.2f}",
                         *(f"{r[p + '_ms']:.2f}" for p in TIMED_PHASES), f"{r['decode_peer_ms']:.2f}",
                         f"{r['hook_ms']:.2f}", f"{r['passes']:.1f}x") for r in rows]))
    print(f"\nfloor: one torch.add(a, b, out=c) over the numel, {args.threads} thread(s), same rounds; "
          f"hook = the step's hook calls + one peer's decode (a 2-rank step); {args.batches} distinct gradient(s) "
          "in turn")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump({"threads": args.threads, "repeats": args.repeats, "batches": args.batches, "rows": rows},
                      handle, indent=2)
    return 0


def measure(model: str, gradients: list[list[torch.Tensor]], options: dict[str, dict[str, Any]], *, repeats: int,
            warmup: int) -> list[dict[str, Any]]:
    """Per method, the medians of ``repeats`` steps (see the module docstring) as table rows.

    Args:
        gradients: one or more sets of the model's gradients (one tensor per parameter, the same
            shapes in every set); step i of every method takes set ``i % len(gradients)``.
    """
    numel = sum(g.numel() for g in gradients[0])
    a, b, c = torch.randn(numel), torch.randn(numel), torch.empty(numel)
    runs = {method: _Run(ExchangeConfig(**opts), gradients) for method, opts in options.items()}
    for _ in range(warmup):
        for run_ in runs.values():
            run_.step()
    floor: list[float] = []
    order = list(runs.values())
    for repeat in range(repeats):
        start = time.perf_counter()
        torch.add(a, b, out=c)
        floor.append(time.perf_counter() - start)
        # every other round in reverse: each method follows the floor and each neighbour alike
        # (what ran before moves a step's time by 10-25% here: it leaves the caches in its state)
        for run_ in (order if repeat % 2 == 0 else order[::-1]):
            run_.record(run_.step())
    floor_ms = statistics.median(floor) * 1e3
    rows = []
    for method, run_ in runs.items():
        row: dict[str, Any] = {"model": model, "method": method, "numel": numel, "floor_ms": floor_ms}
        for phase in (*TIMED_PHASES, "decode_peer", "hook"):
            row[phase + "_ms"] = statistics.median(run_.samples[phase]) * 1e3
        row["passes"] = row["hook_ms"] / floor_ms
        row["count_selections_per_step"] = run_.selections
        rows.append(row)
    return rows


class _Run:
    """One method on one model's gradients: the core, its buckets, and the per-step samples."""

    def __init__(self, config: ExchangeConfig, gradient_sets: list[list[torch.Tensor]]) -> None:
        self.pipeline = Pipeline(config)
        self.gradient_sets = gradient_sets
        shapes = gradient_sets[0]
        self.buckets: list[list[int]] = []
        size = BUCKET_BYTES
        for index in reversed(range(len(shapes))):
            if size >= BUCKET_BYTES:
                self.buckets.append([])
                size = 0
            self.buckets[-1].append(index)
            size += shapes[index].numel() * shapes[index].element_size()
        self.buffers = [torch.zeros(sum(shapes[i].numel() for i in bucket)) for bucket in self.buckets]
        self.samples: dict[str, list[float]] = {key: [] for key in (*TIMED_PHASES, "decode_peer", "hook")}
        self.step_index = 0
        self.selections = 0.0

    def step(self) -> dict[str, float]:
        gradients = self.gradient_sets[self.step_index % len(self.gradient_sets)]
        groups = []
        for bucket, buffer in zip(self.buckets, self.buffers):
            group, offset = Group(BufferTarget([buffer]), divisor=1.0), 0
            for index in bucket:
                view = buffer[offset: offset + gradients[index].numel()]
                view.copy_(gradients[index].reshape(-1))  # what backward would have written
                group.entries.append(Entry(index, index, view, offset))
                offset += view.numel()
            groups.append(group)
        stats = self.pipeline.stats
        before = stats.total.get("count_selections", 0.0)
        start = time.perf_counter()
        in_flight = []
        for group in groups:
            in_flight.append(self.pipeline.start(group, self.step_index))
            self.pipeline.poll(in_flight)
        verdict = self.pipeline.finish(groups, in_flight, self.step_index)
        hook = time.perf_counter() - start
        if verdict.error is not None:
            raise verdict.error
        phases = {phase: stats.current.get(f"seconds_{phase}", 0.0) for phase in TIMED_PHASES}
        self.selections = stats.total.get("count_selections", 0.0) - before
        phases["decode_peer"] = self._decode_peer(groups)
        phases["hook"] = hook + phases["decode_peer"]
        stats.end_step()
        self.step_index += 1
        return phases

    def record(self, phases: dict[str, float]) -> None:
        for key, value in phases.items():
            self.samples[key].append(value)

    def _decode_peer(self, groups: list[Group]) -> float:
        """Seconds to decode this step's payloads as a peer would (payload exchanges only)."""
        config = self.pipeline.config
        if config.compressor == "none" or (self.pipeline.sparsifier is not None
                                           and self.pipeline.sparsifier.shared_support
                                           and config.collective in ("auto", "allreduce")):
            return 0.0  # dense and shared-support AllReduces decode nothing
        seconds = 0.0
        for group in groups:
            if not all(e.indices is not None and e.compensated is not None for e in group.entries):
                continue
            parts = [Part(e.compensated, e.indices, e.offset) for e in group.entries]
            encoded = encode_bucket(parts, group.numel, index_codec=config.index_codec, value_codec=config.value_codec)
            start = time.perf_counter()
            decode_bucket(memoryview(encoded.payload), [e.numel for e in group.entries],
                          [e.offset for e in group.entries], group.numel, index_codec=config.index_codec)
            seconds += time.perf_counter() - start
        return seconds


def _options(method: str) -> dict[str, Any]:
    from ..harness.methods import TORCH_HOOKS, parse_method

    if method == "none":
        return {"compressor": "none"}
    spec = parse_method(method)
    if spec.communication.name in TORCH_HOOKS or spec.pufferfish is not None:
        raise ValueError(f"method {method!r}: bench hook times gradwire compressors only (or 'none')")
    options = spec.hook_options()
    ExchangeConfig(**options)  # a bad option fails here, before any model is built
    return options


def _gradients(model_name: str, batches: int = 1) -> list[list[torch.Tensor]]:
    """``batches`` real backward passes of ``model_name``, each on its own synthetic batch: per
    batch, the gradients (float32, one per parameter; zeros where a parameter got none)."""
    from ..harness.models import build_model

    torch.manual_seed(0)
    model = build_model(model_name)
    sets = []
    for _ in range(batches):
        model.zero_grad(set_to_none=True)
        output = model(model.example_input(4))  # a fresh random batch each time
        output = output[0] if isinstance(output, tuple) else output
        (output.float() ** 2).mean().backward()
        sets.append([p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)
                     for p in model.parameters()])
    return sets


class _one_rank_group:
    """A gloo process group of one rank (a file store in a temp folder), torn down after."""

    def __enter__(self) -> None:
        self.folder = tempfile.TemporaryDirectory(prefix="gradwire-bench-hook-")
        if not dist.is_initialized():
            dist.init_process_group("gloo", init_method=f"file://{os.path.join(self.folder.name, 'store')}",
                                    rank=0, world_size=1)
            self.owned = True
        else:
            self.owned = False

    def __exit__(self, *exc_info: object) -> None:
        if self.owned:
            dist.destroy_process_group()
        self.folder.cleanup()
