"""Entry point of the ``gradwire`` command.

Each command lives in its own module exposing ``add_arguments(parser)`` and
``run(args) -> int``; this file only maps command words to modules, imported lazily so that
``gradwire --help`` stays fast and one broken command cannot break the others.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from typing import Optional, Sequence

#: (group, command) -> (module, one-line help). A group of None is a top-level command.
COMMANDS: dict[tuple[str | None, str], tuple[str, str]] = {
    (None, "cluster"): ("gradwire.cluster.command", "emulated bandwidth-limited cluster in network namespaces (root)"),
    (None, "train"): ("gradwire.cli.train", "train with one or more methods on local workers and compare"),
    (None, "simulate"): ("gradwire.cli.simulate", "W data-parallel workers in one process: held-out quality, fast"),
    ("bench", "codecs"): ("gradwire.bench.codecs", "bits per index/value and throughput of every codec"),
    ("bench", "sparsify"): ("gradwire.bench.sparsify", "speed of each sparsifier vs torch.topk"),
    ("bench", "lowrank"): ("gradwire.bench.lowrank", "parameters, compute and bytes: full-rank vs factorized"),
    ("bench", "hook"): ("gradwire.bench.hook", "the hook's CPU per step by phase, "
                                                "against a one-pass memory floor"),
    ("bench", "hostile"): ("gradwire.bench.hostile", "hostile and mutated payloads: only DecodeError, "
                                                      "bounded time/memory"),
    ("bench", "e2e"): ("gradwire.bench.e2e", "methods x bandwidths x workers on emulated rate-limited links"),
    ("bench", "scaling"): ("gradwire.bench.scaling", "exchange strategies vs workers: measured on the emulated "
                                                      "cluster, projected to 1024 by the alpha-beta model"),
    ("lowrank", "summary"): ("gradwire.cli.lowrank_summary", "per-layer report of a factorized model"),
}
GROUP_HELP = {"bench": "benchmarks that print tables (and --json)", "lowrank": "Pufferfish low-rank models"}


def build_parser() -> argparse.ArgumentParser:
    """The ``gradwire`` parser: one subparser per entry of :data:`COMMANDS`, filled by its module.

    A command whose module needs a missing gradwire module is still listed, and says so when run.
    """
    parser = argparse.ArgumentParser(prog="gradwire", description="Send fewer gradient bytes in PyTorch DDP.")
    top = parser.add_subparsers(dest="command", metavar="COMMAND")
    groups: dict[str, argparse._SubParsersAction] = {}
    for (group, name), (module_name, help_text) in COMMANDS.items():
        if group is None:
            target = top
        else:
            if group not in groups:
                group_parser = top.add_parser(group, help=GROUP_HELP.get(group, ""))
                groups[group] = group_parser.add_subparsers(dest="subcommand", metavar="WHAT", required=True)
            target = groups[group]
        sub = target.add_parser(name, help=help_text, description=help_text)
        sub.set_defaults(_module=module_name)
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as error:
            if not (error.name or "").startswith("gradwire"):
                raise
            sub.set_defaults(_missing=str(error))
            continue
        module.add_arguments(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run one ``gradwire`` command.

    Args:
        argv: the arguments after ``gradwire`` (None: ``sys.argv[1:]``).

    Returns:
        The command's exit status: 0 on success, 2 for a bad option or an unavailable command
        (argparse's own errors exit with 2 through ``SystemExit``).
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "_module", None) is None:
        parser.print_help()
        return 0
    if getattr(args, "_missing", None):
        print(f"gradwire: this command is not available in this build ({args._missing})", file=sys.stderr)
        return 2
    return int(importlib.import_module(args._module).run(args) or 0)


def json_path_error(path: Optional[str]) -> Optional[str]:
    """Why ``--json PATH`` cannot be written, in one line, or None (also for no ``--json``).

    Every command that takes ``--json`` checks it before any work, so that a long run does not
    end on an unwritable path; a file that was not there before is removed again (a refused run
    leaves nothing behind).
    """
    if not path:
        return None
    existed = os.path.exists(path)
    try:
        with open(path, "a"):
            pass
    except OSError as error:
        return f"--json={path!r} cannot be written ({error.strerror or error})"
    if not existed:
        os.remove(path)
    return None


if __name__ == "__main__":
    sys.exit(main())

