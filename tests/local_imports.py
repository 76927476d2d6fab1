"""Why each import inside a function of fsdp_lab is there, read from the source alone.

An import belongs at the top of its module unless one of these holds:
- cost: it loads a third-party module (torch_xla, transformers, torch.distributed.tensor, an
  extra) that nothing the module imports at its top has loaded already (a submodule counts as
  loaded only where it is named: the source cannot say what a package imports), or an fsdp_lab
  module whose own imports do; a torch-free layer (config, the CLI's start) stays so;
- cycle: the module it names imports this one, at its top, directly or not.
Everything else (the standard library, a module already loaded) is written at the top.
"""

from __future__ import annotations

import ast
import sys
from dataclasses import dataclass
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "fsdp_lab"
STDLIB = frozenset(sys.stdlib_module_names) | {"__future__"}


@dataclass(frozen=True)
class LocalImport:
    module: str  # fsdp_lab.x.y
    line: int
    end_line: int
    names: tuple[str, ...]  # the dotted names it loads: the module, and each from-imported one
    bound: tuple[str, ...]  # the names it binds
    reason: str | None  # "cost", "cycle", or None: belongs at the top


def _module_name(path: Path, package: Path) -> str:
    parts = list(path.relative_to(package.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _loaded(node: ast.Import | ast.ImportFrom, module: str, is_package: bool) -> tuple[str, ...]:
    if isinstance(node, ast.Import):
        return tuple(a.name for a in node.names)
    base = node.module or ""
    if node.level:
        pkg = module.split(".")
        pkg = pkg if is_package else pkg[:-1]
        pkg = pkg[: len(pkg) - (node.level - 1)]
        base = ".".join([*pkg, *([base] if base else [])])
    return (base, *(f"{base}.{a.name}" for a in node.names))


def _bound(node: ast.Import | ast.ImportFrom) -> tuple[str, ...]:
    if isinstance(node, ast.Import):
        return tuple(a.asname or a.name.split(".")[0] for a in node.names)
    return tuple(a.asname or a.name for a in node.names)


def _is_type_checking(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def scan(package: Path = PACKAGE) -> tuple[dict[str, set[str]], dict[str, list]]:
    """(each module's top-level imports, its function-local import nodes)."""
    top: dict[str, set[str]] = {}
    local: dict[str, list] = {}
    for path in sorted(package.rglob("*.py")):
        module = _module_name(path, package)
        package_init = path.name == "__init__.py"
        top[module], local[module] = set(), []

        def visit(node, in_function, module=module, package_init=package_init):
            for child in ast.iter_child_nodes(node):
                if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                    visit(child, True)
                elif _is_type_checking(child):
                    continue
                elif isinstance(child, (ast.Import, ast.ImportFrom)):
                    loaded = _loaded(child, module, package_init)
                    if in_function:
                        local[module].append((child, loaded))
                    else:
                        top[module].update(loaded)
                else:
                    visit(child, in_function)

        visit(ast.parse(path.read_text()), False)
    return top, local


class Graph:
    """The modules each module's top-level imports load, fsdp_lab's and third parties'."""

    def __init__(self, top: dict[str, set[str]]) -> None:
        self.modules = set(top)
        self.internal = {
            m: {i for n in names if (i := self.owner(n))} - {m} for m, names in top.items()
        }
        for m in self.modules:  # importing a.b.c imports a and a.b first
            parts = m.split(".")
            self.internal[m] |= {".".join(parts[:i]) for i in range(1, len(parts))} & self.modules
        self.closures: dict[str, frozenset[str]] = {}
        self.external = {
            m: {n for n in names if self.owner(n) is None and n.split(".")[0] not in STDLIB}
            for m, names in top.items()
        }

    def owner(self, name: str) -> str | None:
        """The fsdp_lab module a dotted name lives in, or None (a third party's)."""
        parts = name.split(".")
        for i in range(len(parts), 0, -1):
            if (candidate := ".".join(parts[:i])) in self.modules:
                return candidate
        return None

    def add(self, module: str, names: tuple[str, ...]) -> None:
        self.internal[module] |= {i for n in names if (i := self.owner(n))} - {module}
        self.external[module] |= {
            n for n in names if self.owner(n) is None and n.split(".")[0] not in STDLIB
        }
        self.closures.clear()

    def closure(self, module: str) -> frozenset[str]:
        if module in self.closures:
            return self.closures[module]
        seen, stack = set(), [module]
        while stack:
            m = stack.pop()
            if m not in seen:
                seen.add(m)
                stack.extend(self.internal.get(m, ()))
        self.closures[module] = frozenset(seen)
        return self.closures[module]

    def loads(self, module: str) -> set[str]:
        return {n for m in self.closure(module) for n in self.external[m]}

    def reason(self, module: str, names: tuple[str, ...]) -> str | None:
        internal = {i for n in names if (i := self.owner(n))} - {module}
        if any(module in self.closure(i) for i in internal):
            return "cycle"
        have = self.loads(module)

        def loaded(name: str) -> bool:
            return any(h == name or h.startswith(name + ".") for h in have)

        first = names[0]
        if self.owner(first) is None:
            if first.split(".")[0] in STDLIB or loaded(first):
                return None
            return "cost"
        needed = {n for i in internal for n in self.loads(i)}
        return "cost" if any(not loaded(n) for n in needed) else None


def local_imports(package: Path = PACKAGE) -> list[LocalImport]:
    top, local = scan(package)
    graph = Graph(top)
    return [
        LocalImport(
            module, node.lineno, node.end_lineno, loaded, _bound(node), graph.reason(module, loaded)
        )
        for module, nodes in sorted(local.items())
        for node, loaded in nodes
    ]
