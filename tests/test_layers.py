"""The layering rules of docs/architecture.md, checked on the source: layers import downwards only."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "gradwire"

#: The layers of docs/architecture.md, bottom first: a module may import any layer below its own,
#: and within its own layer only what SAME_LAYER allows (codecs, sparsify, exchange and lowrank
#: never import each other).
LAYERS = (
    ("leaves", {"errors", "sparse", "configurable", "tables", "lifetime", "kernels", "_native", "_prefetch", "finite"}),
    ("parts", {"codecs", "sparsify", "exchange", "lowrank"}),
    ("core", {"core"}),
    ("front-ends", {"ddp", "hook", "tensors", "fsdp", "local_steps", "integrations"}),
    ("harness", {"harness"}),
    ("commands", {"cli", "bench", "cluster"}),
)
SAME_LAYER = {("configurable", "errors"), ("lifetime", "errors"), ("kernels", "_native"), ("_native", "_prefetch"),
              ("hook", "ddp"), ("ddp", "fsdp"), ("tensors", "fsdp"),
              ("integrations", "ddp"), ("integrations", "fsdp"), ("local_steps", "tensors"), ("cli", "cluster"),
              ("bench", "cli"), ("bench", "cluster")}
RANK = {name: rank for rank, (_, names) in enumerate(LAYERS) for name in names}
#: the package's facade (lazy re-exports) and entry point stand above every layer
FACADE = {"__init__", "__main__"}


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


def test_every_module_has_a_layer() -> None:
    tops = {path.relative_to(PACKAGE).parts[0].removesuffix(".py") for path in PACKAGE.glob("*")
            if path.suffix == ".py" or (path.is_dir() and (path / "__init__.py").exists())}
    assert tops - FACADE == set(RANK), f"layers of docs/architecture.md vs the package: {sorted(tops ^ set(RANK))}"


@pytest.mark.parametrize("layer", sorted(RANK))
def test_layer_imports_only_downwards(layer: str) -> None:
    for path in _files(layer):
        for target in _gradwire_imports(path) - {layer} - FACADE:
            assert target in RANK, f"{path.relative_to(PACKAGE)} imports gradwire.{target}, which has no layer"
            below = RANK[target] < RANK[layer]
            assert below or (layer, target) in SAME_LAYER, \
                f"{path.relative_to(PACKAGE)} ({LAYERS[RANK[layer]][0]}) imports gradwire.{target} " \
                f"({LAYERS[RANK[target]][0]})"


def test_the_checker_sees_relative_imports() -> None:
    assert {"core", "exchange", "errors"} <= _gradwire_imports(PACKAGE / "core" / "strategies" / "allgather.py")
    assert {"codecs", "exchange", "sparsify"} <= _gradwire_imports(PACKAGE / "core" / "config.py")
    assert {"core", "exchange"} <= _gradwire_imports(PACKAGE / "ddp" / "state.py")


def test_the_checker_fails_an_upward_import(tmp_path) -> None:
    """The rule can fail: a core module importing a front-end is caught."""
    bad = PACKAGE / "core" / "_upward_probe.py"
    bad.write_text("from ..ddp import CommHookState\n")
    try:
        with pytest.raises(AssertionError, match="imports gradwire.ddp"):
            test_layer_imports_only_downwards("core")
    finally:
        bad.unlink()
