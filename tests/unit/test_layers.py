"""The packages' layers run one way, and no module imports itself back through others.

config <- engine, data <- state, observe <- train <- launch <- planning <- tools: each package
may import only those listed for it (and internals, the door to torch's and transformers'
private names, imports none); Hydra's plugin (``hydra_plugins/``) only registers launch's
sweeper, and nothing imports it. Every import counts, at the top of a module or inside a
function, and under ``TYPE_CHECKING`` too: a cycle that only a lazy import or a type hint closes
is a cycle.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "fsdp_lab"
PLUGINS = PACKAGE.parent / "hydra_plugins"  # where Hydra looks for the sweeper
ROOTS = ("fsdp_lab", "hydra_plugins")
ALLOWED = {
    "conf": set(),  # the shipped Hydra groups: YAML, no code
    "config": set(),
    "internals": set(),  # the door to torch's and transformers' private names
    "engine": {"config", "internals"},
    "data": {"config", "internals"},
    "state": {"config", "engine", "internals"},
    "observe": {"config", "engine", "internals"},
    "train": {"config", "engine", "data", "state", "observe", "internals"},
    "launch": {"config", "engine", "data", "state", "observe", "train", "internals"},
    "planning": {"config", "engine", "data", "state", "observe", "train", "launch", "internals"},
    "tools": {
        "config",
        "engine",
        "data",
        "state",
        "observe",
        "train",
        "launch",
        "planning",
        "internals",
    },
    "__main__": {"launch"},  # python -m fsdp_lab: the training command, as train.py
    "hydra_plugins": {"launch"},  # a shim: registers launch.study_sweeper
}
# Modules that import no torch (the parent checks a config and rank_main catches signals
# before any heavy import).
TORCH_FREE = [
    "fsdp_lab.config",
    "fsdp_lab.launch.rank_main",
    "fsdp_lab.train.preempt",
    "fsdp_lab.observe.rundir",
    "fsdp_lab.launch.slurm",
    "fsdp_lab.internals.transformers_private",
]


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for root in (PACKAGE, PLUGINS) for p in sorted(root.rglob("*.py"))}


def imports_of(path: Path, known: set[str]) -> set[str]:
    """The fsdp_lab modules a file imports (``from fsdp_lab.engine import fsdp`` is the module
    fsdp_lab.engine.fsdp; ``from fsdp_lab.config import Config`` the package's __init__)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith(ROOTS)}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith(ROOTS):
            if node.level:
                raise AssertionError(f"{path}: relative import; write fsdp_lab.<package>...")
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                found.add(sub if sub in known else node.module)
    return found


def graph() -> dict[str, set[str]]:
    mods = modules()
    return {name: imports_of(path, set(mods)) for name, path in mods.items()}


def package_of(module: str) -> str | None:
    if module.startswith("hydra_plugins"):
        return "hydra_plugins"
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


def test_every_module_lives_in_a_package():
    loose = [m for m in modules() if m != "fsdp_lab" and package_of(m) not in ALLOWED]
    assert not loose, f"modules outside the layered packages: {loose}"


def test_imports_follow_the_layers():
    crossings = []
    for module, targets in graph().items():
        here = package_of(module)
        for target in targets:
            there = package_of(target)
            if here is not None and there != here and there not in ALLOWED[here]:
                crossings.append(f"{module} -> {target}")
    assert not crossings, "imports against the layers:\n" + "\n".join(sorted(crossings))


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                return [*stack[stack.index(nxt) :], nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(edges):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_no_import_cycles():
    # A package's __init__ re-exporting its own modules is not a cycle through them.
    edges = {
        m: {
            t
            for t in ts
            if not (package_of(t) == package_of(m) and t == f"fsdp_lab.{package_of(m)}")
        }
        for m, ts in graph().items()
    }
    assert find_cycle(edges) is None, " -> ".join(find_cycle(edges))


def test_the_checks_catch_what_they_claim():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
    assert "launch" not in ALLOWED["train"] and "observe" not in ALLOWED["engine"]
    assert "hydra_plugins.fsdp_lab_sweeper.study_sweeper" in graph()
    assert not any("hydra_plugins" in ALLOWED[p] for p in ALLOWED)


@pytest.mark.parametrize("module", TORCH_FREE)
def test_torch_free_modules(module):
    import subprocess
    import sys

    code = f"import sys, {module}; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0, f"{module} imports torch"


DEVICE_CODE = re.compile(r"torch\.cuda\b|^\s*(import|from) torch_xla\b|[\"'](cuda|xla)[\"']", re.M)


def test_only_hardware_and_the_xla_engine_name_devices():
    """The engine.hardware package is the one place for device branches (and engine.xla for
    torch_xla): the GPU path differs from the tested CPU path only there."""
    hardware, xla = "fsdp_lab.engine.hardware", "fsdp_lab.engine.xla"
    door = "fsdp_lab.internals.torch_private"  # names torch.cuda's private memory history
    table = "fsdp_lab.config.hardware_kinds"  # each kind's torch device type
    naming = [
        f"{m}: {hit.group(0).strip()}"
        for m, path in modules().items()
        if m not in (xla, hardware, door, table) and not m.startswith(hardware + ".")
        for hit in DEVICE_CODE.finditer(path.read_text())
    ]
    assert not naming, "device names outside engine.hardware:\n" + "\n".join(naming)


def test_long_functions_say_why():
    """A function over 60 lines has a ``# Long: <reason>`` comment above it; the rest read in
    one screen."""
    unexplained = []
    for module, path in modules().items():
        lines = path.read_text().splitlines()
        for node in ast.walk(ast.parse("\n".join(lines))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                if node.end_lineno - node.lineno + 1 <= 60:
                    continue
                first = min([d.lineno for d in node.decorator_list] + [node.lineno])
                if not lines[first - 2].strip().startswith("# Long:"):
                    unexplained.append(
                        f"{module}.{node.name} ({node.end_lineno - node.lineno + 1})"
                    )
    assert not unexplained, "functions over 60 lines without a reason:\n" + "\n".join(unexplained)


MAX_PARAMETERS = 8


def test_functions_with_many_parameters_say_why():
    """A function taking more than 8 parameters (self and cls aside) has a ``# Many parameters:
    <reason>`` comment above it: more usually means a small dataclass is missing."""
    unexplained = []
    for module, path in modules().items():
        lines = path.read_text().splitlines()
        for node in ast.walk(ast.parse("\n".join(lines))):
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            a = node.args
            names = [p.arg for p in a.posonlyargs + a.args + a.kwonlyargs]
            count = len([n for n in names if n not in ("self", "cls")])
            if count <= MAX_PARAMETERS:
                continue
            first = min([d.lineno for d in node.decorator_list] + [node.lineno])
            above = " ".join(line.strip() for line in lines[max(0, first - 3) : first - 1])
            if "# Many parameters:" not in above:
                unexplained.append(f"{module}.{node.name} ({count})")
    assert not unexplained, "functions over 8 parameters without a reason:\n" + "\n".join(
        unexplained
    )
