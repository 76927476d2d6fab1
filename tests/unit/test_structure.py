"""The package reads module by module: no module over MAX_LINES, and few functions long enough to
need a ``# Long:`` reason (each split along its seams instead where it has them)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "fsdp_lab"
MAX_LINES = 400
MAX_LONG_FUNCTIONS = 5


def test_no_module_is_over_max_lines():
    over = {
        str(path.relative_to(PACKAGE)): n
        for path in sorted(PACKAGE.rglob("*.py"))
        if (n := len(path.read_text().splitlines())) > MAX_LINES
    }
    assert not over, f"modules over {MAX_LINES} lines (split them along their seams): {over}"


def test_at_most_a_few_long_functions():
    long = [
        f"{path.relative_to(PACKAGE)}: {line.strip()}"
        for path in sorted(PACKAGE.rglob("*.py"))
        for line in path.read_text().splitlines()
        if line.strip().startswith("# Long:")
    ]
    assert len(long) <= MAX_LONG_FUNCTIONS, "\n".join(long)


def test_every_long_reason_stands_above_a_function():
    """A stale ``# Long:`` (its function shortened or moved) would hide the count above."""
    stale = []
    for path in sorted(PACKAGE.rglob("*.py")):
        lines = path.read_text().splitlines()
        starts = {
            min([d.lineno for d in node.decorator_list] + [node.lineno])
            for node in ast.walk(ast.parse("\n".join(lines)))
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        }
        stale += [
            f"{path.relative_to(PACKAGE)}:{i + 1}"
            for i, line in enumerate(lines)
            if line.strip().startswith("# Long:") and i + 2 not in starts
        ]
    assert not stale, stale
