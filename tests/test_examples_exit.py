"""Every example leaves the way the project's workers do: PyTorch itself can abort at interpreter
exit after gloo collectives (pytorch PR #179291), so a script tears its process group down,
flushes, and ends with ``os._exit(0)`` (checked on the source; the scripts run in tests/frameworks)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

EXAMPLES = sorted((Path(__file__).resolve().parents[1] / "examples").glob("*.py"))


def _main_block(tree: ast.Module) -> list[ast.stmt]:
    for node in tree.body:
        if isinstance(node, ast.If) and ast.unparse(node.test) in ('__name__ == "__main__"', "__name__ == '__main__'"):
            return node.body
    return []


def _calls(statements: list[ast.stmt]) -> list[str]:
    """The calls in ``statements``, in source order (``dist.destroy_process_group``, ``os._exit``)."""
    found = [node for statement in statements for node in ast.walk(statement) if isinstance(node, ast.Call)]
    return [ast.unparse(node.func) for node in sorted(found, key=lambda n: (n.lineno, n.col_offset))]


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda path: path.name)
def test_example_leaves_with_os_exit_after_destroy_and_flush(path: Path) -> None:
    block = _main_block(ast.parse(path.read_text()))
    assert block, f"{path.name} has no __main__ block"
    calls = _calls(block)
    last = block[-1]
    assert isinstance(last, ast.Expr) and ast.unparse(last) == "os._exit(0)", f"{path.name} must end with os._exit(0)"
    assert "dist.destroy_process_group" in calls, f"{path.name} must tear its process group down before os._exit"
    destroy, leave = calls.index("dist.destroy_process_group"), calls.index("os._exit")
    assert destroy < calls.index("sys.stdout.flush") < leave and destroy < calls.index("sys.stderr.flush") < leave


def test_the_check_fails_a_script_that_exits_normally(tmp_path: Path) -> None:
    script = tmp_path / "plain.py"
    script.write_text("import torch.distributed as dist\n"
                      'if __name__ == "__main__":\n    dist.destroy_process_group()\n')
    with pytest.raises(AssertionError, match="must end with os._exit"):
        test_example_leaves_with_os_exit_after_destroy_and_flush(script)


def test_every_python_example_is_checked() -> None:
    assert {path.name for path in EXAMPLES} >= {"plain_loops.py", "accelerate_loop.py", "hf_trainer.py",
                                                 "lightning_ddp.py", "ddp_mnist.py"}
