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


def patches_of_transformers(source: str) -> list[str]:
    """Where ``source`` patches transformers: an assignment (or ``setattr``) into a name it
    imported from transformers (``masking_utils.find_packed_sequence_indices = ...``), or a
    function bound onto an instance (``types.MethodType``)."""
    tree = ast.parse(source)
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {
                (a.asname or a.name).split(".")[0]
                for a in node.names
                if a.name.split(".")[0] == "transformers"
            }
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("transformers"):
            imported |= {a.asname or a.name for a in node.names}

    def root(expr) -> str | None:
        while isinstance(expr, ast.Attribute):
            expr = expr.value
        return expr.id if isinstance(expr, ast.Name) else None

    found = []
    for node in ast.walk(tree):
        targets = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, ast.AugAssign | ast.AnnAssign):
            targets = [node.target]
        elif isinstance(node, ast.Call):
            name = ast.unparse(node.func)
            if name.endswith("MethodType"):
                found.append(f"line {node.lineno}: {name}")
            if name == "setattr" and node.args and root(node.args[0]) in imported:
                found.append(f"line {node.lineno}: setattr({ast.unparse(node.args[0])}, ...)")
        for t in targets:
            if isinstance(t, ast.Attribute) and root(t) in imported:
                found.append(f"line {node.lineno}: {ast.unparse(t)} = ...")
    return found


def test_transformers_is_extended_never_patched():
    # transformers is extended through its extension points (AttentionInterface, subclasses),
    # never by replacing what its modules hold: a patch is process-wide and invisible.
    seeded = (
        "from transformers import masking_utils\nimport types\n"
        "masking_utils.find_packed_sequence_indices = lambda p: None\n"
        "head.forward = types.MethodType(f, head)\n"
    )
    assert len(patches_of_transformers(seeded)) == 2  # the check finds both kinds
    found = {
        str(path.relative_to(PACKAGE)): hits
        for path in sorted(PACKAGE.rglob("*.py"))
        if (hits := patches_of_transformers(path.read_text()))
    }
    assert not found, found
