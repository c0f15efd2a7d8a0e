"""The package's shape (issue 14): no upward imports, no import cycles, a docstring on every public class.

Read from the source with :mod:`ast`; nothing under ``kvxfer/`` is imported, so this runs anywhere.

Layers, bottom to top (a module may import its own layer and any layer below it, never one above):

0. ``kvxfer.errors`` and ``kvxfer._version``
1. ``kvxfer.core`` (with the compiled ``kvxfer._native``)
2. ``kvxfer.wire``
3. ``kvxfer.transport`` (with the compiled ``kvxfer._verbs``)
4. ``kvxfer.engine``
5. ``kvxfer.integrations``
6. ``kvxfer.tools`` (may use integrations; nothing below imports a tool)
7. the front: ``kvxfer/__init__.py`` and ``kvxfer/__main__.py`` (may import anything, imported by nothing)

What counts as an import of a module (an edge):

* ``import kvxfer.a.b`` and ``from kvxfer.a import b`` / ``from .a import b``, absolute or relative, at
  module level, in functions, in classes, anywhere in the file;
* ``importlib.import_module("kvxfer.a.b")`` (or ``__import__``) with a literal name, and, one step
  removed, a call with a literal name to a function of the same module that hands its parameter to
  ``import_module`` (``_lazy(parser, "kvxfer.tools.simulate")`` in the CLI);
* importing ``a.b.c`` runs the ``__init__`` of every package on the way, so ``a.b`` counts too, except
  packages that already contain the importer (they are loaded before it) and the front ``kvxfer``;
  ``from <own package> import NAME`` of a name defined in that package's ``__init__`` is a real edge.

Imports under ``if TYPE_CHECKING:`` never run: they obey the layers but are not edges of a cycle.
Module path strings that are data, not imports (``kvxfer/transport/registry.py``'s table of
transports, ``-m kvxfer....`` arguments of a subprocess), are not imports.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "kvxfer"

FRONT = 7
LAYERS: dict[str, int] = {
    "kvxfer.errors": 0,
    "kvxfer._version": 0,
    "kvxfer.core": 1,
    "kvxfer._native": 1,  # compiled from native/, used by kvxfer.core.native
    "kvxfer.wire": 2,
    "kvxfer.transport": 3,
    "kvxfer._verbs": 3,  # compiled from native/, used by kvxfer.transport.verbs
    "kvxfer.engine": 4,
    "kvxfer.integrations": 5,
    "kvxfer.tools": 6,
    "kvxfer": FRONT,
    "kvxfer.__main__": FRONT,
}
LAYER_NAMES = {0: "errors/_version", 1: "core", 2: "wire", 3: "transport", 4: "engine", 5: "integrations", 6: "tools",
               FRONT: "the package front"}
# Compiled modules: no Python source to read, they import nothing of kvxfer.
EXTENSIONS = ("kvxfer._native", "kvxfer._verbs")
# Files whose module path strings are data (a name -> module table), never imports.
NO_STRING_IMPORTS = {"kvxfer/transport/registry.py"}


@dataclass(frozen=True)
class Edge:
    """One import of ``target`` by ``source`` at ``path:line``; ``kind`` says how it was found."""

    source: str
    target: str
    path: str
    line: int
    kind: str  # "module", "function", "type-checking", "string", "package-init"

    @property
    def where(self) -> str:
        return f"{self.path}:{self.line}"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def is_package(path: Path) -> bool:
    return path.name == "__init__.py"


def sources() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py")) if "__pycache__" not in p.parts}


def layer_of(module: str) -> int:
    best = ""
    for prefix in LAYERS:
        if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > len(best):
            best = prefix
    if best == "kvxfer" and module != "kvxfer":
        raise AssertionError(f"{module} is in no layer: give it one in tests/test_layers.py LAYERS")
    return LAYERS[best]


def ancestors(module: str) -> list[str]:
    parts = module.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


class _Collector(ast.NodeVisitor):
    """Every import statement and literal ``import_module`` call of one file, with its context."""

    def __init__(self, module: str, package: bool, strings: bool) -> None:
        self.module = module
        self.package = package
        self.strings = strings
        self.depth = 0  # > 0 inside a function body
        self.type_checking = 0
        self.found: list[tuple[str, list[str], int, str]] = []  # (base module, names, line, kind)
        self.lazy_helpers: dict[str, int] = {}  # function -> index of the parameter it imports

    def _kind(self) -> str:
        if self.type_checking:
            return "type-checking"
        return "function" if self.depth else "module"

    def _base(self, level: int, module: str | None) -> str:
        if level == 0:
            return module or ""
        parts = self.module.split(".")
        if not self.package:
            parts = parts[:-1]
        if level - 1:
            parts = parts[: -(level - 1)]
        if module:
            parts.append(module)
        return ".".join(parts)

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self.found.append((alias.name, [], node.lineno, self._kind()))

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        base = self._base(node.level, node.module)
        self.found.append((base, [a.name for a in node.names], node.lineno, self._kind()))

    def _function(self, node: ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda) -> None:
        self.depth += 1
        self.generic_visit(node)
        self.depth -= 1

    def visit_FunctionDef(self, node: ast.FunctionDef) -> None:
        params = [a.arg for a in node.args.posonlyargs + node.args.args]
        for call in ast.walk(node):
            if _is_import_call(call) and call.args and isinstance(call.args[0], ast.Name) and call.args[0].id in params:
                self.lazy_helpers[node.name] = params.index(call.args[0].id)
        self._function(node)

    visit_AsyncFunctionDef = visit_FunctionDef  # type: ignore[assignment]
    visit_Lambda = _function  # type: ignore[assignment]

    def visit_If(self, node: ast.If) -> None:
        test = node.test
        guarded = (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
            isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")
        if not guarded:
            self.generic_visit(node)
            return
        self.type_checking += 1
        for child in node.body:
            self.visit(child)
        self.type_checking -= 1
        for child in node.orelse:
            self.visit(child)

    def visit_Call(self, node: ast.Call) -> None:
        if self.strings:
            if _is_import_call(node) and node.args and _literal(node.args[0]):
                self.found.append((node.args[0].value, [], node.lineno, "string"))
            self.calls.append(node)
        self.generic_visit(node)

    calls: list[ast.Call]

    def collect(self, tree: ast.Module) -> list[tuple[str, list[str], int, str]]:
        self.calls = []
        self.visit(tree)
        for call in self.calls:  # one step removed: _lazy(parser, "kvxfer.tools.simulate")
            name = call.func.id if isinstance(call.func, ast.Name) else None
            index = self.lazy_helpers.get(name or "")
            if index is not None and len(call.args) > index and _literal(call.args[index]):
                self.found.append((call.args[index].value, [], call.lineno, "string"))
        return self.found


def _is_import_call(node: ast.AST) -> bool:
    if not isinstance(node, ast.Call):
        return False
    func = node.func
    name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
    return name in ("import_module", "__import__")


def _literal(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("kvxfer")


def _edges_to(source: str, target: str, where: str, line: int, kind: str) -> list[Edge]:
    """The edges of ``source`` importing ``target``: ``target`` itself, and the packages on the way whose
    ``__init__`` that runs (not the front, not the importer's own packages: those are loaded already)."""
    own = set(ancestors(source))
    out = []
    for parent in ancestors(target):
        if parent != "kvxfer" and parent not in own and parent != source:
            out.append(Edge(source, parent, where, line, "package-init" if kind != "type-checking" else kind))
    if target != source:
        out.append(Edge(source, target, where, line, kind))
    return out


def import_graph() -> tuple[list[Edge], list[str]]:
    """Every edge between kvxfer modules, and every kvxfer import that names no module."""
    files = sources()
    known = set(files) | set(EXTENSIONS)
    edges: list[Edge] = []
    unresolved: list[str] = []
    for module, path in files.items():
        rel = path.relative_to(ROOT).as_posix()
        tree = ast.parse(path.read_text(), filename=rel)
        collector = _Collector(module, is_package(path), rel not in NO_STRING_IMPORTS)
        for base, names, line, kind in collector.collect(tree):
            if base != "kvxfer" and not base.startswith("kvxfer."):
                continue
            if base not in known:
                unresolved.append(f"{rel}:{line}: {'from ' if names else ''}{base}")
                continue
            if not names:  # import a.b.c / import_module("a.b.c")
                edges += _edges_to(module, base, rel, line, kind)
            for name in names:
                # from a.b import c: c a module -> that module (a.b's __init__ runs on the way);
                # c a name -> a.b itself (its __init__ if a package), even when a.b contains the importer
                sub = f"{base}.{name}"
                edges += _edges_to(module, sub if sub in known else base, rel, line, kind)
    return sorted(set(edges), key=lambda e: (e.path, e.line, e.target)), unresolved


# ---------------------------------------------------------------------------------------------------------------
def test_every_kvxfer_import_names_a_module():
    _, unresolved = import_graph()
    assert not unresolved, "imports of kvxfer modules that do not exist:\n" + "\n".join(unresolved)


def test_every_module_has_a_layer():
    for module in sources():
        layer_of(module)


def test_no_import_goes_up_a_layer():
    edges, _ = import_graph()
    upward = []
    for e in edges:
        low, high = layer_of(e.source), layer_of(e.target)
        if high > low:
            upward.append(f"{e.where}: {e.source} ({LAYER_NAMES[low]}) imports {e.target} "
                          f"({LAYER_NAMES[high]}) [{e.kind}]")
    assert not upward, f"{len(upward)} upward import(s):\n" + "\n".join(upward)


def cycles(edges: list[Edge]) -> list[list[Edge]]:
    """One concrete cycle per strongly connected component of more than one module."""
    graph: dict[str, dict[str, Edge]] = {}
    for e in edges:
        if e.kind != "type-checking" and e.source != e.target:
            graph.setdefault(e.source, {}).setdefault(e.target, e)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def strongconnect(v: str) -> None:  # Tarjan; the package is far too small to hit the recursion limit
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, {})):
            if w not in index:
                strongconnect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            strongconnect(v)
    found = []
    for component in components:  # shortest cycles until every module of the component is on one
        members = set(component)
        covered: set[str] = set()
        for start in component:
            if start in covered:
                continue
            cycle = _shortest_cycle(graph, members, start)
            covered.update(e.source for e in cycle)
            found.append(cycle)
    return found


def _shortest_cycle(graph: dict[str, dict[str, Edge]], members: set[str], start: str) -> list[Edge]:
    paths: dict[str, list[Edge]] = {start: []}
    queue = [start]
    while queue:
        v = queue.pop(0)
        for w, e in sorted(graph.get(v, {}).items()):
            if w == start:
                return paths[v] + [e]
            if w in members and w not in paths:
                paths[w] = paths[v] + [e]
                queue.append(w)
    raise AssertionError(f"{start} is on no cycle of its component")  # pragma: no cover - Tarjan says it is


def test_no_import_cycles():
    edges, _ = import_graph()
    found = cycles(edges)
    report = []
    for cycle in found:
        chain = " -> ".join([cycle[0].source] + [e.target for e in cycle])
        report.append(chain + "\n" + "\n".join(f"    {e.where}: {e.source} imports {e.target} [{e.kind}]"
                                              for e in cycle))
    assert not found, f"{len(found)} import cycle(s):\n" + "\n".join(report)


def _undocumented(body: list[ast.stmt], rel: str, prefix: str = "") -> list[str]:
    """Public classes in ``body`` (and nested in them, and under module-level if/try) without a docstring;
    classes local to a function are not public."""
    out = []
    for node in body:
        if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
            if not (ast.get_docstring(node) or "").strip():
                out.append(f"{rel}:{node.lineno}: class {prefix}{node.name}")
            out += _undocumented(node.body, rel, f"{prefix}{node.name}.")
        elif isinstance(node, (ast.If, ast.Try)):
            inner = node.body + node.orelse + getattr(node, "finalbody", [])
            for handler in getattr(node, "handlers", []):
                inner += handler.body
            out += _undocumented(inner, rel, prefix)
    return out


def public_classes_without_docstring() -> list[str]:
    out = []
    for path in sources().values():
        rel = path.relative_to(ROOT).as_posix()
        out += _undocumented(ast.parse(path.read_text(), filename=rel).body, rel)
    return out


def test_every_public_class_has_a_docstring():
    missing = public_classes_without_docstring()
    assert not missing, f"{len(missing)} public class(es) without a docstring:\n" + "\n".join(missing)


# The checks themselves: each one sees a violation planted in a scratch copy of the rules' input.
def test_the_checks_catch_planted_violations():
    up = Edge("kvxfer.core.ledger", "kvxfer.engine.base", "kvxfer/core/ledger.py", 1, "function")
    assert layer_of(up.target) > layer_of(up.source)
    a = Edge("kvxfer.core.a", "kvxfer.core.b", "a.py", 1, "module")
    b = Edge("kvxfer.core.b", "kvxfer.core.a", "b.py", 7, "function")
    assert [[e.where for e in c] for c in cycles([a, b])] == [["a.py:1", "b.py:7"]]
    hidden = Edge("kvxfer.core.b", "kvxfer.core.a", "b.py", 7, "type-checking")
    assert cycles([a, hidden]) == []
    for stmt, base, names in [
        ("from . import x", "kvxfer.core", ["x"]),
        ("from .. import errors", "kvxfer", ["errors"]),
        ("from ..engine.base import E", "kvxfer.engine.base", ["E"]),
        ("import kvxfer.wire.frames", "kvxfer.wire.frames", []),
        ("importlib.import_module('kvxfer.tools.node')", "kvxfer.tools.node", []),
        ("def f(m):\n    import_module(m)\nf('kvxfer.tools.demo')", "kvxfer.tools.demo", []),
    ]:
        found = _Collector("kvxfer.core.ledger", False, True).collect(ast.parse(stmt))
        assert [(f[0], f[1]) for f in found] == [(base, names)], stmt
    # entering another package runs its __init__; the importer's own packages are loaded already
    into = _edges_to("kvxfer.tools.node", "kvxfer.tools.bench.loops", "node.py", 3, "function")
    assert [(e.target, e.kind) for e in into] == [("kvxfer.tools.bench", "package-init"),
                                                 ("kvxfer.tools.bench.loops", "function")]
    sibling = _edges_to("kvxfer.engine.decode", "kvxfer.engine.base", "decode.py", 1, "module")
    assert [e.target for e in sibling] == ["kvxfer.engine.base"]
    parent_name = _edges_to("kvxfer.engine.decode", "kvxfer.engine", "decode.py", 1, "module")
    assert [e.target for e in parent_name] == ["kvxfer.engine"]  # from . import NAME: the __init__ is needed
    doc = 'class A:\n    pass\nclass _B:\n    pass\nclass C:\n    "Doc."\n    class D:\n        pass\n'
    assert _undocumented(ast.parse(doc).body, "m.py") == ["m.py:1: class A", "m.py:7: class C.D"]


def test_limits_the_core_checks_are_the_limits_the_wire_encodes():
    """kvxfer.core.arguments cannot import kvxfer.wire.messages; the values they share must agree."""
    from kvxfer.core import arguments
    from kvxfer.wire import messages

    assert (arguments.MAX_RID_STR, arguments.U64) == (messages.MAX_RID_STR, messages.U64)
