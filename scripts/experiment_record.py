"""Shared by the simulator experiments (``fsdp_frozen_variance.py``, ``fsdp_shared_support.py``,
``fsdp_momentum_exchange.py``, ...): run a ``gradwire`` command line with the experiment's patches in
place, then say in its JSON record which variant really ran, so a record never passes for the plain
simulator's; and swap the simulator's AdamW for an experiment's optimizer."""

from __future__ import annotations

import json
from typing import Any, Callable, Iterable, Optional

import gradwire.harness.optimizers as optimizers
from gradwire.cli.main import main as gradwire_main


def split_command(argv: list[str]) -> tuple[list[str], list[str], int]:
    """``OWN... -- COMMAND...``: the script's own arguments, the ``gradwire`` command line after
    ``--`` (empty without one), and that command's ``--seed`` (0 when it has none)."""
    split = argv.index("--") if "--" in argv else len(argv)
    command = argv[split + 1:]
    seed = int(command[command.index("--seed") + 1]) if "--seed" in command else 0
    return argv[:split], command, seed


def run_and_mark(command: list[str], key: str, variant: dict) -> int:
    """``gradwire COMMAND``; on success, ``record[key] = variant`` in the record ``--json`` names.

    Args:
        command: the arguments after ``gradwire`` (``simulate ... --json PATH``).
        key: the record's key for the variant, e.g. ``"optimizer_variant"``.
        variant: what the experiment changed (JSON-serializable).

    Returns:
        gradwire's exit status.
    """
    status = gradwire_main(command)
    if status == 0 and "--json" in command:
        path = command[command.index("--json") + 1]
        with open(path) as file:
            record = json.load(file)
        record[key] = variant
        with open(path, "w") as file:
            json.dump(record, file, indent=1)
    return status


def install_adamw_variant(script: str, make: Callable[[Iterable[Any], float, float], Any]) -> list:
    """Make the simulator build ``make(parameters, lr, weight_decay)`` wherever it would build AdamW
    (with its defaults resolved as for AdamW); any other ``--optimizer`` exits naming ``script``.

    Returns:
        The list every optimizer built is appended to, in order (the replicas' are identical).
    """
    built: list = []

    def build_optimizer(name: str, parameters: Iterable[Any], *, lr: Optional[float] = None,
                        weight_decay: Optional[float] = None, momentum: float = 0.9) -> Any:
        if name != "adamw":
            raise SystemExit(f"{script}: --optimizer={name!r}; this experiment is about 'adamw'")
        lr, weight_decay = optimizers.resolve(name, lr, weight_decay)
        optimizer = make(parameters, lr, weight_decay)
        built.append(optimizer)
        return optimizer

    optimizers.build_optimizer = build_optimizer  # type: ignore[assignment]
    return built
