"""The layers of docs/architecture.md, kept: no package-level import cycle, no upward import.

Every import counts, the ones inside functions too: a lazy import is still a dependency,
and a cycle hidden in a function is still a cycle.  A package here is the first name under
``infra_agent`` (``agent``, ``judge``) or a top-level module (``feedback``, ``records``).
"""

from __future__ import annotations

import ast
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"

# Low to high: a package imports only packages of its own layer or below (and within a
# layer, never in a cycle).  docs/architecture.md draws the same table.
LAYERS: list[tuple[str, ...]] = [
    ("records", "feedback", "errors", "vocabulary", "safety", "stats", "tracing", "extras"),
    ("workspace", "target"),
    ("serving", "trace", "lab"),
    ("probes",),
    ("judge",),
    ("ledger", "tools"),
    ("agent",),
    ("mcp", "report", "standin"),
    ("cli", "demo"),
]
LAYER = {pkg: i for i, names in enumerate(LAYERS) for pkg in names}
# refstack is a target: it may use the instrumentation SDK and nothing else of infra_agent.
REFSTACK_MAY_IMPORT = ("infra_agent.tracing",)


def _module_name(path: Path) -> str:
    parts = path.relative_to(SRC).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path) -> Iterator[tuple[int, str]]:
    """(line, absolute module name) of every import in ``path``, relative ones resolved;
    ``from pkg import name`` yields ``pkg.name`` (the name may be a submodule)."""
    module = _module_name(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                yield node.lineno, f"{base}.{alias.name}"


def _package(module: str) -> str | None:
    parts = module.split(".")
    if parts[-1] == "__main__":
        return "cli"  # ``python -m infra_agent.mcp``: a program entry, the top layer wherever it lives
    return parts[1] if parts[0] == "infra_agent" and len(parts) > 1 else None


def package_graph() -> tuple[dict[str, set[str]], list[str]]:
    """Package -> the packages it imports, and where each edge comes from (for messages)."""
    edges: dict[str, set[str]] = defaultdict(set)
    where: list[str] = []
    for path in sorted((SRC / "infra_agent").rglob("*.py")):
        src = _package(_module_name(path))
        if src is None:
            continue
        for line, name in imports(path):
            dst = _package(name)
            if dst is not None and dst != src and dst in LAYER:
                if dst not in edges[src]:
                    where.append(f"{src} -> {dst}: {path.relative_to(SRC)}:{line} imports {name}")
                edges[src].add(dst)
    return edges, where


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one package (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def test_every_package_has_a_layer() -> None:
    found = {p.stem if p.is_file() else p.name for p in (SRC / "infra_agent").iterdir()
             if (p.is_dir() and (p / "__init__.py").exists()) or (p.suffix == ".py" and p.stem != "__init__")}
    assert found - set(LAYER) == set(), "add the new package to LAYERS here and in docs/architecture.md"


def test_no_package_level_cycle() -> None:
    edges, where = package_graph()
    cycles = _cycles(edges)
    detail = [w for w in where for c in cycles if w.split(":")[0].split(" -> ")[0] in c
              and w.split(":")[0].split(" -> ")[1] in c]
    assert cycles == [], "import cycles between packages:\n" + "\n".join(detail)


def test_no_import_goes_up_a_layer() -> None:
    _, where = package_graph()
    upward = [w for w in where if LAYER[w.split(" -> ")[1].split(":")[0]] > LAYER[w.split(" -> ")[0]]]
    assert upward == [], "imports against the layer order:\n" + "\n".join(upward)


def test_refstack_imports_only_the_tracing_sdk() -> None:
    bad = [f"{path.relative_to(SRC)}:{line} imports {name}"
           for path in sorted((SRC / "refstack").rglob("*.py")) for line, name in imports(path)
           if name.split(".")[0] == "infra_agent"
           and not any(name == ok or name.startswith(ok + ".") for ok in REFSTACK_MAY_IMPORT)]
    assert bad == []


def test_infra_agent_never_imports_refstack() -> None:
    bad = [f"{path.relative_to(SRC)}:{line} imports {name}"
           for path in sorted((SRC / "infra_agent").rglob("*.py")) for line, name in imports(path)
           if name.split(".")[0] == "refstack"]
    assert bad == []
