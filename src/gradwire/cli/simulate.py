"""``gradwire simulate``: W data-parallel workers in one process, for quality (not speed) experiments.

With no options: the calibration of the language-model workload — the 509,248-parameter byte-level
GPT on this Python's standard library (``pystdlib``), 4 workers x 16 x 128 bytes, AdamW lr 2e-3,
1500 steps, exact gradient averaging (= DDP). Prints the held-out loss (nats per byte) every
``--eval-every`` steps and at the end; ``--json`` writes the whole record (every step's training
loss, every evaluation, the data's fingerprint, steps per second). The Python API,
:func:`gradwire.harness.simulate.simulate`, takes other gradient reductions and local-step schemes.

A bad option is one line on stderr with exit status 2, before any training.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Callable

from ..harness.optimizers import OPTIMIZERS
from .main import json_path_error


class UsageError(ValueError):
    """A bad option: printed as one line, exit status 2."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workers", type=int, default=4, help="simulated workers (default 4)")
    parser.add_argument("--steps", type=int, default=1500, help="optimizer steps per worker (default 1500)")
    parser.add_argument("--model", default="gpt", help="a gradwire train model (default gpt)")
    parser.add_argument("--data", default=None,
                        help="its data (default: pystdlib for gpt; e.g. pystdlib:max_bytes=N,held_out_bytes=N)")
    parser.add_argument("--batch-size", type=int, default=16, help="examples per worker per step (default 16)")
    parser.add_argument("--optimizer", default="adamw", help=f"{' or '.join(OPTIMIZERS)} (default adamw)")
    parser.add_argument("--lr", type=float, default=None, help="learning rate (default: adamw 2e-3, sgd 0.05)")
    parser.add_argument("--weight-decay", type=float, default=None, dest="weight_decay",
                        help="default: adamw 0.01, sgd 0")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--eval-every", type=int, default=250, metavar="N",
                        help="held-out evaluation every N steps and at the end (0: only at the end; default 250)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument("--method", default="allreduce", metavar="SPEC",
                        help="allreduce (default), a gradwire compressor or quantize spec (per-step), or "
                             "diloco:sync_every=N,...[+compressor] (gradwire train --help lists the keys)")
    parser.add_argument("--json", default=None, metavar="PATH", help="write the record as JSON")
    parser.add_argument("--fsdp", default=None, metavar="SPEC",
                        help="reduce as gradwire.fsdp's compressed reduce-scatter per FSDP unit does, with W "
                             "simulated ranks: 'plain' (FSDP2's fp32 mean), 'quantize:bits=8|4[,block=N,ef=B,"
                             "residuals=bf16]' or a sparsifier spec, e.g. 'topk:density=0.1,values=fp16,indices=rice' "
                             "(with warmup_steps=N,momentum=0.9: 1-bit Adam's exchange and MomentumAdamW's steps)")
    parser.add_argument("--per-tensor-scales", action="store_true", dest="per_tensor_scales",
                        help="with --fsdp quantize: one scale per parameter chunk instead of per block (comparison)")


def _check(args: argparse.Namespace) -> None:
    from ..harness import optimizers

    for option, value, low in (("--workers", args.workers, 1), ("--steps", args.steps, 1),
                               ("--batch-size", args.batch_size, 1), ("--eval-every", args.eval_every, 0),
                               ("--threads", args.threads, 1)):
        if value < low:
            raise UsageError(f"{option}={value} must be >= {low}")
    from .train import check_method

    try:
        check_method(args.method)
    except ValueError as error:
        raise UsageError(str(error)) from None
    try:
        optimizers.resolve(args.optimizer, args.lr, args.weight_decay)
    except ValueError as error:  # "lr=-1 must be > 0" -> "--lr=-1 must be > 0"
        name, _, rest = str(error).partition("=")
        raise UsageError(f"--{name.replace('_', '-')}={rest}") from None
    if args.per_tensor_scales and not (args.fsdp or "").startswith("quantize"):
        raise UsageError("--per-tensor-scales needs --fsdp quantize:...")
    if args.fsdp is not None and args.method != "allreduce":
        raise UsageError(f"--fsdp={args.fsdp} and --method={args.method}: choose one (--fsdp is the per-step "
                         "reduction of a sharded run; --method a DDP-like or local-steps one)")
    if args.fsdp is not None:
        try:
            momentum = _fsdp_options(args.fsdp).get("momentum")
        except ValueError as error:
            raise UsageError(f"--fsdp: {error}") from None
        if momentum is not None and args.optimizer != "adamw":
            raise UsageError(f"--fsdp {args.fsdp}: momentum= is 1-bit Adam's exchange; it needs --optimizer adamw "
                             f"(got {args.optimizer!r})")
    problem = json_path_error(args.json)
    if problem is not None:
        raise UsageError(problem)


def _fsdp_options(text: str) -> dict:
    """``--fsdp SPEC`` as keywords of :class:`~gradwire.harness.sharding.ShardedReduce`."""
    import torch

    from ..harness.methods import parse_method

    if text == "plain":
        return {}
    options = parse_method(text).hook_options()
    residuals = options.pop("residual_dtype", "float32")
    if options.get("quantize") is None and options.get("compressor") in (None, "none"):
        raise ValueError(f"{text!r} is neither 'plain', quantize:... nor a sparsifier")
    if options.get("codec_options"):
        raise ValueError("codec options are not simulated")
    unknown = set(options) - {"compressor", "density", "value_codec", "index_codec", "error_feedback", "quantize",
                              "quantize_block", "seed", "warmup_steps", "feedback_decay", "all_gather", "momentum"}
    if unknown:
        raise ValueError(f"options {sorted(unknown)} are not simulated")
    if options.get("momentum") is not None:  # refused as gradwire.fsdp.compress refuses it
        from ..core.config import ExchangeConfig
        from ..fsdp.state import check_momentum

        check_momentum(options["momentum"], ExchangeConfig(**{k: v for k, v in options.items()
                                                            if k not in ("momentum", "all_gather")}))
    if "quantize_block" in options:
        options["block_size"] = options.pop("quantize_block")
    return {**options, "residual_dtype": {"float32": torch.float32, "bf16": torch.bfloat16,
                                          "bfloat16": torch.bfloat16}[residuals]}


def run(args: argparse.Namespace) -> int:
    import torch

    from ..harness.simulate import EVAL_BATCH_SIZE, simulate
    from ..harness.workloads import build_workload, evaluate

    try:
        _check(args)
        try:
            workload = build_workload(args.model, args.data, seed=args.seed)
        except (ValueError, OSError) as error:
            raise UsageError(str(error)) from None
    except UsageError as error:
        print(f"gradwire simulate: {error}", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    fingerprint = workload.info.get("fingerprint", workload.info.get("data", "?"))
    print(f"gradwire simulate: {args.workers} workers x {args.steps} steps, {args.model} on {fingerprint}, "
          f"batch {args.batch_size} per worker, {args.optimizer}", file=sys.stderr, flush=True)
    reduce = None
    if args.fsdp is not None:
        from ..harness.sharding import ShardedReduce

        options = _fsdp_options(args.fsdp)
        if args.per_tensor_scales:
            options["block_size"] = None
        reduce = ShardedReduce(workload.model, args.workers, **options)
        print(f"gradwire simulate: reduce as gradwire.fsdp {args.fsdp}"
              f"{' (per-tensor scales)' if args.per_tensor_scales else ''}", file=sys.stderr, flush=True)
    try:
        plugs, counter = _method_plugs(args.method, args.workers, args.steps)
        if reduce is not None:  # --fsdp (with --method allreduce, _check says): the sharded reduction
            plugs["reduce"] = reduce
            if reduce.all_gather_bits is not None:  # forward and backward on the gathered (quantized) weights
                plugs["forward_weights"] = reduce.gathered_weights
            if reduce.momentum is not None:  # MomentumAdamW's steps on the exchanged momentum
                from ..harness.optimizers import OneBitAdamW

                plugs["make_optimizer"] = lambda params, lr, weight_decay: OneBitAdamW(
                    params, lr=lr, weight_decay=weight_decay, freeze_after=reduce.warmup_steps)
            counter = lambda: reduce.bytes_sent / args.workers  # noqa: E731 (summed over workers)
        sim = getattr(plugs.get("after_step"), "__self__", None)  # the SimulatedDiLoCo of a diloco method
        before_synchronize: list = []  # θ at the last step before the final synchronize, evaluated afterwards
        if sim is not None:
            sim.before_final_synchronize = lambda models: before_synchronize.append(sim.eval_model(models))
        result = simulate(args.workers, args.steps, model=args.model, data=args.data, batch_size=args.batch_size,
                          optimizer=args.optimizer, lr=args.lr, weight_decay=args.weight_decay, seed=args.seed,
                          eval_every=args.eval_every, workload=workload, log=lambda line: print(line, flush=True),
                          **plugs)
    except ValueError as error:  # a shard smaller than one batch, an exchange the simulator does not replay
        print(f"gradwire simulate: {error}", file=sys.stderr)
        return 2
    name = "held-out loss (nats/byte)" if result.metric == "loss" else "test accuracy"
    value = result.held_out_loss if result.metric == "loss" else result.test_accuracy
    print(f"final {name}: {value:.4f} after {result.steps} steps; {result.steps_per_second:.2f} steps/s "
          f"({result.train_seconds:.0f} s training, {result.eval_seconds:.0f} s evaluating)")
    record = result.to_dict()
    parameters = result.parameters
    ddp_bytes = 2 * (args.workers - 1) / args.workers * 4 * parameters
    sent = counter() / args.steps
    record.update(method=args.method, bytes_per_step=sent, bytes_ddp_per_step=ddp_bytes)
    # the float kernels the run took: the same command on a CPU with other vector paths is another
    # trajectory (docs/local-steps.md, "Two machines, two trajectories")
    record["environment"] = {"torch": torch.__version__, "cpu_capability": torch.backends.cpu.get_cpu_capability(),
                             "threads": torch.get_num_threads()}
    if sim is not None:
        record.update(outer_steps=sim.outer_steps, bytes_outer=sim.bytes_outer, bytes_peak_sync=sim.bytes_peak_sync,
                      bytes_per_local_step=sim.bytes_outer / max(args.steps - sim.local.warmup_steps, 1))
        if before_synchronize:  # how much of the final figure the synchronize's own exchange made
            accuracy, loss = evaluate(before_synchronize[0], workload, "cpu", EVAL_BATCH_SIZE)
            record["before_final_synchronize"] = {"held_out_loss": loss, "test_accuracy": accuracy,
                                                  "synchronize_exchanged": sim.final_synchronize_exchanged}
            what = "which exchanged" if sim.final_synchronize_exchanged else "a no-op"
            print(f"before the final synchronize ({what}): held-out loss {loss:.4f}")
    label = f"--fsdp {args.fsdp}" if reduce is not None else args.method  # whose bytes these are
    print(f"{label}: {sent:,.0f} bytes per worker per step, {sent / ddp_bytes:.5f} x DDP's AllReduce"
          + (f"; {record['bytes_per_local_step'] / ddp_bytes:.5f} x over the local steps"
             if "bytes_per_local_step" in record else ""))
    if reduce is not None:
        # averaged over every step, warm-up included: what a byte budget over the whole run is held to
        plain_bytes = reduce.plain_bytes_per_worker()
        record["fsdp"] = {"spec": args.fsdp, "per_tensor_scales": args.per_tensor_scales,
                          "plain_bytes_per_step": plain_bytes, "bytes_vs_plain": sent / plain_bytes}
        print(f"--fsdp {args.fsdp}: {sent / plain_bytes:.4f} x plain FSDP2's reduce-scatter "
              f"({plain_bytes:,.0f} bytes per worker per step), averaged over all {args.steps} steps")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(record, handle, indent=1)
    return 0


def _method_plugs(spec_text: str, workers: int, steps: int) -> tuple[dict, "Callable[[], float]"]:
    """simulate()'s plug points for a method spec, and a function returning the bytes one worker sent."""
    from ..harness.diloco_sim import SimulatedDiLoCo, SimulatedHook
    from ..harness.methods import parse_method

    spec = parse_method(spec_text)
    parameters = {"count": 0}
    if spec.pufferfish is not None:
        raise ValueError(f"--method={spec_text!r}: the simulator does not switch models (pufferfish)")
    if spec.local_steps is not None:
        options = spec.diloco_options()
        if options.pop("inner", "none") != "none":
            raise ValueError("--method: inner=ddp needs real nodes (gradwire train --cluster)")
        sim = SimulatedDiLoCo(workers, steps, **options)
        return ({"reduce": sim.reduce, "after_step": sim.after_step, "eval_model": sim.eval_model,
                 "on_start": sim.bind}, lambda: sim.bytes_sent)
    if spec.communication.name == "allreduce":
        from ..harness.simulate import exact_mean

        def reduce(grads):  # type: ignore[no-untyped-def]
            parameters["count"] += 1
            parameters["numel"] = sum(g.numel() for g in grads[0])
            return exact_mean(grads)

        return {"reduce": reduce}, lambda: parameters["count"] * 2 * (workers - 1) / workers * 4 * \
            parameters.get("numel", 0)
    if spec.communication.name in ("torch-fp16", "torch-powersgd"):
        raise ValueError(f"--method={spec_text!r}: the simulator replays gradwire's exchanges and allreduce only")
    hook = SimulatedHook(workers, **spec.hook_options())
    return {"reduce": hook.reduce}, lambda: hook.bytes_sent
