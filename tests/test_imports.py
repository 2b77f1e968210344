"""The import graph of mconvert, read from the source with `ast` (function-level imports included): imports
point down (cli → validators / convert / trainer → layouts → mappings → spec → errors), `convert` never imports
`validators`, there is no cycle, and no private name is imported from another module."""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "mconvert"

# Layer of each top-level part of mconvert: a module may import its own part or a lower layer, never a higher one.
LAYERS = {
    "errors": 0, "dtypes": 0, "rope": 0,
    "spec": 1, "io": 1,
    "mappings": 2, "data": 2,
    "layouts": 3,
    "convert": 4, "trainer": 4, "validators": 4,
    "cli": 5, "demo": 5, "": 5,  # "": the package's own __init__ (a facade over the parts)
}
# Imports between parts of one layer that the design forbids.
FORBIDDEN = {("convert", "validators"), ("convert", "trainer")}


@dataclass(frozen=True)
class Edge:
    src: str  # importing module
    dst: str  # imported mconvert module
    name: str | None  # the name taken from it (`from dst import name`), None for `import dst`
    line: int

    def where(self) -> str:
        return f"{self.src}:{self.line} imports {self.dst}" + (f".{self.name}" if self.name else "")


def module_names(root: Path = PACKAGE) -> dict[str, tuple[Path, bool]]:
    """Dotted module name -> (file, whether it is a package's __init__)."""
    out = {}
    for p in sorted(root.rglob("*.py")):
        parts = list(p.relative_to(root.parent).with_suffix("").parts)
        is_pkg = parts[-1] == "__init__"
        out[".".join(parts[:-1] if is_pkg else parts)] = (p, is_pkg)
    return out


def import_edges(root: Path = PACKAGE) -> list[Edge]:
    """Every import of an mconvert module by an mconvert module, wherever it stands (top, function, branch)."""
    mods = module_names(root)
    edges = []
    for mod, (path, is_pkg) in mods.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [(a.name, None) for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: resolved against the importing module's package
                    pkg = mod.split(".") if is_pkg else mod.split(".")[:-1]
                    base = ".".join(pkg[: len(pkg) - node.level + 1] + ([node.module] if node.module else []))
                targets = [(base, a.name) for a in node.names]
            else:
                continue
            for dst, name in targets:
                if dst != "mconvert" and not dst.startswith("mconvert."):
                    continue
                if name and f"{dst}.{name}" in mods:  # `from pkg import submodule`
                    dst, name = f"{dst}.{name}", None
                edges.append(Edge(mod, dst, name, node.lineno))
    return edges


def part(mod: str) -> str:
    """`mconvert.convert.hf.source` -> `convert`; the package itself -> ``."""
    pieces = mod.split(".")
    return pieces[1] if len(pieces) > 1 else ""


def find_cycles(edges: list[Edge]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), plus self-imports."""
    graph: dict[str, set[str]] = {}
    for e in edges:
        graph.setdefault(e.src, set()).add(e.dst)
        graph.setdefault(e.dst, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = [[e.src] for e in edges if e.src == e.dst]

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def layering_violations(edges: list[Edge]) -> list[str]:
    """Edges that point up a layer, or sideways where FORBIDDEN says so."""
    bad = []
    for e in edges:
        a, b = part(e.src), part(e.dst)
        if a == b:
            continue
        if a not in LAYERS or b not in LAYERS:
            bad.append(f"{e.where()}: part {a if a not in LAYERS else b!r} has no layer in LAYERS")
        elif LAYERS[b] > LAYERS[a] or (a, b) in FORBIDDEN:
            bad.append(f"{e.where()}: {a or 'mconvert'} (layer {LAYERS[a]}) may not import {b} (layer {LAYERS[b]})")
    return bad


def private_imports(edges: list[Edge]) -> list[str]:
    return [e.where() for e in edges if e.name and e.name.startswith("_") and not e.name.startswith("__")]


@pytest.fixture(scope="module")
def edges() -> list[Edge]:
    return import_edges()


def test_the_graph_covers_the_package(edges):
    # an empty scan would pass every check below: it must see the parts and the edges between them
    assert {part(m) for m in module_names()} >= {"spec", "mappings", "convert", "trainer", "validators", "cli"}
    assert ("mconvert.convert.sources", "mconvert.convert.hf.source") in {(e.src, e.dst) for e in edges}
    assert len(edges) > 200


def test_no_import_cycles(edges):
    assert find_cycles(edges) == []


def test_convert_never_imports_validators(edges):
    assert [e.where() for e in edges if part(e.src) == "convert" and part(e.dst) == "validators"] == []


def test_imports_point_down(edges):
    assert layering_violations(edges) == []


# The bytes layer stands at the bottom: files, tensors' bytes, casts, atomic output; nothing that knows a model.
IO_MAY_IMPORT = {"io", "errors", "dtypes"}


def io_reaches_up(edges: list[Edge]) -> list[str]:
    return [e.where() for e in edges if part(e.src) == "io" and part(e.dst) not in IO_MAY_IMPORT]


def test_io_imports_nothing_above_it(edges):
    assert any(part(e.src) == "io" for e in edges)  # the scan sees mconvert/io
    assert io_reaches_up(edges) == []


def test_the_io_check_catches_an_import_from_above(tmp_path):
    pkg = _write(tmp_path, {
        "__init__.py": "", "errors.py": "", "spec.py": "",
        "io/__init__.py": "", "io/ok.py": "from mconvert.errors import E\nfrom mconvert.io import ok\n",
        "io/bad.py": "def f():\n    from mconvert.spec import ModelSpec\n    from mconvert.convert.hf import source\n",
    })
    assert io_reaches_up(import_edges(pkg)) == ["mconvert.io.bad:2 imports mconvert.spec.ModelSpec",
                                                "mconvert.io.bad:3 imports mconvert.convert.hf.source"]


def test_no_private_names_across_modules(edges):
    assert private_imports(edges) == []


# ---- the checks themselves catch what they are for (graphs we build, not mconvert's) -------------------------
def _write(root: Path, files: dict[str, str]) -> Path:
    pkg = root / "mconvert"
    for name, text in files.items():
        f = pkg / name
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(text)
    return pkg


def test_checks_catch_a_hidden_cycle_an_upward_import_and_a_private_name(tmp_path):
    pkg = _write(tmp_path, {
        "__init__.py": "",
        "spec.py": "def f():\n    from mconvert.mappings import plugin  # hidden in a function\n",
        "mappings/__init__.py": "",
        "mappings/plugin.py": "from mconvert.spec import f\nfrom .keys import _flatten\n",
        "mappings/keys.py": "def _flatten(): ...\n",
        "convert/__init__.py": "",
        "convert/deploy/onnx.py": "def g():\n    from mconvert.validators import onnx_runner\n",
        "validators/__init__.py": "",
        "validators/onnx_runner.py": "",
    })
    found = import_edges(pkg)
    assert find_cycles(found) == [["mconvert.mappings.plugin", "mconvert.spec"]]
    assert private_imports(found) == ["mconvert.mappings.plugin:2 imports mconvert.mappings.keys._flatten"]
    bad = layering_violations(found)
    assert any(b.startswith("mconvert.spec:2 imports mconvert.mappings.plugin: spec (layer 1)") for b in bad)
    assert any(b.startswith("mconvert.convert.deploy.onnx:2 imports mconvert.validators.onnx_runner") for b in bad)
