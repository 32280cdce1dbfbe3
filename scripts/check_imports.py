#!/usr/bin/env python3
"""The house rules of pgjobs' modules, read from the source with ``ast``:

1. no import cycle among pgjobs' modules (imports under ``TYPE_CHECKING``
   and inside functions count too: a cycle hidden in a function is still one);
2. a module imports only from its own layer or the layers below it;
3. every module says what it offers in ``__all__`` (the public surface is
   ``pgjobs/__init__.py``'s; the rest is named, not implied);
4. the house table of ``docs/DESIGN.md`` names each layer's modules as
   :data:`LAYERS` does, no more and no fewer: the one layer table is
   :data:`LAYERS`, the prose is checked against it.

A module not in :data:`LAYERS` is refused: put it on a floor. Exit 1 with
what is wrong; ``--graph`` prints every arrow, ``--layers`` the layers. Run
by ``scripts/check`` (and CI).
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "pgjobs"
DESIGN = ROOT.parent / "docs" / "DESIGN.md"

LAYERS: list[tuple[str, set[str]]] = [
    # pgjobs in other frameworks (the Django app): built on the face's API and CLI
    ("contrib", {"contrib"}),
    (
        "face",
        {
            "__init__",
            "__main__",
            "cli",
            "progress",
            "scheduler",
            "lifecycle",
            "firing",
            "api",
            "testing",
            "demo",
            "web",
            "snapshot",
            "metrics",
            "tracing",
            "serve",
            "operate",
            "embedded",
            "drift_text",
            "markup",
        },
    ),
    ("definitions", {"checks", "registry", "config", "hookspecs", "preflight", "derived"}),
    ("protocol", {"runner", "steps", "records", "drift"}),
    ("bodies", {"recompute", "worker", "slices"}),
    (
        "writers",
        {
            "diff",
            "staging",
            "target",
            "queue",
            "readmodel",
            "store",
            "migrations",
            "locking",
            "listener",
            "flow",
            "heartbeat",
            "scoping",
        },
    ),
    ("model", {"jobs", "cron", "results", "durations", "backoff", "logs", "horizon"}),
    ("base", {"_pg", "_wire", "deadline", "errors", "database"}),
]


def module_name(path: Path) -> str:
    """``pgjobs/diff/rows.py`` -> ``diff.rows``; ``pgjobs/demo/__init__.py`` -> ``demo``."""
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__" and len(parts) > 1:
        parts.pop()
    return ".".join(parts)


def floor_of(module: str) -> int | None:
    top = module.split(".")[0]
    for index, (_, members) in enumerate(LAYERS):
        if top in members:
            return index
    return None


def imports_of(path: Path, module: str, known: set[str]) -> set[str]:
    """The pgjobs modules ``path`` imports, wherever the import statement is."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    is_package = path.name == "__init__.py"
    package = module.split(".") if is_package else module.split(".")[:-1]
    if module == "__init__":
        package = []
    found: set[str] = set()

    def add(name: str) -> None:
        # the longest known module the dotted name starts with
        parts = name.split(".")
        while parts:
            candidate = ".".join(parts)
            if candidate in known:
                if candidate != module:
                    found.add(candidate)
                return
            parts.pop()

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "pgjobs" or alias.name.startswith("pgjobs."):
                    add(alias.name.removeprefix("pgjobs").lstrip(".") or "__init__")
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)] if node.level > 1 else package
                prefix = ".".join(base)
            elif node.module and (node.module == "pgjobs" or node.module.startswith("pgjobs.")):
                prefix = ""
                node_module = node.module.removeprefix("pgjobs").lstrip(".")
                target = node_module
                for alias in node.names:
                    add(f"{target}.{alias.name}" if target else alias.name)
                if target:
                    add(target)
                continue
            else:
                continue
            target = ".".join(p for p in (prefix, node.module or "") if p)
            for alias in node.names:
                add(f"{target}.{alias.name}" if target else alias.name)
            if target:
                add(target)
            elif not node.names:
                add("__init__")
    return found


def graph() -> dict[str, set[str]]:
    files = {module_name(p): p for p in sorted(ROOT.rglob("*.py"))}
    known = set(files) | {"__init__"}
    return {name: imports_of(path, name, known) for name, path in files.items()}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0

    def visit(node: str) -> None:
        nonlocal counter
        index[node] = low[node] = counter
        counter += 1
        stack.append(node)
        on_stack.add(node)
        for nxt in edges.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return found


def problems(edges: dict[str, set[str]]) -> list[str]:
    out = []
    for component in cycles(edges):
        out.append(f"import cycle: {' <-> '.join(component)}")
    for module in sorted(edges):
        floor = floor_of(module)
        if floor is None:
            out.append(f"{module}: on no floor; add it to LAYERS in {Path(__file__).name}")
            continue
        for target in sorted(edges[module]):
            target_floor = floor_of(target)
            if target_floor is not None and target_floor < floor:
                out.append(
                    f"{module} ({LAYERS[floor][0]}) imports {target} ({LAYERS[target_floor][0]}),"
                    " a layer above it"
                )
    return out


def without_all() -> list[str]:
    """Modules that define no ``__all__``."""
    out = []
    for path in sorted(ROOT.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        names = {
            target.id
            for node in tree.body
            if isinstance(node, ast.Assign | ast.AnnAssign)
            for target in (node.targets if isinstance(node, ast.Assign) else [node.target])
            if isinstance(target, ast.Name)
        }
        if "__all__" not in names:
            out.append(f"{module_name(path)}: no __all__ (say what it offers)")
    return out


def _depth0(cell: str) -> str:
    """``cell`` without what is in parentheses (sub-modules, notes)."""
    out, depth = [], 0
    for char in cell:
        depth += char == "("
        if depth == 0:
            out.append(char)
        depth -= char == ")" and depth > 0
    return "".join(out)


def table_problems(text: str) -> list[str]:
    """Where the house table of ``docs/DESIGN.md`` and :data:`LAYERS` disagree:
    each row's modules (the names in backticks outside parentheses, a
    package's trailing ``/`` dropped) must be its layer's."""
    rows = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 2 and cells[0] in {name for name, _ in LAYERS}:
            found = re.findall(r"`([^`]+)`", _depth0(cells[1]))
            rows[cells[0]] = {name.rstrip("/") for name in found}
    out = []
    for layer, members in LAYERS:
        if layer not in rows:
            out.append(f"{DESIGN.name}: the house table has no row {layer!r}")
            continue
        wanted = members - {"__main__"}
        for name in sorted(wanted - rows[layer]):
            out.append(f"{DESIGN.name}: layer {layer!r} does not name {name!r} (LAYERS does)")
        for name in sorted(rows[layer] - wanted):
            out.append(f"{DESIGN.name}: layer {layer!r} names {name!r}, which LAYERS does not")
    return out


def main(argv: list[str]) -> int:
    edges = graph()
    if "--graph" in argv:
        for module in sorted(edges):
            print(f"{module} -> {', '.join(sorted(edges[module])) or '-'}")
    if "--layers" in argv:
        for layer, members in LAYERS:
            print(f"{layer:<12} {', '.join(sorted(members))}")
    found = problems(edges) + without_all() + table_problems(DESIGN.read_text(encoding="utf-8"))
    for line in found:
        print(f"check_imports: {line}", file=sys.stderr)
    if found:
        return 1
    print(
        f"check_imports: {len(edges)} modules, no cycle, every import one way, each with"
        " __all__, the house table as LAYERS"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
