"""Shared by the simulator experiments (``fsdp_frozen_variance.py``, ``fsdp_shared_support.py``):
run a ``gradwire`` command line with the experiment's patches in place, then say in its JSON record
which variant really ran, so a record never passes for the plain simulator's."""

from __future__ import annotations

import json

from gradwire.cli.main import main as gradwire_main


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
