"""No import circle among strata/ and workers/, and no import from a lower layer of packages up: every import, at
the top of a module or inside a function, read from the source with ast (nothing is imported to check)."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("strata", "workers")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported(name: str, is_package: bool, tree: ast.AST, known: set[str]) -> set[str]:
    """The project modules a module's source imports anywhere in it (`from a import b` counts a.b when that is
    a module, else a)."""
    here = name if is_package else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = here.split(".")[:len(here.split(".")) - (node.level - 1)]
                base = ".".join(up + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in known:  # `import strata.kernels.attention` names strata.kernels.attention; a.b.c of a non-module: a.b
                t = t.rpartition(".")[0]
            if t and t != name:
                out.add(t)
    return out


def import_graph() -> dict[str, set[str]]:
    files = {module_name(p): p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}
    known = set(files)
    return {n: imported(n, p.name == "__init__.py", ast.parse(p.read_text(), str(p)), known) for n, p in files.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Each strongly connected set of more than one module (Tarjan), sorted: the circles."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(out)


def test_the_graph_sees_both_kinds_of_import():
    """The checker reads top-level and function-level imports, relative and absolute (else it passes vacuously)."""
    g = import_graph()
    assert "strata.models.model" in g["strata.decode.graphs"]  # top level, relative
    assert "workers.bootstrap" in g["workers.join"]  # inside main(), relative
    assert "strata.kernels.attention" in g["workers.load"]  # `import strata.kernels.attention`
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_circle():
    assert cycles(import_graph()) == []


# The packages from the ground up: a module imports only from its own package or from a lower floor. Packages on
# one floor do not import each other. (strata/__init__.py, the package's API, hands on the head's names lazily.)
FLOORS = (
    ("strata.errors", "strata.triton_state"),  # leaves
    ("strata.config",),                    # the rig, typed
    ("strata.quant", "strata.comm"),       # block formats; what crosses a process boundary
    ("strata.kernels",),                   # attention and KV formats, Triton ops, the C decoder
    ("strata.models",),                    # the layer and its parts, ModelArgs, the families
    ("strata.weights", "strata.decode"),   # opening checkpoints; decode graphs of the model's layers
    ("strata.text", "strata.kvcache"),     # tokens and text; KV kept across requests
    ("strata.plan",),                      # the rig's split and schedule
    ("workers",),                          # the stage process
    ("strata.head",),                      # the head: stages, wire, the request loop
    ("strata.serve",),                     # HTTP
)


def floor_of(module: str) -> tuple[int, str] | None:
    for i, floor in enumerate(FLOORS):
        for pkg in floor:
            if module == pkg or module.startswith(pkg + "."):
                return i, pkg
    return None


def test_every_module_has_a_floor():
    assert [m for m in import_graph() if m != "strata" and floor_of(m) is None] == []


def test_imports_point_down():
    up = []
    for m, targets in import_graph().items():
        if m == "strata":
            continue
        (f, pkg) = floor_of(m)
        for t in targets:
            g, tpkg = floor_of(t)
            if tpkg != pkg and g >= f:
                up.append(f"{m} -> {t}")
    assert up == []
