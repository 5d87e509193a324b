"""What gradwire's emulated clusters created, one JSON file per prefix, so that nothing leaks.

``up`` writes ``{state dir}/{prefix}.json`` *before* it creates anything (namespaces, the
``/etc/netns`` host files) and ``down`` deletes it last, so a launcher killed at any point —
SIGKILL included — leaves a record that ``gradwire cluster down`` (no arguments) finds. The
record names the owning process (pid and start time, so a reused pid is not mistaken for it):
a cluster whose owner is alive belongs to a running ``gradwire train`` and is left alone; one
from ``gradwire cluster up`` has no owner and stays until ``down``.

The folder is ``/run/gradwire/clusters`` (root only, like the clusters; cleared at boot as the
namespaces are), or ``$GRADWIRE_CLUSTER_STATE_DIR``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Optional

STATE_ENV = "GRADWIRE_CLUSTER_STATE_DIR"
DEFAULT_STATE_DIR = "/run/gradwire/clusters"


def state_dir() -> Path:
    """The folder of the state files (read at every call, so tests can point it elsewhere)."""
    return Path(os.environ.get(STATE_ENV) or DEFAULT_STATE_DIR)


def _path(prefix: str) -> Path:
    return state_dir() / f"{prefix}.json"


def write(prefix: str, record: dict[str, Any]) -> None:
    """Store ``record`` for ``prefix`` (write, then rename: never half a file)."""
    folder = state_dir()
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    partial = folder / f".{prefix}.json.partial"
    partial.write_text(json.dumps(record, indent=1))
    os.replace(partial, _path(prefix))


def read(prefix: str) -> Optional[dict[str, Any]]:
    """The record of ``prefix``, or None (none, or unreadable)."""
    try:
        return json.loads(_path(prefix).read_text())
    except (OSError, ValueError):
        return None


def read_all() -> list[dict[str, Any]]:
    """Every record in the state folder, by prefix."""
    try:
        names = sorted(os.listdir(state_dir()))
    except OSError:
        return []
    records = [read(name[:-5]) for name in names if name.endswith(".json") and not name.startswith(".")]
    return [record for record in records if record is not None]


def remove(prefix: str) -> None:
    """Forget ``prefix`` (nothing if there is no record)."""
    try:
        _path(prefix).unlink()
    except FileNotFoundError:
        pass


def process_start_time(pid: int) -> Optional[str]:
    """Start time of ``pid`` in clock ticks since boot (/proc/PID/stat field 22), or None if gone."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            text = handle.read()
    except OSError:
        return None
    fields = text.rsplit(")", 1)[1].split()  # the command name may hold spaces and parentheses
    return None if fields[0] == "Z" else fields[19]


def owner(pid: Optional[int] = None) -> dict[str, Any]:
    """``{"pid": ..., "start_time": ...}`` for ``pid`` (default: this process)."""
    pid = os.getpid() if pid is None else pid
    return {"pid": pid, "start_time": process_start_time(pid)}


def owner_alive(record: dict[str, Any]) -> bool:
    """Whether the process that owns ``record``'s cluster still runs (False for an ownerless one)."""
    owner_info = record.get("owner")
    if not owner_info:
        return False
    started = process_start_time(int(owner_info["pid"]))
    return started is not None and started == owner_info.get("start_time")
