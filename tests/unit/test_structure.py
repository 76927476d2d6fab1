"""The package reads module by module: no module over MAX_LINES, and few functions long enough to
need a ``# Long:`` reason (each split along its seams instead where it has them)."""

from __future__ import annotations

import ast
import re
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


# The one door to torch's and transformers' private names (fsdp_lab.internals).
DOORS = {
    "internals/__init__.py",
    "internals/torch_private.py",
    "internals/transformers_private.py",
}
LIBRARIES = ("torch", "transformers")
# Underscore names of other libraries' objects, each with its owner: not torch's or
# transformers'.
OTHERS = {
    "_exit": "os",
    "_value2member_map_": "enum",
    "_return_value": "hydra's JobReturn",
    "_trial_id": "optuna's FrozenTrial",
    "_XLAC": "torch_xla (engine/xla.py)",
    "_get_xla_sharding_spec": "torch_xla (engine/xla.py)",
    "_get_local_shard_replica_and_indices": "torch_xla (engine/xla.py)",
}
PRIVATE_PATH = re.compile(r"^(torch|transformers)(\.\w+)*\._[a-zA-Z]\w*")


def own_names() -> set[str]:
    """Every name fsdp_lab defines outside the doors: functions, classes, attributes of its
    own objects (``self.x = ...``), variables, arguments."""
    names = set()
    for path in PACKAGE.rglob("*.py"):
        if str(path.relative_to(PACKAGE)) in DOORS:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                names.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                    names.add(node.attr)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, ast.arg):
                names.add(node.arg)
    return names


def private_uses(source: str, own: set[str]) -> list[str]:
    """Where ``source`` names a private part of torch or transformers: a private module or
    name imported (``from torch.utils._pytree import ...``), a dotted path or a string through
    one (``torch._C``, ``"torch.distributed.tensor._redistribute"``), or an underscore attribute
    that neither fsdp_lab defines nor another library (``OTHERS``) owns (``module._parameters``,
    ``mesh._flatten``)."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        where = f"line {getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.Import):
            found |= {f"{where}: import {a.name}" for a in node.names if PRIVATE_PATH.match(a.name)}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith(LIBRARIES):
            names = [f"{node.module}.{a.name}" for a in node.names]
            found |= {f"{where}: from {n}" for n in names if PRIVATE_PATH.match(n)}
        elif isinstance(node, ast.Attribute):
            private = node.attr.startswith("_") and not node.attr.startswith("__")
            if private and node.attr not in own and node.attr not in OTHERS:
                found.add(f"{where}: .{node.attr}")
            elif PRIVATE_PATH.match(ast.unparse(node)):
                found.add(f"{where}: {ast.unparse(node)}")
        elif isinstance(node, ast.Constant) and PRIVATE_PATH.fullmatch(str(node.value)):
            found.add(f"{where}: {node.value!r}")
    return sorted(found)


def test_private_names_of_torch_and_transformers_pass_through_one_door():
    own = own_names()
    seeded = (
        "import torch.distributed._functional_collectives as funcol\n"
        "from torch.utils._pytree import tree_leaves\n"
        "mesh._flatten('x'); torch._C._dump()\n"
        "logging.getLogger('torch.distributed.tensor._redistribute')\n"
        "os._exit(0); self.seen = 1; self.seen\n"
    )
    assert len(private_uses(seeded, own - {"_flatten"})) == 6, private_uses(seeded, own)
    found = {
        str(path.relative_to(PACKAGE)): hits
        for path in sorted(PACKAGE.rglob("*.py"))
        if str(path.relative_to(PACKAGE)) not in DOORS
        if (hits := private_uses(path.read_text(), own))
    }
    assert not found, found


def in_place_changes(source: str) -> list[str]:
    """Where ``source`` swaps an object's behaviour: an assignment to ``X.forward`` or
    ``X.__class__`` (or the same through ``setattr``)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        targets = node.targets if isinstance(node, ast.Assign) else []
        for t in targets:
            if isinstance(t, ast.Attribute) and t.attr in ("forward", "__class__"):
                found.append(f"{ast.unparse(t)} = ...")
        if isinstance(node, ast.Call) and ast.unparse(node.func) == "setattr":
            name = node.args[1] if len(node.args) > 1 else None
            if isinstance(name, ast.Constant) and name.value in ("forward", "__class__"):
                found.append(f"setattr(..., {name.value!r}, ...)")
    return sorted(found)


def test_behaviour_is_extended_not_swapped_in_place():
    seeded = "m.forward = f\nm.__class__ = C\nsetattr(m, 'forward', f)\nm.weight = w\n"
    assert len(in_place_changes(seeded)) == 3
    found = {
        str(path.relative_to(PACKAGE)): hits
        for path in sorted(PACKAGE.rglob("*.py"))
        if (hits := in_place_changes(path.read_text()))
    }
    assert not found, found


def test_an_import_inside_a_function_is_there_for_its_cost_or_a_cycle(tmp_path):
    """A function-local import loads what the module's own imports have not (a third party,
    or an fsdp_lab module that does: torch_xla, torch.distributed.tensor, an extra, torch in a
    torch-free layer), or breaks a circle; everything else is written at the top
    (``tests/local_imports.py`` reads why from the source)."""
    from local_imports import local_imports

    seeded = tmp_path / "fsdp_lab"
    seeded.mkdir()
    (seeded / "__init__.py").write_text("")
    (seeded / "b.py").write_text("import fsdp_lab.a\n")
    (seeded / "c.py").write_text("import xml\n")
    (seeded / "a.py").write_text(
        "import torch\n"
        "def f():\n"
        "    import json\n"  # the standard library: top
        "    import torch\n"  # loaded by the module's top already: top
        "    import transformers\n"  # a third party the module has not loaded: cost
        "    from fsdp_lab import b\n"  # b imports a: a cycle
        "    from fsdp_lab import c\n"  # c loads only the standard library: top
    )
    assert [i.reason for i in local_imports(seeded)] == [None, None, "cost", "cycle", None]
    misplaced = [f"{i.module}:{i.line} {i.names[-1]}" for i in local_imports() if not i.reason]
    assert not misplaced, "imports that belong at the top of their module:\n" + "\n".join(misplaced)
