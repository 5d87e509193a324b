"""The README's "Use it with…" snippets are regions of files under examples/ (between
``# [readme: NAME]`` and ``# [/readme]``), and the framework tests run those files; this test
keeps the README's copies identical to them."""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MARKER = re.compile(r"<!-- snippet: (\S+) (.+?) -->\n```\w*\n(.*?)```", re.S)


def region(path: Path, name: str) -> str:
    text = path.read_text()
    match = re.search(rf"^[ \t]*# \[readme: {re.escape(name)}\]\n(.*?)^[ \t]*# \[/readme\]", text, re.S | re.M)
    assert match, f"{path.name} has no region {name!r}"
    return textwrap.dedent(match.group(1))


def test_readme_snippets_are_the_tested_examples() -> None:
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## Use it with"):]
    section = section[: section.index("\n## ", 3)]
    found = MARKER.findall(section)
    assert {name for _, name, _ in found} >= {"plain DDP", "custom loop", "DiLoCo", "Lightning", "HF Trainer",
                                              "accelerate", "torchrun"}
    assert section.count("```") == 2 * len(found), "every code block in the section is a checked snippet"
    for path, name, code in found:
        assert code == region(ROOT / path, name), f"README snippet {name!r} differs from {path}"
