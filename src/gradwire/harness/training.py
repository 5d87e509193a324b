"""One rank's training loop for ``gradwire train``: apply a method, train, time every phase.

Runs inside an initialized process group (launched by ``gradwire train`` or by ``torchrun``).
Per step it records loss, seconds of forward, backward (with DDP this includes waiting for the
exchange that overlaps it), optimizer, and — from the gradwire hook's own counters — seconds in
compress (sparsify + encode), communicate and decompress, and bytes sent by this rank.

In an emulated cluster (the launcher sets ``GRADWIRE_WIRE_INTERFACE``, and ``GRADWIRE_NODE_LINK``
with nodes) each method's summary also gets ``"wire"``: the bytes every rank's interface sent and
received during the measured steps (after the warm-up), read from the kernel's counters between
two barriers, and per node the bytes that crossed the node's shaped link — exact wire bytes per
method, headers included, where the launch-wide counters mix every method of the launch.

The optimizer is ``config.optimizer`` (``sgd`` with momentum, or ``adamw``; see
:mod:`~gradwire.harness.optimizers`), built through one factory that Pufferfish's ``Warmup`` also
calls when it rebuilds the optimizer for the factorized model.

After training every rank evaluates the test split: ``test_accuracy`` and ``held_out_loss`` (mean
cross-entropy per prediction over the whole split; nats per byte for the byte-level language
models, whose headline it is: ``metric`` says which number the tables show).

``compute_only=True`` runs forward+backward under ``no_sync()`` (no communication at all): the
floor that communication overhead is measured against.

A ``diloco:...`` method (:class:`gradwire.DiLoCo`) trains the model without DDP (or, with
``inner=ddp``, DDP inside each node of ``LOCAL_WORLD_SIZE`` ranks and DiLoCo across nodes); its
outer steps run from the optimizer's post-hook, so a step's ``seconds_optimizer`` includes a sync.
Its ``bytes_sent`` per step is what that step sent (a sync's burst, or nothing), and the summary's
``bytes_per_step`` is their *mean* over the measured steps (a median would be 0); ``--warmup-steps``
set to DiLoCo's warm-up leaves the synchronous steps out of it. Before the evaluation every rank
calls ``synchronize()``, so the evaluated model holds the global parameters.

``fsdp=True`` trains FSDP2 instead of DDP: every unit of :func:`~.sharding.units` is
``fully_shard``-ed (1-D, over every rank); ``allreduce`` is then plain FSDP2 (its reduce-scatter,
timed: :class:`~.sharding.TimedPlainReduceScatter`), a gradwire method installs
``gradwire.fsdp.compress`` with the method's options. Each summary
then also holds ``peak_rss_mb`` (every rank's peak resident memory, MiB, of the whole process) and
``residual_mb`` (rank 0's error-feedback residuals at the end, MiB).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from . import optimizers, resume
from ..exchange.cost import ring_allreduce_bytes
from ..lifetime import barrier, wait_for
from .methods import TORCH_HOOKS, MethodSpec, parse_method
from .workloads import Workload, build_workload, evaluate


@dataclass
class TrainConfig:
    """Everything a rank needs; JSON-serializable (the launcher hands it to workers as JSON)."""

    methods: list[str] = field(default_factory=lambda: ["allreduce", "topk:density=0.01,values=fp16,indices=rice"])
    model: str = "cnn"
    data: Optional[str] = None
    text: Optional[str] = None
    epochs: int = 1
    steps_per_epoch: Optional[int] = None
    #: total steps per method, across epochs (None: every step of every epoch)
    max_steps: Optional[int] = None
    warmup_steps: int = 0
    batch_size: int = 32
    #: "sgd" (with ``momentum``) or "adamw"
    optimizer: str = "sgd"
    #: None: the optimizer's default (sgd 0.05, adamw 2e-3), filled in on construction
    lr: Optional[float] = None
    momentum: float = 0.9
    #: None: the optimizer's default (sgd 0, adamw 0.01), filled in on construction
    weight_decay: Optional[float] = None
    seed: int = 0
    threads: int = 1
    synthetic_size: int = 2048
    evaluate: bool = True
    compute_only: bool = False
    #: with compute_only: a barrier after every backward, so ranks wait for the slowest as any
    #: synchronous exchange makes them (the floor a zero-byte exchange would reach)
    barrier_each_step: bool = False
    out: Optional[str] = None
    #: rank 0 draws a tqdm bar on stderr (for a terminal)
    progress: bool = True
    #: rank 0 prints one plain line per epoch on stderr (for logs and pipes, where a bar is noise)
    log_epochs: bool = False
    bucket_cap_mb: float = 25.0
    #: save model, optimizer and every rank's hook state here every ``checkpoint_every`` steps
    #: (and at the end), and resume from the latest on start (torchrun --max-restarts)
    checkpoint_dir: Optional[str] = None
    checkpoint_every: int = 0
    #: FSDP2 (fully_shard per unit, gradwire.fsdp.compress) instead of DDP
    fsdp: bool = False

    def __post_init__(self) -> None:
        # concrete numbers in the JSON the workers and the summaries get; validate() checks them
        if self.lr is None:
            self.lr = optimizers.DEFAULT_LR.get(self.optimizer)
        if self.weight_decay is None:
            self.weight_decay = optimizers.DEFAULT_WEIGHT_DECAY.get(self.optimizer)

    def validate(self) -> None:
        for name in ("epochs", "batch_size", "threads", "synthetic_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        for name in ("steps_per_epoch", "max_steps"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        optimizers.resolve(self.optimizer, self.lr, self.weight_decay)
        resume.check_options(self.checkpoint_dir, self.checkpoint_every)
        for spec in self.methods:
            spec_parsed = parse_method(spec)
            if self.fsdp and (spec_parsed.pufferfish is not None or spec_parsed.communication.name in FSDP_REFUSED):
                raise ValueError(f"fsdp=True: method {spec!r} is a DDP hook or changes the model; with FSDP2 use "
                                 "allreduce (plain FSDP2), a gradwire compressor or quantize:bits=8|4")
            if self.fsdp and spec_parsed.local_steps is not None:
                raise ValueError(f"fsdp=True: method {spec!r} is a local-steps method (gradwire.DiLoCo), which "
                                 "trains a plain or DDP model, not an FSDP2 one")
            if not self.fsdp and spec_parsed.communication.name not in TORCH_HOOKS \
                    and "all_gather" in spec_parsed.hook_options():
                raise ValueError(f"method {spec!r}: gather= quantizes FSDP2's parameter all-gathers; it needs --fsdp")
            if not self.fsdp and spec_parsed.communication.name not in TORCH_HOOKS \
                    and "defer" in spec_parsed.hook_options():
                raise ValueError(f"method {spec!r}: defer= is gradwire.fsdp.compress's; it needs --fsdp")
            if spec_parsed.communication.name not in TORCH_HOOKS and "momentum" in spec_parsed.hook_options() \
                    and not (self.fsdp and self.optimizer == "adamw"):
                raise ValueError(f"method {spec!r}: momentum= is 1-bit Adam's exchange for FSDP2 "
                                 "(gradwire.fsdp.MomentumAdamW); it needs --fsdp and --optimizer adamw")
            if self.checkpoint_dir and spec_parsed.pufferfish is not None:
                raise ValueError(f"checkpoint_dir: {spec!r} changes the model mid-run (pufferfish), which checkpoints "
                                 "do not cover yet")


#: DDP-only methods (PyTorch's DDP hooks)
FSDP_REFUSED = ("torch-fp16", "torch-powersgd")

#: set by the launcher in an emulated cluster: this worker's interface (inside its namespace)
WIRE_INTERFACE_ENV = "GRADWIRE_WIRE_INTERFACE"
#: with nodes: "namespace:device" of this worker's node uplink (read by local rank 0 only)
NODE_LINK_ENV = "GRADWIRE_NODE_LINK"


def _wire_reading() -> torch.Tensor:
    """int64 ``[tx, rx, node_tx, node_rx]`` bytes of this worker's interface and (local rank 0 of
    a node) its node's uplink, from the kernel's counters; -1 where there is nothing to read."""
    reading = [-1, -1, -1, -1]
    interface = os.environ.get(WIRE_INTERFACE_ENV)
    for slot, name in ((0, "tx_bytes"), (1, "rx_bytes")):
        try:
            with open(f"/sys/class/net/{interface}/statistics/{name}") as handle:
                reading[slot] = int(handle.read())
        except (OSError, ValueError):
            pass
    node_link = os.environ.get(NODE_LINK_ENV)
    if node_link and os.environ.get("LOCAL_RANK") == "0":
        namespace, _, device = node_link.partition(":")
        try:  # the node's link lives in the node's namespace, not in this worker's /sys
            text = subprocess.run(["ip", "-n", namespace, "-s", "-j", "link", "show", "dev", device],
                                  capture_output=True, text=True, timeout=10, check=True).stdout
            stats = json.loads(text)[0]["stats64"]
            reading[2], reading[3] = int(stats["tx"]["bytes"]), int(stats["rx"]["bytes"])
        except (OSError, ValueError, KeyError, IndexError, subprocess.SubprocessError):
            pass
    return torch.tensor(reading, dtype=torch.int64)


def _wire_bytes(start: torch.Tensor, end: torch.Tensor, steps: int, device: torch.device) -> dict[str, Any]:
    """Every rank's counter differences, gathered (the same dict on every rank)."""
    difference = torch.where((start >= 0) & (end >= 0), end - start, torch.full_like(start, -1)).to(device)
    gathered = [torch.empty_like(difference) for _ in range(dist.get_world_size())]
    wait_for(dist.all_gather(gathered, difference, async_op=True), None, "AllGather of wire bytes")
    rows = [row.cpu().tolist() for row in gathered]
    nodes = [row for row in rows if row[2] >= 0]
    return {"steps": steps, "tx_bytes": [row[0] for row in rows], "rx_bytes": [row[1] for row in rows],
            "node_tx_bytes": [row[2] for row in nodes], "node_rx_bytes": [row[3] for row in nodes]}


def _device() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _hook_bytes_per_step(spec: MethodSpec, parameters: int, world: int) -> float:
    """Bytes per worker per step for PyTorch's own hooks (they keep no counters)."""
    name = spec.communication.name
    if name == "allreduce":
        return ring_allreduce_bytes(parameters, 4, world)
    if name == "torch-fp16":
        return ring_allreduce_bytes(parameters, 2, world)
    return math.nan  # powerSGD: measured by difference of model sizes is not exact; reported as n/a


class LocalModel(torch.nn.Module):
    """A model trained without DDP (DiLoCo's local steps), with what the loop reads of a DDP module:
    ``.module`` and ``no_sync()`` (there is nothing to hold back)."""

    def __init__(self, module: torch.nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()


_HIERARCHIES: dict[int, Any] = {}


def _hierarchy(local_size: int) -> Any:
    """The intra- and cross-node groups for ``local_size`` ranks per node, built once per process
    (``dist.new_group`` is a collective every rank runs in the same order)."""
    if local_size not in _HIERARCHIES:
        from ..exchange.hierarchy import build_hierarchy

        _HIERARCHIES[local_size] = build_hierarchy(local_size)
    return _HIERARCHIES[local_size]


def _local_steps_groups(spec: MethodSpec) -> tuple[Any, Any]:
    """(inner DDP's group or None for no DDP, DiLoCo's group) of a diloco method."""
    assert spec.local_steps is not None
    if spec.local_steps.options.get("inner", "none") == "none":
        return None, None
    local_size = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if local_size <= 1 or dist.get_world_size() % local_size:
        raise ValueError(f"diloco inner=ddp needs nodes of several ranks (LOCAL_WORLD_SIZE={local_size}, "
                         f"world {dist.get_world_size()}): use --cluster --nodes N --workers-per-node M")
    hierarchy = _hierarchy(local_size)
    return hierarchy.intra, hierarchy.cross


def _wrap(module: torch.nn.Module, spec: MethodSpec, config: TrainConfig, device: torch.device) -> tuple[DDP, Any]:
    """DDP around ``module`` with the method's communication hook; returns (ddp, hook state). A
    diloco method: :class:`LocalModel` (or DDP inside the node) and no state yet (DiLoCo needs the
    optimizer: :func:`_local_steps`)."""
    if spec.local_steps is not None:
        intra, _ = _local_steps_groups(spec)
        if intra is None:
            return LocalModel(module), None
        return DDP(module, device_ids=[device.index] if device.type == "cuda" else None, process_group=intra,
                   bucket_cap_mb=config.bucket_cap_mb), None
    ddp = DDP(module, device_ids=[device.index] if device.type == "cuda" else None, bucket_cap_mb=config.bucket_cap_mb)
    name = spec.communication.name
    options = spec.communication.options
    if name == "allreduce":
        return ddp, None
    if name == "torch-fp16":
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
        return ddp, None
    if name == "torch-powersgd":
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

        state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=options.get("rank", 4),
                                            start_powerSGD_iter=options.get("start_iter", 2))
        ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
        return ddp, None
    import gradwire

    state = gradwire.CommHookState(model=ddp, **spec.hook_options())
    ddp.register_comm_hook(state, gradwire.comm_hook)
    return ddp, state


def _local_steps(spec: MethodSpec, model: Any, optimizer: torch.optim.Optimizer, steps_done: int) -> Any:
    """A :class:`gradwire.DiLoCo` over ``model`` (a :class:`LocalModel` or a node's DDP) stepping with
    ``optimizer``; ``steps_done`` inner steps already ran (after a Pufferfish switch), counted off
    the synchronous warm-up."""
    from ..local_steps import DiLoCo

    options = {key: value for key, value in spec.diloco_options().items() if key != "inner"}
    options["warmup_steps"] = max(0, options.get("warmup_steps", 0) - steps_done)
    _, cross = _local_steps_groups(spec)
    return DiLoCo(model.module if isinstance(model, LocalModel) else model, optimizer, process_group=cross,
                  **options)


class Sharded:
    """What the loop needs of DDP, for an FSDP2 model: calling it, ``no_sync()``, ``.module``,
    ``parameters()``, ``eval()``/``train()``."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module

    def __call__(self, *args: Any) -> Any:
        return self.module(*args)

    @contextlib.contextmanager
    def no_sync(self) -> Any:
        self.module.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            self.module.set_requires_gradient_sync(True)

    def parameters(self) -> Any:
        return self.module.parameters()

    def eval(self) -> "Sharded":
        self.module.eval()
        return self

    def train(self, mode: bool = True) -> "Sharded":
        self.module.train(mode)
        return self


def _wrap_fsdp(module: torch.nn.Module, spec: MethodSpec) -> tuple[Sharded, Any, float]:
    """FSDP2 on every unit of ``module``, with gradwire's reduce-scatter unless the method is
    ``allreduce``; returns (model, state or None, plain FSDP2's reduce-scatter bytes per rank and step)."""
    from . import sharding
    from ..fsdp import layout

    world = dist.get_world_size()
    shapes = dict(module.named_parameters())
    dense = sum((world - 1) * layout.shard_numel([tuple(shapes[n].shape) for n in names], world) * 4
                for _, names in sharding.unit_parameters(module) if names)
    model = sharding.shard(module)
    if spec.communication.name == "allreduce":  # plain FSDP2's reduce-scatter, timed
        return Sharded(model), sharding.TimedPlainReduceScatter(model, float(dense)), float(dense)
    import gradwire.fsdp

    return Sharded(model), gradwire.fsdp.compress(model, **spec.hook_options()), float(dense)


def _checkpointed(state: Any) -> Any:
    """The part of a method's state a checkpoint keeps: gradwire's (hook, FSDP2 or local-steps)
    state; None for plain FSDP2's timing wrapper, which holds nothing to resume."""
    return state if hasattr(state, "state_dict") else None


def _peak_rss_mb() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # KiB on Linux


def train_method(config: TrainConfig, spec_text: str) -> dict[str, Any]:
    """Train one method from the same seed; returns its summary (identical on every rank)."""
    spec = parse_method(spec_text)
    rank, world = dist.get_rank(), dist.get_world_size()
    device = _device()
    workload = build_workload(config.model, config.data, seed=config.seed, text=config.text,
                              synthetic_size=config.synthetic_size)
    module = workload.model.to(device)
    plain_fsdp_bytes = math.nan
    if config.fsdp:
        ddp, state, plain_fsdp_bytes = _wrap_fsdp(module, spec)
    else:
        ddp, state = _wrap(module, spec, config, device)
    holder: dict[str, Any] = {"ddp": ddp, "state": state, "plain_fsdp_bytes": plain_fsdp_bytes}

    def optimizer_factory(parameters: Any) -> torch.optim.Optimizer:
        if config.fsdp and getattr(state, "momentum_bases", None) is not None:  # momentum=: 1-bit Adam's exchange
            from ..fsdp import MomentumAdamW

            lr, weight_decay = optimizers.resolve(config.optimizer, config.lr, config.weight_decay)
            return MomentumAdamW(parameters, state, lr=lr, weight_decay=weight_decay)
        return optimizers.build_optimizer(config.optimizer, parameters, lr=config.lr,
                                          weight_decay=config.weight_decay, momentum=config.momentum)

    warmup = None
    if spec.pufferfish is not None:
        from ..lowrank import Warmup

        def rewrap(factorized: torch.nn.Module) -> DDP:
            new_ddp, new_state = _wrap(factorized, spec, config, device)
            holder["state"] = new_state
            return new_ddp

        puffer = spec.pufferfish.options
        warmup = Warmup(ddp, optimizer_factory, puffer.get("warmup_epochs", 1),
                        rank_ratio=puffer.get("rank_ratio", 0.25),
                        carry_momentum=puffer.get("carry_momentum", False), extra_bn=puffer.get("extra_bn", False),
                        ddp_factory=rewrap)
        optimizer = warmup.optimizer
        ddp = warmup.model
    else:
        optimizer = optimizer_factory(ddp.parameters())
    if spec.local_steps is not None:
        holder["state"] = _local_steps(spec, ddp, optimizer, 0)

    sampler = torch.utils.data.distributed.DistributedSampler(workload.train, shuffle=True, seed=config.seed)
    loader = torch.utils.data.DataLoader(workload.train, batch_size=config.batch_size, sampler=sampler, drop_last=True)
    steps_per_epoch = min(len(loader), config.steps_per_epoch or len(loader))
    if steps_per_epoch == 0:  # every rank computes the same, so every rank raises together
        raise ValueError(f"batch_size={config.batch_size} is larger than each worker's share of the training set "
                         f"({len(sampler)} examples): no step would run")
    total_steps = min(config.epochs * steps_per_epoch, config.max_steps or config.epochs * steps_per_epoch)
    if rank == 0 and config.steps_per_epoch and steps_per_epoch < config.steps_per_epoch:
        print(f"gradwire: {spec_text}: {config.steps_per_epoch} steps per epoch asked for, but each worker's share "
              f"of the training set holds {steps_per_epoch} batches of {config.batch_size}", file=sys.stderr,
              flush=True)
    if rank == 0 and config.warmup_steps >= total_steps:
        print(f"gradwire: {spec_text}: only {total_steps} steps run, not more than the {config.warmup_steps} "
              "warm-up steps: the medians are over every step, warm-up included", file=sys.stderr, flush=True)
    folder = os.path.join(config.checkpoint_dir, file_slug(spec_text)) if config.checkpoint_dir else None
    start_step = resume.latest_step(folder) if folder else 0
    if start_step:
        resume.load(folder, start_step, model=ddp.module, optimizer=optimizer,
                    hook_state=_checkpointed(holder["state"]), device=device)
        if spec.local_steps is not None:  # the per-step byte counts go on from the restored counters
            stats = holder["state"].stats()
            holder["local_last"] = (stats["bytes_sent"], stats["seconds_sync"] + stats["seconds_warmup"])
        if rank == 0:
            print(f"gradwire: {spec_text}: resumed from the checkpoint of step {start_step}", file=sys.stderr,
                  flush=True)
    records: list[dict[str, Any]] = []
    metrics_file = None
    if config.out and rank == 0:
        os.makedirs(config.out, exist_ok=True)
        metrics_path = os.path.join(config.out, f"metrics-{file_slug(spec_text)}.jsonl")
        if start_step:  # steps after the checkpoint ran before the failure: they run again now
            records.extend(resume.trim_metrics(metrics_path, start_step))
        metrics_file = open(metrics_path, "a" if start_step else "w")
    bar = None
    if config.progress and rank == 0:
        from tqdm import tqdm

        bar = tqdm(total=total_steps, initial=start_step, desc=spec_text, leave=False, dynamic_ncols=True)
    wall_start = time.perf_counter()
    status = "ok"
    try:
        ddp, optimizer = _loop(config, spec, workload, ddp, optimizer, warmup, holder, sampler, loader,
                               steps_per_epoch, total_steps, records, metrics_file, bar, device, world, start_step,
                               folder)
        if spec.local_steps is not None:
            holder["state"].synchronize()  # every rank evaluates the global parameters
    except Exception as error:  # DDP re-raises the hook's NonFiniteGradientError wrapped
        # the hook raises on every rank together when a gradient holds NaN/Inf: record the
        # divergence and go on with the next method instead of losing the whole comparison
        if "NaN or Inf" not in str(error):
            raise
        status = f"diverged (NaN/Inf gradient) at step {len(records)}"
    wall = time.perf_counter() - wall_start
    if bar is not None:
        bar.close()
    if metrics_file:
        metrics_file.close()
    accuracy, test_loss = (evaluate(ddp, workload, device) if config.evaluate and status == "ok"
                           else (math.nan, math.nan))
    measured = records[config.warmup_steps:] or records
    # a local-steps method syncs in bursts: its per-step numbers are means (a median would hide the syncs)
    aggregate = mean if spec.local_steps is not None else median
    rss = torch.tensor([_peak_rss_mb()], dtype=torch.float64, device=device)
    every_rss = [torch.empty_like(rss) for _ in range(world)]
    wait_for(dist.all_gather(every_rss, rss, async_op=True), None, "AllGather of peak memory")
    residual_mb = (holder["state"].stats().get("residual_bytes", 0.0) / 2**20
                   if holder["state"] is not None and config.fsdp else 0.0)
    summary = {
        "method": spec_text,
        "status": status,
        "model": config.model,
        "world_size": world,
        "steps": len(records),
        "final_loss": last_epoch_loss(records),
        "last_step_loss": records[-1]["loss"] if records else math.nan,
        "test_accuracy": accuracy,
        #: mean cross-entropy per prediction over the whole test split (nats per byte for the byte-level
        #: language models); ``test_loss`` is the same number under its older name
        "held_out_loss": test_loss,
        "test_loss": test_loss,
        "metric": workload.metric,
        "data": workload.info,
        "wall_seconds": wall,
        "seconds_per_step": aggregate([r["seconds_step"] for r in measured]),
        "bytes_per_step": aggregate([r.get("bytes_sent", math.nan) for r in measured]),
        #: FSDP2 with ``all_gather=``: the quantized parameter all-gathers' bytes per step and rank
        "all_gather_bytes_per_step": aggregate([r.get("all_gather_bytes_sent", math.nan) for r in measured]),
        "parameters": sum(p.numel() for p in ddp.parameters()),
        "phases": {key: aggregate([r.get(key, math.nan) for r in measured]) for key in
                   ("seconds_forward", "seconds_backward", "seconds_optimizer", "seconds_compress",
                    "seconds_communicate", "seconds_decompress")},
        "compute_only": config.compute_only,
        "per_step": "mean" if spec.local_steps is not None else "median",
        "fsdp": config.fsdp,
        "peak_rss_mb": [float(r) for r in every_rss],
        "residual_mb": residual_mb,
        "wire": holder.get("wire"),
        "strategy_buckets": {key[len("count_"):-len("_buckets")]: value for key, value in
                             (records[-1] if records else {}).items() if key.endswith("_buckets")},
        #: ``collective="auto"``'s policy at the end and the seconds per step its last trial measured
        "auto": {key[len("auto_"):]: value for key, value in (records[-1] if records else {}).items()
                 if key.startswith("auto_")},
        "config": asdict(config),
    }
    if spec.local_steps is not None:
        stats = holder["state"].stats()
        summary["local_steps"] = {key: stats[key] for key in (
            "inner_steps", "outer_steps", "skipped_outer_steps", "bytes_warmup", "bytes_outer", "bytes_peak_sync",
            "bytes_per_local_step", "bytes_ddp_per_step", "seconds_sync", "seconds_warmup")}
        summary["local_steps"]["sync_every"] = spec.local_steps.options["sync_every"]
    return summary


def last_epoch_loss(records: list[dict[str, Any]]) -> float:
    """The mean training loss over the steps of the last epoch that ran (rank 0's batches): the
    number the epoch lines print, and the summary's ``final_loss``. One batch's loss swings with
    the batch, so comparing methods by the last step's loss (``last_step_loss``) would compare noise.

    Returns:
        The mean, or NaN when no step ran.
    """
    if not records:
        return math.nan
    losses = [r["loss"] for r in records if r["epoch"] == records[-1]["epoch"]]
    return sum(losses) / len(losses)


def _loop(config: TrainConfig, spec: MethodSpec, workload: Workload, ddp: Any, optimizer: Any, warmup: Any,
          holder: dict[str, Any], sampler: Any, loader: Any, steps_per_epoch: int, total_steps: int,
          records: list[dict[str, Any]], metrics_file: Any, bar: Any, device: torch.device, world: int,
          start_step: int = 0, folder: Optional[str] = None) -> tuple[Any, Any]:
    """The epochs of one method (at most ``total_steps`` steps); appends a record per step;
    returns the final (model, optimizer).

    From ``start_step`` on (a resumed run): the batches before it are skipped in the order an
    uninterrupted run sees them, so the data order does not change. With ``folder``, a
    checkpoint every ``config.checkpoint_every`` steps and one at the end."""
    spec_text = spec.text
    global_step = 0
    saved = start_step
    started = time.perf_counter()
    # every rank has the launcher's variables or none has: the barriers below match
    count_wire = bool(os.environ.get(WIRE_INTERFACE_ENV)) and config.warmup_steps < total_steps
    wire_start = None

    def checkpoint() -> None:
        resume.save(folder, global_step, model=ddp.module, optimizer=optimizer,
                    hook_state=_checkpointed(holder["state"]))

    for epoch in range(config.epochs):
        if global_step >= total_steps:
            break
        if global_step + steps_per_epoch <= start_step:  # a whole epoch done before the restart
            global_step += steps_per_epoch
            continue
        sampler.set_epoch(epoch)
        first_record = len(records)
        for step, (inputs, targets) in enumerate(loader):
            if step >= steps_per_epoch or global_step >= total_steps:
                break
            if global_step < start_step:
                global_step += 1
                continue
            if count_wire and global_step == config.warmup_steps:
                barrier()  # every rank has finished the warm-up's traffic
                wire_start = _wire_reading()
            inputs, targets = inputs.to(device), targets.to(device)
            optimizer.zero_grad(set_to_none=True)
            t0 = time.perf_counter()
            context = ddp.no_sync() if config.compute_only else contextlib.nullcontext()
            with context:
                loss = workload.loss(ddp(inputs), targets)
                t1 = time.perf_counter()
                loss.backward()
            if config.compute_only and config.barrier_each_step:
                barrier()
            t2 = time.perf_counter()
            optimizer.step()
            t3 = time.perf_counter()
            record = {"method": spec_text, "epoch": epoch, "step": global_step, "loss": float(loss.detach()),
                      "seconds_forward": t1 - t0, "seconds_backward": t2 - t1, "seconds_optimizer": t3 - t2,
                      "seconds_step": t3 - t0, "lowrank": bool(warmup and warmup.factorized)}
            current_state = holder["state"]
            if config.compute_only:
                record["bytes_sent"] = 0.0
            elif spec.local_steps is not None:
                stats = current_state.stats()
                last = holder.get("local_last", (0.0, 0.0))
                seconds = stats["seconds_sync"] + stats["seconds_warmup"]
                # what this step sent (a sync's burst, or nothing) and the seconds its hooks spent
                record.update(bytes_sent=stats["bytes_sent"] - last[0], seconds_communicate=seconds - last[1],
                              outer_steps=stats["outer_steps"])
                record.update({key[len("exchange_"):]: value for key, value in stats.items()
                               if key.startswith("exchange_count_") and key.endswith("_buckets")})
                holder["local_last"] = (stats["bytes_sent"], seconds)
            elif current_state is not None:
                stats = current_state.stats()
                record.update({"seconds_compress": stats["seconds_sparsify"] + stats["seconds_encode"],
                               "seconds_communicate": stats["seconds_communicate"],
                               "seconds_decompress": stats["seconds_decode"], "bytes_sent": stats["bytes_sent"]})
                # buckets per strategy so far: which exchange ``auto`` took, and what it measured
                record.update({key: value for key, value in stats.items()
                               if key.endswith("_buckets") or key.startswith("auto_")})
                if "all_gather_bytes_sent_total" in stats:  # FSDP2 with all_gather=: this step's gathers
                    gathered = holder.get("gather_last", 0.0)
                    record["all_gather_bytes_sent"] = stats["all_gather_bytes_sent_total"] - gathered
                    holder["gather_last"] = stats["all_gather_bytes_sent_total"]
            else:
                parameters = sum(p.numel() for p in ddp.parameters() if p.requires_grad)
                record["bytes_sent"] = _hook_bytes_per_step(spec, parameters, world)
            records.append(record)
            if metrics_file:
                metrics_file.write(json.dumps(record) + "\n")
            if bar is not None:
                bar.update()
                bar.set_postfix(loss=f"{record['loss']:.3f}", epoch=epoch)
            global_step += 1
            if folder and config.checkpoint_every and global_step % config.checkpoint_every == 0:
                if metrics_file:
                    metrics_file.flush()  # the records up to the checkpoint are on disk with it
                checkpoint()
                saved = global_step
        if config.log_epochs and dist.get_rank() == 0:
            # the same mean the summary reports as final_loss for the last epoch
            loss = last_epoch_loss(records) if len(records) > first_record else math.nan
            print(f"{spec_text}: epoch {epoch + 1}/{config.epochs}, step {global_step}/{total_steps}, "
                  f"mean loss {loss:.4f}, {time.perf_counter() - started:.1f} s",
                  file=sys.stderr, flush=True)
        if warmup is not None:
            local_steps = spec.local_steps is not None
            if local_steps and not warmup.factorized and warmup.epochs_done + 1 >= warmup.warmup_epochs:
                holder["state"].synchronize()  # every rank factorizes the same global parameters
            if warmup.step_epoch():
                ddp, optimizer = warmup.model, warmup.optimizer
                if local_steps:  # the factorized model and its new optimizer get a DiLoCo of their own
                    holder["state"].close()
                    holder["state"] = _local_steps(spec, ddp, optimizer, global_step)
                    holder.pop("local_last", None)
    if folder and saved != global_step:
        checkpoint()
    if wire_start is not None:
        barrier()
        holder["wire"] = _wire_bytes(wire_start, _wire_reading(), global_step - config.warmup_steps, device)
    return ddp, optimizer


def run_rank(config: TrainConfig,
             on_summary: Optional[Callable[[list[dict[str, Any]]], None]] = None) -> list[dict[str, Any]]:
    """Train every method of ``config`` in turn on this rank; rank 0 writes summary.json.

    summary.json is rewritten after every method, and ``on_summary(summaries so far)`` is called
    then, so a run that fails or is stopped later keeps the methods it finished.
    """
    torch.set_num_threads(config.threads)
    summaries: list[dict[str, Any]] = []
    for spec in config.methods:
        summaries.append(train_method(config, spec))
        if config.out and dist.get_rank() == 0:
            os.makedirs(config.out, exist_ok=True)
            with open(os.path.join(config.out, "summary.json"), "w") as handle:
                json.dump(summaries, handle, indent=1, default=_json_default)
        if on_summary is not None:
            on_summary(list(summaries))
    return summaries


def mean(values: list[float]) -> float:
    """Mean of the non-NaN values (NaN when there are none)."""
    finite = [v for v in values if v == v]
    return sum(finite) / len(finite) if finite else math.nan


def median(values: list[float]) -> float:
    """Median of the non-NaN values (NaN when there are none)."""
    finite = sorted(v for v in values if v == v)
    if not finite:
        return math.nan
    middle = len(finite) // 2
    return finite[middle] if len(finite) % 2 else 0.5 * (finite[middle - 1] + finite[middle])


def file_slug(text: str) -> str:
    """``text`` made safe as part of a file name (the method spec in metrics-*.jsonl)."""
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in text)[:80]


def _json_default(value: Any) -> Any:
    return str(value)

