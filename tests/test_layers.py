"""The layering rules of docs/architecture.md, checked on the source: layers import downwards only."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "gradwire"

#: layer -> gradwire modules/packages it must never import (directly)
FORBIDDEN = {
    "codecs": {"sparsify", "feedback", "exchange", "hook", "plain", "bucket_payload", "training", "cli", "bench",
               "cluster", "lowrank"},
    "sparsify": {"codecs", "feedback", "exchange", "hook", "plain", "bucket_payload", "training", "cli", "bench"},
    "exchange": {"codecs", "sparsify", "feedback", "hook", "plain", "bucket_payload", "training", "cli", "bench"},
    "feedback": {"codecs", "sparsify", "exchange", "hook", "plain", "bucket_payload", "training", "cli", "bench"},
    "bucket_payload": {"sparsify", "feedback", "exchange", "hook", "plain", "training", "cli", "bench"},
    "lowrank": {"codecs", "sparsify", "feedback", "exchange", "hook", "plain", "bucket_payload", "training", "cli",
                "bench"},
    "hook": {"training", "cli", "bench", "cluster", "lowrank", "integrations"},
    "checkpoint": {"codecs", "sparsify", "feedback", "exchange", "hook", "plain", "bucket_payload", "training", "cli",
                   "bench", "cluster", "lowrank", "integrations"},
    "integrations": {"cli", "bench", "cluster"},
    "resume": {"cli", "bench", "cluster", "integrations"},
}


def _gradwire_imports(path: Path) -> set[str]:
    """First component under ``gradwire`` of every module ``path`` imports (absolute or relative)."""
    module_parts = path.relative_to(PACKAGE.parent).with_suffix("").parts  # ("gradwire", "codecs", "payload")
    package = module_parts[:-1] if path.name != "__init__.py" else module_parts[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                target = list(base) + (node.module.split(".") if node.module else [])
                names = [target + [alias.name] for alias in node.names] if not node.module else [target]
            else:
                names = [node.module.split(".")] if node.module else []
            for name in names:
                if name[0] == "gradwire" and len(name) > 1:
                    found.add(name[1])
        elif isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] == "gradwire" and len(parts) > 1:
                    found.add(parts[1])
    return found


def _files(layer: str) -> list[Path]:
    directory = PACKAGE / layer
    return sorted(directory.rglob("*.py")) if directory.is_dir() else [PACKAGE / f"{layer}.py"]


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_layer_imports_only_downwards(layer: str) -> None:
    for path in _files(layer):
        bad = (_gradwire_imports(path) - {layer}) & FORBIDDEN[layer]
        assert not bad, f"{path.relative_to(PACKAGE)} imports {sorted(bad)}"


def test_the_checker_sees_relative_imports() -> None:
    assert {"bucket_payload", "exchange", "errors"} <= _gradwire_imports(PACKAGE / "hook" / "strategies" / "allgather.py")
    assert {"codecs", "exchange", "sparsify"} <= _gradwire_imports(PACKAGE / "hook" / "config.py")
