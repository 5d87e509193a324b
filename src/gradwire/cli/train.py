"""``gradwire train``: train a model with one or more methods and print how they compare.

With no options: the small CNN on MNIST-5k over 2 local worker processes, dense AllReduce vs
top-k 1% with fp16 values and Rice-coded indices, three epochs each. Under ``torchrun`` it runs as
one rank of the job torchrun started (``torchrun --nnodes ... -m gradwire train ...``).

Everything that can be checked before a worker starts is checked here — method specs and their
ranges, model/data/text, sizes, bounds, whether the outputs can be written, the cluster — and a
problem is one line on stderr with exit status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import os
import sys
import tempfile
import warnings
from typing import Any, Optional

from ..tables import format_table
from .launch import LOOPBACK, MAX_WORKERS, launch

#: dense, top-k 1% through the payload AllGather (what the bytes saved look like), and the same with
#: collective="auto", which measures its choice (on a fast local link it ends dense, and says why)
DEFAULT_METHODS = ["allreduce", "topk:density=0.01,values=fp16,indices=rice,collective=allgather",
                   "topk:density=0.01,values=fp16,indices=rice,collective=auto"]
DEFAULT_WORKERS = 2
DEFAULT_BANDWIDTH, DEFAULT_LATENCY = "1gbit", "0.5ms"
#: shown in the tables where a number does not exist (see the note printed under them)
MISSING = "–"


class UsageError(ValueError):
    """A bad option: printed as one line, exit status 2."""


#: (command, what it does) shown under ``gradwire train --help``; tests parse every --method here
EXAMPLES = [
    ("gradwire train", "allreduce vs top-k 1% (fp16 values, Rice indices): cnn on MNIST-5k, 2 local workers"),
    ("gradwire train --method allreduce --method topk:density=0.01,indices=eliasfano --epochs 1 --json run.json",
     "one epoch each, the summaries also written to run.json"),
    ("gradwire train --model resnet18 --data synthetic --method pufferfish:warmup_epochs=1+topk:density=0.01",
     "a low-rank ResNet-18 after a full-rank warm-up epoch, sending top-k 1%"),
    ("gradwire train --model gpt --optimizer adamw --method allreduce --method diloco:sync_every=16,warmup_steps=300 "
     "--steps 1500 --warmup-steps 300 --batch-size 16 --workers 4",
     "DDP vs DiLoCo (an outer step every 16 steps after 300 synchronous ones) on the byte-level LM"),
    ("gradwire train --model gpt --optimizer adamw --method diloco:sync_every=32+topk:density=0.03,values=qsgd-ans",
     "DiLoCo whose outer step sends top-k 3% of the pseudo-gradient, entropy-coded"),
    ("gradwire train --show run.json", "the tables of a saved run again"),
]


def help_epilog() -> str:
    """The method-spec keys (read from :mod:`gradwire.harness.methods`) and examples."""
    from ..harness.methods import spec_help

    examples = "\n".join(f"  {command}\n      {what}" for command, what in EXAMPLES)
    return f"{spec_help()}\n\nexamples:\n{examples}"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    # the epilog is laid out by hand (one paragraph per kind of method): keep its line breaks
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = help_epilog()
    parser.add_argument("--method", action="append", dest="methods", metavar="SPEC",
                        help="repeatable; e.g. allreduce, torch-fp16, torch-powersgd:rank=4, "
                             "topk:density=0.01,values=fp16,indices=eliasfano, randomblock:density=0.01, "
                             "pufferfish:rank_ratio=0.25,warmup_epochs=1 (default: allreduce and topk 1%%)")
    parser.add_argument("--model", default="cnn",
                        help="cnn, resnet18, vgg19, lstm, transformer, mlp, gpt (a 0.5M-parameter byte-level LM) "
                             "(default cnn)")
    parser.add_argument("--data", default=None,
                        help="mnist5k, digits, synthetic, pystdlib (this Python's standard-library sources, for the "
                             "sequence models; options: pystdlib:max_bytes=N,held_out_bytes=N,held_out_every=N) "
                             "(default: mnist5k for cnn, pystdlib for gpt, synthetic otherwise)")
    parser.add_argument("--text", default=None, metavar="PATH",
                        help="a local text file for lstm/transformer/gpt (byte-level)")
    parser.add_argument("--workers", type=int, default=None,
                        help=f"worker processes, 1 to {MAX_WORKERS} (default {DEFAULT_WORKERS}, or the size of the "
                             f"cluster that is up with --cluster; ignored under torchrun)")
    parser.add_argument("--epochs", type=int, default=3, help="epochs per method (default %(default)s)")
    parser.add_argument("--steps", type=int, default=None, dest="max_steps",
                        help="total training steps per method, across epochs (default: every step of every epoch)")
    parser.add_argument("--steps-per-epoch", type=int, default=None, dest="steps_per_epoch",
                        help="cap on the steps of each epoch")
    parser.add_argument("--warmup-steps", type=int, default=0,
                        help="steps left out of the per-step medians (default %(default)s)")
    parser.add_argument("--batch-size", type=int, default=32, help="per worker (default %(default)s)")
    parser.add_argument("--optimizer", default="sgd", help="sgd (with momentum 0.9) or adamw (default sgd)")
    parser.add_argument("--lr", type=float, default=None, help="learning rate (default 0.05) with sgd, 2e-3 with adamw")
    parser.add_argument("--weight-decay", type=float, default=None, dest="weight_decay",
                        help="AdamW's decoupled weight decay, SGD's L2 term (default: sgd 0, adamw 0.01)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the model and data order (default %(default)s)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per worker (default %(default)s)")
    parser.add_argument("--compute-only", action="store_true",
                        help="forward+backward under no_sync(): no communication")
    parser.add_argument("--fsdp", action="store_true",
                        help="FSDP2 instead of DDP: fully_shard every block (and the root); allreduce is plain FSDP2, "
                             "a gradwire method its compressed reduce-scatter (gradwire.fsdp.compress)")
    parser.add_argument("--no-eval", action="store_true", help="skip the test-set evaluation")
    parser.add_argument("--out", default=None, metavar="DIR",
                        help="write metrics-*.jsonl (every step) and summary.json (after every method) here")
    parser.add_argument("--checkpoint-dir", default=None, metavar="DIR",
                        help="save model, optimizer and every rank's hook state here (and resume from the latest "
                             "on start, e.g. after a torchrun --max-restarts restart)")
    parser.add_argument("--checkpoint-every", type=int, default=0, metavar="N",
                        help="with --checkpoint-dir: also every N steps (default: only at the end)")
    parser.add_argument("--cluster", action="store_true",
                        help="run each worker in its own network namespace behind rate-limited links (root): the "
                             "cluster that `gradwire cluster up` made if one is up, else a temporary one")
    parser.add_argument("--prefix", default="gw", help="with --cluster: the prefix of the cluster to use if it is up")
    parser.add_argument("--nodes", type=int, default=None,
                        help="with --cluster: nodes; rank r runs on node r // workers-per-node")
    parser.add_argument("--workers-per-node", type=int, default=None,
                        help="with --cluster: workers per node; in-node traffic is unshaped, cross-node traffic "
                             "crosses the node's rate-limited link")
    parser.add_argument("--bandwidth", default=None,
                        help=f"with --cluster: link rate, e.g. 100mbit, 1gbit (default {DEFAULT_BANDWIDTH}, "
                             f"or the rate of the cluster that is up)")
    parser.add_argument("--latency", default=None,
                        help=f"with --cluster: one-way link latency (default {DEFAULT_LATENCY})")
    parser.add_argument("--timeout", type=float, default=3600,
                        help="seconds before the workers are stopped (> 0; default %(default)s)")
    parser.add_argument("--json", default=None, metavar="PATH",
                        help="also write the summaries as JSON (rewritten after every method)")
    parser.add_argument("--show", default=None, metavar="PATH", help="print the tables of a saved --json file and exit")


def config_from_args(args: argparse.Namespace) -> Any:
    """The TrainConfig of ``args``, every method spec parsed and range-checked (``UsageError``)."""
    from ..harness.training import TrainConfig

    interactive = sys.stderr.isatty()
    config = TrainConfig(
        methods=args.methods or list(DEFAULT_METHODS), model=args.model, data=args.data, text=args.text,
        epochs=args.epochs, steps_per_epoch=args.steps_per_epoch, max_steps=args.max_steps,
        warmup_steps=args.warmup_steps, batch_size=args.batch_size, optimizer=args.optimizer, lr=args.lr,
        weight_decay=args.weight_decay, seed=args.seed, threads=args.threads,
        evaluate=not args.no_eval, compute_only=args.compute_only, out=args.out,
        progress=interactive, log_epochs=not interactive,
        checkpoint_dir=args.checkpoint_dir, checkpoint_every=args.checkpoint_every, fsdp=args.fsdp,
    )
    try:
        config.validate()
    except ValueError as error:  # "max_steps=0 must be >= 1" -> "--steps=0 must be >= 1"
        name, _, rest = str(error).partition("=")
        raise UsageError(f"{_OPTION_NAMES.get(name, name)}={rest}") from None
    try:
        for spec in config.methods:
            check_method(spec, fsdp=args.fsdp)
    except ValueError as error:
        raise UsageError(str(error)) from None
    return config


#: TrainConfig field -> the option that sets it, for error messages
_OPTION_NAMES = {"max_steps": "--steps", "steps_per_epoch": "--steps-per-epoch", "batch_size": "--batch-size",
                 "epochs": "--epochs", "threads": "--threads", "lr": "--lr", "warmup_steps": "--warmup-steps",
                 "optimizer": "--optimizer", "weight_decay": "--weight-decay", "fsdp": "--fsdp"}


def check_method(spec_text: str, fsdp: bool = False) -> None:
    """Parse ``spec_text`` and check every option's range, as building it on a rank would."""
    from ..harness.methods import TORCH_HOOKS, parse_method

    spec = parse_method(spec_text)
    try:
        if spec.local_steps is not None:
            from ..local_steps import split_options

            split_options(**{k: v for k, v in spec.diloco_options().items() if k != "inner"})  # checks only
        elif spec.communication.name not in TORCH_HOOKS:
            import gradwire

            options = spec.hook_options()
            gather = options.pop("all_gather", None)
            if gather is not None and not fsdp:
                raise ValueError("gather= quantizes FSDP2's parameter all-gathers; it needs --fsdp")
            momentum = options.pop("momentum", None)
            if momentum is not None and not fsdp:
                raise ValueError("momentum= is 1-bit Adam's exchange for FSDP2's reduce-scatter; it needs --fsdp")
            if options.pop("defer", None) is not None and not fsdp:
                raise ValueError("defer= is gradwire.fsdp.compress's (when FSDP2's collectives complete); "
                                 "it needs --fsdp")
            gradwire.CommHookState(**options)  # no model, no process group: checks only
            if fsdp:
                from ..errors import check_choice
                from ..fsdp.all_gather import ALL_GATHER_BITS
                from ..fsdp.state import check_config, check_momentum

                check_choice("gather", gather, (None, *ALL_GATHER_BITS))
                config = gradwire.ExchangeConfig(**options)
                check_config(config)
                check_momentum(momentum, config)
        if spec.communication.name == "torch-powersgd":
            for key, low in (("rank", 1), ("start_iter", 2)):  # PowerSGDState wants start_iter > 1
                if spec.communication.options.get(key, low) < low:
                    raise ValueError(f"{key}={spec.communication.options[key]} must be >= {low}")
        if spec.pufferfish is not None:
            ratio = spec.pufferfish.options.get("rank_ratio", 0.25)
            if not 0 < ratio <= 1:
                raise ValueError(f"rank_ratio={ratio} must be in (0, 1]")
            if spec.pufferfish.options.get("warmup_epochs", 1) < 0:
                raise ValueError(f"warmup_epochs={spec.pufferfish.options['warmup_epochs']} must be >= 0")
    except ValueError as error:
        raise ValueError(f"method {spec_text!r}: {error}") from None


def check_workload(config: Any, workers: int) -> int:
    """Build the model and data once (what every rank will build) and return the steps per epoch;
    ``UsageError`` if the model, data or text is unusable or no step would run."""
    from ..harness.workloads import SEQUENCE_MODELS, build_workload

    if config.text is not None:
        if config.model not in SEQUENCE_MODELS:
            raise UsageError(f"--text is for {', '.join(SEQUENCE_MODELS)}; --model={config.model!r} reads images")
        if not os.path.isfile(config.text) or not os.access(config.text, os.R_OK):
            raise UsageError(f"--text={config.text!r} is not a readable file")
    try:
        workload = build_workload(config.model, config.data, seed=config.seed, text=config.text,
                                  synthetic_size=config.synthetic_size)
    except (ValueError, OSError) as error:
        raise UsageError(str(error)) from None
    share = math.ceil(len(workload.train) / workers)  # DistributedSampler pads to equal shares
    steps = share // config.batch_size  # drop_last
    if steps == 0:
        raise UsageError(f"--batch-size={config.batch_size} is larger than each worker's share of the training set "
                         f"({share} of {len(workload.train)} examples over {workers} workers): no step would run")
    return min(steps, config.steps_per_epoch or steps)


def check_outputs(args: argparse.Namespace) -> None:
    """Make sure --out and --json can be written before any training starts."""
    if args.out:
        try:
            os.makedirs(args.out, exist_ok=True)
            with tempfile.NamedTemporaryFile(dir=args.out, prefix=".gradwire-write-check-"):
                pass
        except OSError as error:
            raise UsageError(f"--out={args.out!r} is not a writable folder ({error.strerror or error})") from None
    if args.json:
        if os.path.isdir(args.json):
            raise UsageError(f"--json={args.json!r} is a folder; give a file path")
        try:
            _write_json(args.json, [])  # created now, rewritten after every method
        except OSError as error:
            raise UsageError(f"--json={args.json!r} cannot be written ({error.strerror or error})") from None


def _write_json(path: str, summaries: list[dict[str, Any]]) -> None:
    partial = f"{path}.partial"
    with open(partial, "w") as handle:
        json.dump(summaries, handle, indent=1, default=str)
    os.replace(partial, path)


def _check_bounds(args: argparse.Namespace) -> None:
    if not args.timeout > 0:
        raise UsageError(f"--timeout={args.timeout:g} must be > 0 seconds")
    for option, value in (("--workers", args.workers), ("--nodes", args.nodes),
                          ("--workers-per-node", args.workers_per_node)):
        if value is not None and not 1 <= value <= MAX_WORKERS:
            raise UsageError(f"{option}={value} is not supported; allowed: 1 to {MAX_WORKERS}")
    if not args.cluster:
        for option, value in (("--nodes", args.nodes), ("--workers-per-node", args.workers_per_node),
                              ("--bandwidth", args.bandwidth), ("--latency", args.latency)):
            if value is not None:
                raise UsageError(f"{option} needs --cluster")


def _cluster_plan(args: argparse.Namespace) -> tuple[int, Any]:
    """(workers, what to pass to launch as ``cluster``): the cluster that is up, or a spec for a
    temporary one; ``UsageError`` when the options contradict the cluster that is up."""
    from ..cluster import ClusterSpec, find, temporary_prefix

    running = find(args.prefix)
    if running is not None:
        spec = running.spec
        asked = {"--workers": (args.workers, spec.workers), "--nodes": (args.nodes, spec.nodes),
                 "--workers-per-node": (args.workers_per_node, spec.workers_per_node),
                 "--bandwidth": (args.bandwidth, spec.bandwidth), "--latency": (args.latency, spec.latency)}
        for option, (value, actual) in asked.items():
            if value is not None and value != actual:
                raise UsageError(f"{option}={value} differs from the cluster {spec.prefix!r} that is up ({actual}); "
                                 f"drop {option} to use that cluster, or remove it with `gradwire cluster down` to "
                                 f"train in a temporary one")
        _note(f"using the cluster {spec.prefix!r} that is up: {running.describe()}")
        return spec.workers, running
    nodes, per_node = args.nodes, args.workers_per_node
    if nodes is None and per_node is None:
        workers, per_node = args.workers or DEFAULT_WORKERS, 1
    else:
        per_node = per_node or 1
        nodes = nodes or math.ceil((args.workers or DEFAULT_WORKERS) / per_node)
        workers = nodes * per_node
        if args.workers is not None and args.workers != workers:
            raise UsageError(f"--workers={args.workers} is not --nodes x --workers-per-node ({nodes} x {per_node})")
    try:
        spec = ClusterSpec(workers=workers, bandwidth=args.bandwidth or DEFAULT_BANDWIDTH,
                           latency=args.latency or DEFAULT_LATENCY, workers_per_node=per_node,
                           prefix=temporary_prefix())
    except ValueError as error:
        raise UsageError(str(error)) from None
    _note(f"no cluster {args.prefix!r} is up (`gradwire cluster up`); building a temporary one for this run: "
          f"{spec.describe()}; removed when the run ends")
    return workers, spec


def _note(text: str) -> None:
    print(f"gradwire train: {text}", file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> int:
    try:
        if args.show:
            print(render_saved(args.show), end="")
            return 0
        _check_bounds(args)
        config = config_from_args(args)
        under_torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ
        cluster = None
        if under_torchrun:
            workers = int(os.environ["WORLD_SIZE"])
        elif args.cluster:
            workers, cluster = _cluster_plan(args)
        else:
            workers = args.workers or DEFAULT_WORKERS
        steps_per_epoch = check_workload(config, workers)
        check_outputs(args)
    except UsageError as error:
        print(f"gradwire train: {error}", file=sys.stderr)
        return 2
    if under_torchrun:
        code = _report(args, _run_under_torchrun(config))
        # PyTorch itself can abort at interpreter exit after gloo collectives (pytorch PR #179291), and
        # torchrun would count that as a failed rank: the group is down and the results are out, so leave
        # without the interpreter's teardown (as every worker and example does)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    total = min(config.epochs * steps_per_epoch, config.max_steps or config.epochs * steps_per_epoch)
    _note(f"{workers} {'worker namespaces' if cluster is not None else 'local workers'}, {config.model}"
          f"{' on ' + (config.data or 'its default data') if config.text is None else ' on ' + config.text}, "
          f"{len(config.methods)} method(s) x {total} steps; starting the workers "
          f"({'a progress bar' if config.progress else 'one line per epoch'} follows)")
    saver = (lambda partial: _write_json(args.json, partial)) if args.json else None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        summaries = launch(config, workers, timeout=args.timeout, cluster=cluster, on_summaries=saver)
    for warning in caught:
        _note(f"warning: {warning.message}")
    return _report(args, summaries)


def _report(args: argparse.Namespace, summaries: Optional[list[dict[str, Any]]]) -> int:
    """Print the tables (and write --json) of a finished run; the exit status (1: a method trained
    no step). ``summaries`` is None on a torchrun rank other than 0, which reports nothing."""
    if summaries is None:
        return 0
    print_summary(summaries)
    if args.json:
        _write_json(args.json, summaries)
    empty = [s["method"] for s in summaries if s.get("status", "ok") == "ok" and s["steps"] == 0]
    if empty:
        print(f"gradwire train: {', '.join(empty)} trained 0 steps", file=sys.stderr)
        return 1
    return 0


def _run_under_torchrun(config: Any) -> Optional[list[dict[str, Any]]]:
    import torch
    import torch.distributed as dist

    from ..harness.resume import init_process_group
    from ..harness.training import run_rank

    use_cuda = torch.cuda.is_available()
    if use_cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    init_process_group("nccl" if use_cuda else "gloo")  # a store prefix per torchrun restart
    try:
        summaries = run_rank(config)
        return summaries if dist.get_rank() == 0 else None
    finally:
        dist.destroy_process_group()


#: what print_summary reads from every summary (a saved --json file must hold them)
SUMMARY_KEYS = ("method", "model", "world_size", "steps", "test_accuracy", "final_loss", "seconds_per_step",
                "bytes_per_step", "parameters", "phases")


def render_saved(path: str) -> str:
    """The tables of a saved ``--json`` file, as :func:`print_summary` prints them.

    Raises:
        UsageError: the file cannot be read, or does not hold what ``--json`` writes (a list of
            method summaries); the tables are rendered before any is printed, so a bad file
            prints nothing but the one line.
    """
    where = f"--show={path!r}"
    try:
        with open(path) as handle:
            summaries = json.load(handle)
    except (OSError, ValueError) as error:
        raise UsageError(f"{where} cannot be read as a saved --json file ({error})") from None
    if not isinstance(summaries, list):
        raise UsageError(f"{where} is not a saved --json file of gradwire train: it holds a "
                         f"{type(summaries).__name__}, expected a list of method summaries")
    if not summaries:
        raise UsageError(f"{where} holds no method summaries (a run writes [] when it starts: did it stop before "
                         "its first method finished?)")
    for index, summary in enumerate(summaries):
        missing = [key for key in SUMMARY_KEYS if key not in summary] if isinstance(summary, dict) else None
        if missing is None or missing:
            what = f"lacks {', '.join(map(repr, missing))}" if missing else \
                f"is {json.dumps(summary)[:40]}, not an object"
            raise UsageError(f"{where} is not a saved --json file of gradwire train: summary {index} {what}; "
                             f"each must hold {', '.join(SUMMARY_KEYS)}")
    buffer = io.StringIO()
    try:
        with contextlib.redirect_stdout(buffer):
            print_summary(summaries)
    except (TypeError, ValueError, KeyError, AttributeError) as error:
        raise UsageError(f"{where} is not a saved --json file of gradwire train: a summary holds a value of "
                         f"the wrong kind ({type(error).__name__}: {error})") from None
    return buffer.getvalue()


def _number(value: Any, fmt: str) -> str:
    return MISSING if value is None or value != value else format(value, fmt)


def print_summary(summaries: list[dict[str, Any]]) -> None:
    """The comparison tables; ↑ marks a column where higher is better, ↓ lower. The evaluation column
    is the workload's headline (``metric``): test accuracy, or for a language model the held-out loss."""
    baseline = next((s for s in summaries if s["method"] == "allreduce"), None)
    first = summaries[0]
    by_loss = first.get("metric", "accuracy") == "loss"
    evaluated, header, fmt = (("held_out_loss", "held-out nats/byte ↓", ".4f") if by_loss else
                              ("test_accuracy", "test acc ↑", ".4f"))
    fingerprint = (first.get("data") or {}).get("fingerprint")
    print(f"\n{first['model']} on {first['world_size']} workers, {first['steps']} steps per method"
          + (f", data {fingerprint}" if fingerprint else ""))
    rows, missing = [], set()
    for s in summaries:
        ratio = s["seconds_per_step"] / baseline["seconds_per_step"] if baseline else math.nan
        byte_ratio = (s["bytes_per_step"] / baseline["bytes_per_step"]
                      if baseline and baseline["bytes_per_step"] else math.nan)
        ok = s.get("status", "ok") == "ok"
        accuracy = _number(s[evaluated], fmt) if ok else "diverged"
        if ok and s[evaluated] != s[evaluated]:
            missing.add(f"{header[:-2]}: not evaluated (--no-eval)")
        if s["bytes_per_step"] != s["bytes_per_step"]:
            missing.add("MB sent: PyTorch's PowerSGD hook keeps no byte counter")
        if baseline is None:
            missing.add("x allreduce: no allreduce run to compare with")
        rows.append([s["method"], accuracy, _number(s["final_loss"], ".4f"), _number(s["seconds_per_step"], ".3f"),
                     _number(ratio, ".2f"), _number(s["bytes_per_step"] / 1e6, ".3f"), _number(byte_ratio, ".4f"),
                     f"{s['parameters']:,}"])
    # final_loss is the last epoch's mean loss, as the epoch lines print it (one batch's loss is noise)
    print(format_table(["method", header, "last epoch loss ↓", "s/step ↓", "time x allreduce ↓",
                        "MB sent/step ↓", "bytes x allreduce ↓", "params"], rows))
    for s in summaries:  # what collective="auto" measured on real steps, and what it kept
        auto = s.get("auto") or {}
        if auto.get("policy"):
            measured = ", ".join(f"{key[len('seconds_'):]} {value:.3f} s" for key, value in sorted(auto.items())
                                 if key.startswith("seconds_"))
            verdict = (" (dense measured fastest: compression cannot win on this link)"
                       if auto["policy"] == "dense" else "")
            print(f"auto, {s['method']}: policy {auto['policy']} after {int(auto.get('trials', 0))} trial(s)"
                  + (f"; per step {measured}" if measured else "; no trial yet (it starts 8 steps after the warm-up)")
                  + verdict)
    link = first.get("link")
    if link and link.get("kind") == LOOPBACK:
        print("link: loopback, unshaped: compression saves bytes but no time here and can trail allreduce "
              "(--cluster: rate-limited links)")
    phases = ("forward", "backward", "compress", "communicate", "decompress", "optimizer")
    print("\nmedian seconds per step by phase, lower is better (backward includes the hook; communicate overlaps "
          "backward)")
    phase_rows = [[s["method"], *(_number(s["phases"].get(f"seconds_{phase}"), ".3f") for phase in phases)]
                  for s in summaries]
    if any(MISSING in row[3:6] for row in phase_rows):
        missing.add("compress/communicate/decompress: only gradwire's hook times its phases")
    print(format_table(["method", *phases], phase_rows))
    if link and link.get("tx_bytes"):
        print(f"\nbytes on the wire during the whole launch (interface counters; every method and setup), "
              f"{link['bandwidth']} links, {link['nodes']} node(s) x {link['workers_per_node']} worker(s)")
        per_node = link["workers_per_node"]
        headers = ["rank", "node", "MB sent", "MB received"]
        rows = [[rank, rank // per_node, f"{sent / 1e6:.3f}", f"{received / 1e6:.3f}"]
                for rank, (sent, received) in enumerate(zip(link["tx_bytes"], link["rx_bytes"]))]
        print(format_table(headers, rows))
        if link.get("node_tx_bytes"):
            print(format_table(["node", "MB sent across nodes", "MB received across nodes"],
                               [[node, f"{sent / 1e6:.3f}", f"{received / 1e6:.3f}"] for node, (sent, received)
                                in enumerate(zip(link["node_tx_bytes"], link["node_rx_bytes"]))]))
    local = [s for s in summaries if s.get("local_steps")]
    if local:
        print("\nlocal steps (diloco): s/step, MB sent/step and the phases above are means per inner step over the "
              "measured steps (a sync's burst spread over its period); the rest are medians")
        print(format_table(["method", "H", "outer steps", "peak MB per sync", "s in syncs per outer step",
                            "MB per local step"],
                           [[s["method"], s["local_steps"]["sync_every"], s["local_steps"]["outer_steps"],
                             _number(s["local_steps"]["bytes_peak_sync"] / 1e6, ".3f"),
                             _number(s["local_steps"]["seconds_sync"] / max(s["local_steps"]["outer_steps"], 1), ".3f"),
                             _number(s["local_steps"]["bytes_per_local_step"] / 1e6, ".4f")] for s in local]))
    if missing:
        print(f"\n{MISSING}: " + "; ".join(sorted(missing)))
