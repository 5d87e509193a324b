"""W data-parallel workers in one process, without torch.distributed: quality experiments, fast.

:func:`simulate` keeps W replicas of a workload's model, each with its own optimizer and its own
data shard — the shard a W-rank ``gradwire train`` run gives rank r: a ``DistributedSampler(
num_replicas=W, rank=r, shuffle=True, seed=seed)`` with ``set_epoch(epoch)``, batches of
``batch_size`` with ``drop_last``. Every step each worker computes its gradient on its own batch,
``reduce`` turns the W gradient lists into the one every worker applies, and every worker steps
its own optimizer. With the default :func:`exact_mean` (the fp32 mean over workers, what DDP's
AllReduce computes) the replicas stay identical and the run is a W-rank DDP run
(``tests/test_simulate.py`` checks it against 2 gloo ranks of :func:`~.training.train_method`).

Plug in other schemes through two callables:

* ``reduce(grads) -> averaged``: ``grads[w][i]`` is worker w's gradient of parameter i (fp32,
  shaped like the parameter); return one list (a compressed average: error feedback keeps its
  state in the callable) or ``None`` to let every worker step on its own gradient (local steps);
* ``after_step(step, models, optimizers)``: runs after every optimizer step (e.g. DiLoCo's outer
  step every H steps: average the replicas' parameters, apply an outer optimizer;
  :class:`~.diloco_sim.SimulatedDiLoCo` is the DiLoCo front-end's algorithm).

Evaluation (every ``eval_every`` steps and at the end) is :func:`~.workloads.evaluate` of
replica 0 (or of ``eval_model(replicas)``, e.g. a model holding DiLoCo's global parameters) over
the whole test split: for a language model, the held-out loss in nats per byte.
"""

from __future__ import annotations

import copy
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterator, Optional, Sequence

import torch
from torch import Tensor, nn

from . import optimizers
from .workloads import Workload, build_workload, evaluate

#: examples per evaluation forward pass, unless told (a caller evaluating θ itself uses the same)
EVAL_BATCH_SIZE = 256

#: per-worker gradient lists -> the gradient list every worker applies, or None (each its own)
Reduce = Callable[[Sequence[Sequence[Tensor]]], Optional[Sequence[Tensor]]]
#: (step just taken, 1-based; the replicas; their optimizers) -> None
AfterStep = Callable[[int, Sequence[nn.Module], Sequence[torch.optim.Optimizer]], None]
#: the replicas -> the model to evaluate
EvalModel = Callable[[Sequence[nn.Module]], nn.Module]


def exact_mean(grads: Sequence[Sequence[Tensor]]) -> list[Tensor]:
    """DDP's average: per parameter, the fp32 mean of the workers' gradients.

    Args:
        grads: ``grads[w][i]``, worker w's gradient of parameter i (same shapes across workers).

    Returns:
        One tensor per parameter, the mean over workers.
    """
    return [torch.stack(list(per_parameter)).mean(dim=0) for per_parameter in zip(*grads)]


@dataclass
class Simulation:
    """What :func:`simulate` measured; JSON-ready through :meth:`to_dict`.

    Attributes:
        workers, steps, batch_size: the run's shape (batch per worker, in examples).
        model, parameters: the model's name and its number of parameters.
        optimizer, lr, weight_decay, seed: the training options.
        data: the workload's data description (pystdlib: fingerprint, sizes, digests).
        metric: the workload's headline ("loss" for a language model).
        evaluations: ``{"step", "held_out_loss", "test_accuracy"}`` every ``eval_every`` steps and
            at the end (step 0 is the initial model when ``eval_every`` > 0).
        held_out_loss, test_accuracy: the final evaluation (mean nats per prediction; fraction).
        train_loss: per step, the mean over workers of their batch losses (nats per prediction).
        final_worker_losses: each worker's batch loss at the last step.
        train_seconds: seconds of training steps (evaluations excluded).
        steps_per_second: ``steps / train_seconds``.
        eval_seconds: seconds of all evaluations.
    """

    workers: int
    steps: int
    batch_size: int
    model: str
    parameters: int
    optimizer: str
    lr: float
    weight_decay: float
    seed: int
    data: dict[str, Any]
    metric: str
    evaluations: list[dict[str, float]] = field(default_factory=list)
    held_out_loss: float = float("nan")
    test_accuracy: float = float("nan")
    train_loss: list[float] = field(default_factory=list)
    final_worker_losses: list[float] = field(default_factory=list)
    train_seconds: float = 0.0
    steps_per_second: float = float("nan")
    eval_seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _shard_batches(workload: Workload, workers: int, rank: int, batch_size: int,
                   seed: int) -> Iterator[tuple[Tensor, Tensor]]:
    """Worker ``rank``'s batches epoch after epoch, in the order a W-rank ``train_method`` sees them.

    Raises:
        ValueError: a shard too small for one batch.
    """
    sampler = torch.utils.data.distributed.DistributedSampler(workload.train, num_replicas=workers, rank=rank,
                                                              shuffle=True, seed=seed)
    loader = torch.utils.data.DataLoader(workload.train, batch_size=batch_size, sampler=sampler, drop_last=True)
    if len(loader) == 0:  # checked now, not at the first step
        raise ValueError(f"batch_size={batch_size} is larger than each worker's share of the training set "
                         f"({len(sampler)} examples): no step would run")

    def batches() -> Iterator[tuple[Tensor, Tensor]]:
        epoch = 0
        while True:
            sampler.set_epoch(epoch)
            yield from loader
            epoch += 1

    return batches()


def simulate(workers: int = 4, steps: int = 1500, *, model: str = "gpt", data: Optional[str] = None,
             batch_size: int = 16, optimizer: str = "adamw", lr: Optional[float] = None,
             weight_decay: Optional[float] = None, momentum: float = 0.9, seed: int = 0, eval_every: int = 0,
             reduce: Reduce = exact_mean, after_step: Optional[AfterStep] = None,
             workload: Optional[Workload] = None, model_options: Optional[dict[str, Any]] = None,
             eval_batch_size: int = EVAL_BATCH_SIZE, log: Optional[Callable[[str], None]] = None,
             eval_model: Optional[EvalModel] = None,
             on_start: Optional[Callable[[Sequence[nn.Module]], None]] = None,
             forward_weights: Optional[Callable[[Sequence[Tensor]], Sequence[Tensor]]] = None,
             make_optimizer: Optional[Callable[[list[Tensor], float, float], torch.optim.Optimizer]] = None
             ) -> Simulation:
    """Train ``workers`` simulated data-parallel workers for ``steps`` steps; evaluate on the way.

    Args:
        workers: W, the number of simulated workers (>= 1).
        steps: optimizer steps per worker (>= 1); epochs repeat as needed.
        model: workload name (see :func:`~.workloads.build_workload`), default the byte-level LM.
        data: its data (default: the model's; ``pystdlib[:options]`` for gpt).
        batch_size: examples per worker per step (gpt: 128-byte windows).
        optimizer: ``"adamw"`` or ``"sgd"`` (:mod:`~.optimizers`); one per worker.
        lr, weight_decay: None for the optimizer's defaults (adamw: 2e-3, 0.01).
        momentum: SGD's momentum.
        seed: seeds the weights, the data and the shards (as ``gradwire train --seed``).
        eval_every: evaluate every this many steps, and the initial model (0: only at the end).
        reduce: see the module docstring; :func:`exact_mean` is DDP.
        after_step: see the module docstring.
        workload: a prebuilt workload (then ``model``, ``data``, ``model_options`` are only labels
            / unused); its model is copied into the W replicas and left untouched.
        model_options: keywords for the model (e.g. a smaller gpt).
        eval_batch_size: examples per evaluation forward pass.
        log: called with one line per evaluation (e.g. ``print``).
        eval_model: the model to evaluate, from the replicas (default: replica 0).
        on_start: called with the replicas before the first step (e.g. to take their initial weights).
        forward_weights: a worker's parameters -> the values its forward and backward use (e.g.
            FSDP's quantized all-gather); the optimizer still steps on the exact parameters.
        make_optimizer: ``(parameters, lr, weight_decay) -> optimizer`` in place of ``optimizer``'s
            (its lr and weight decay resolved as for it), e.g. :class:`~.optimizers.OneBitAdamW`.

    Returns:
        A :class:`Simulation`.

    Raises:
        ValueError: a count below 1, an unknown optimizer/model/data, a bad lr/weight decay, a
            shard smaller than one batch, or ``reduce`` returning the wrong number of tensors.
    """
    for name, value, low in (("workers", workers, 1), ("steps", steps, 1), ("batch_size", batch_size, 1),
                             ("eval_every", eval_every, 0), ("eval_batch_size", eval_batch_size, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name}={value!r} must be an integer >= {low}")
    lr, weight_decay = optimizers.resolve(optimizer, lr, weight_decay)
    if workload is None:
        workload = build_workload(model, data, seed=seed, model_options=model_options)
    # the same initial weights everywhere, as DDP's broadcast from rank 0 makes them
    replicas = [copy.deepcopy(workload.model) for _ in range(workers)]
    params = [[p for p in replica.parameters() if p.requires_grad] for replica in replicas]
    optims = [make_optimizer(replica_params, lr, weight_decay) if make_optimizer is not None else
              optimizers.build_optimizer(optimizer, replica_params, lr=lr, weight_decay=weight_decay, momentum=momentum)
              for replica_params in params]
    shards = [_shard_batches(workload, workers, rank, batch_size, seed) for rank in range(workers)]
    result = Simulation(workers, steps, batch_size, model, sum(p.numel() for p in params[0]), optimizer, lr,
                        weight_decay, seed, dict(workload.info), workload.metric)

    def evaluation(step: int) -> None:
        started = time.perf_counter()
        model_to_evaluate = eval_model(replicas) if eval_model is not None else replicas[0]
        accuracy, loss = evaluate(model_to_evaluate, workload, "cpu", eval_batch_size)
        result.eval_seconds += time.perf_counter() - started
        result.evaluations.append({"step": step, "held_out_loss": loss, "test_accuracy": accuracy})
        result.held_out_loss, result.test_accuracy = loss, accuracy
        if log is not None:
            recent = result.train_loss[-eval_every or None:] if result.train_loss else []
            train = f", train loss {sum(recent) / len(recent):.4f}" if recent else ""
            speed = f", {step / result.train_seconds:.2f} steps/s" if result.train_seconds else ""
            log(f"step {step}/{steps}: held-out loss {loss:.4f}{train}{speed}")

    if on_start is not None:
        on_start(replicas)
    if eval_every:
        evaluation(0)
    for step in range(1, steps + 1):
        started = time.perf_counter()
        losses, grads = [], []
        for replica, replica_params, optim, shard in zip(replicas, params, optims, shards):
            inputs, targets = next(shard)
            optim.zero_grad(set_to_none=True)
            exact = None
            if forward_weights is not None:  # compute at the gathered point, step on the exact weights
                exact = [p.detach().clone() for p in replica_params]
                with torch.no_grad():
                    for parameter, value in zip(replica_params, forward_weights(replica_params)):
                        parameter.copy_(value)
            loss = workload.loss(replica(inputs), targets)
            loss.backward()
            if exact is not None:
                with torch.no_grad():
                    for parameter, value in zip(replica_params, exact):
                        parameter.copy_(value)
            losses.append(float(loss.detach()))
            grads.append([p.grad if p.grad is not None else torch.zeros_like(p) for p in replica_params])
        reduced = reduce(grads)
        if reduced is not None:
            reduced = list(reduced)
            if len(reduced) != len(params[0]):
                raise ValueError(f"reduce returned {len(reduced)} tensors for {len(params[0])} parameters")
            for replica_params in params:
                for parameter, gradient in zip(replica_params, reduced):
                    # a copy per replica: an optimizer may write into .grad (none here does, but
                    # the replicas must not share storage through it)
                    parameter.grad = gradient.detach().clone()
        for optim in optims:
            optim.step()
        if after_step is not None:
            after_step(step, replicas, optims)
        result.train_seconds += time.perf_counter() - started
        result.train_loss.append(sum(losses) / workers)
        result.final_worker_losses = losses
        if eval_every and step % eval_every == 0 and step != steps:
            evaluation(step)
    evaluation(steps)
    result.steps_per_second = steps / result.train_seconds if result.train_seconds else float("nan")
    return result
