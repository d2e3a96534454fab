"""The house as built: no import circles between aiocompile's modules, no module reading
another's objects' private attributes, private code in its rooms, and modules a newcomer
can read in one sitting. Read from the source, so nothing here imports what it checks."""

from __future__ import annotations

import ast
import pathlib
from collections.abc import Iterator

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "aiocompile"
# What may stand at the top of the package: the front door and the public faces.
TOP = {"__init__", "__main__", "errors", "records", "results", "lowlevel", "torch", "dask", "prometheus", "cli"}
MAX_LINES = 650


def _modules() -> dict[str, pathlib.Path]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


MODULES = _modules()


def _is_package(name: str) -> bool:
    return MODULES[name].name == "__init__.py"


def _resolve(current: str, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = current.split(".")
    # A module's own package is its name less one part; a package's is itself.
    base = base if _is_package(current) else base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imports_of(name: str) -> Iterator[tuple[str, int]]:
    """Every aiocompile module ``name`` imports, anywhere in it (inside functions and under
    ``TYPE_CHECKING`` too), with the line; ``importlib.import_module("aiocompile...")``
    with a literal name counts as an import."""
    tree = ast.parse(MODULES[name].read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in MODULES:
                    yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            target = _resolve(name, node)
            if not target.startswith("aiocompile"):
                continue
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                if sub in MODULES:
                    yield sub, node.lineno
                elif target in MODULES:
                    yield target, node.lineno
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr == "import_module" and node.args
              and isinstance(node.args[0], ast.Constant) and node.args[0].value in MODULES):
            yield node.args[0].value, node.lineno


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (or a module importing
    itself): Tarjan's algorithm."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1 or node in graph.get(node, ()):
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def import_graph() -> dict[str, set[str]]:
    return {name: {target for target, _ in imports_of(name) if target != name} for name in MODULES}


def test_no_module_imports_itself_back_through_others() -> None:
    graph = import_graph()
    circles = _circles(graph)
    described = []
    for circle in circles:
        members = set(circle)
        arrows = [f"    {a} -> {b}" for a in circle for b in sorted(graph[a] & members)]
        described.append("  circle of " + ", ".join(circle) + ":\n" + "\n".join(arrows))
    assert not circles, "import circles (imports in functions and under TYPE_CHECKING count):\n" + "\n".join(described)


def test_the_cycle_finder_finds_a_cycle() -> None:
    # The check above is only as good as this: a circle of three, and a module on its own.
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _circles({"a": {"b"}, "b": set()}) == []


def _private_attributes_by_class(sources: dict[str, str]) -> dict[str, set[str]]:
    """Every private attribute a class of aiocompile defines (methods, class attributes,
    ``self._x`` it sets, annotated fields) -> the classes that define it."""
    defined: dict[str, set[str]] = {}

    def add(name: str, owner: str) -> None:
        if name.startswith("_") and not name.startswith("__"):
            defined.setdefault(name, set()).add(owner)

    for source in sources.values():
        for cls in (n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.ClassDef)):
            for node in ast.walk(cls):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    add(node.name, cls.name)
                elif (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
                      and isinstance(node.value, ast.Name) and node.value.id == "self"):
                    add(node.attr, cls.name)
                elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                    add(node.target.id, cls.name)
                elif isinstance(node, ast.Assign):
                    for target in node.targets:
                        if isinstance(target, ast.Name):
                            add(target.id, cls.name)
    return defined


def _root(node: ast.expr) -> str | None:
    while isinstance(node, ast.Attribute):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def _module_names(tree: ast.Module) -> set[str]:
    """The names a module binds to other modules (``import torch``, ``from aiocompile._pool
    import procs``): what they hold is their module's own business. Names imported from
    outside aiocompile count as modules too (their privates are not ours to police)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {alias.asname or alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            source = node.module or ""
            for alias in node.names:
                if not source.startswith("aiocompile") or f"{source}.{alias.name}" in MODULES:
                    names.add(alias.asname or alias.name)
    return names


def private_reads(sources: dict[str, str]) -> list[str]:
    """``x._name`` where ``_name`` is a private attribute some class of aiocompile defines,
    ``x`` is not ``self`` or ``cls`` (nor a module: ``torch._inductor`` is torch's business),
    and the code is not inside a class that defines ``_name`` itself (another instance of
    the same class may be read)."""
    defined = _private_attributes_by_class(sources)
    found: list[str] = []

    def visit(name: str, modules: set[str], node: ast.AST, classes: tuple[str, ...]) -> None:
        for child in ast.iter_child_nodes(node):
            inner = classes + (child.name,) if isinstance(child, ast.ClassDef) else classes
            if (isinstance(child, ast.Attribute) and child.attr in defined
                    and not (set(classes) & defined[child.attr])):
                direct = isinstance(child.value, ast.Name) and child.value.id in ("self", "cls")
                if not direct and _root(child.value) not in modules:
                    found.append(f"{name}:{child.lineno}: {ast.unparse(child)}")
            visit(name, modules, child, inner)

    for name, source in sources.items():
        tree = ast.parse(source)
        visit(name, _module_names(tree), tree, ())
    return found


def test_no_module_reads_another_objects_private_attributes() -> None:
    reads = private_reads({name: path.read_text() for name, path in MODULES.items()})
    assert not reads, "talk through a port or a public method instead:\n" + "\n".join(reads)


def test_the_private_read_finder_finds_them() -> None:
    owner = ("import torch\n"
             "class Pool:\n"
             "    def __init__(self):\n"
             "        self._lock = None\n"
             "    def same(self, other):\n"
             "        return other._lock, self._lock, torch._inductor\n")
    reader = ("class Reads:\n"
              "    def __init__(self, pool):\n"
              "        self._pool = pool\n"
              "    def go(self):\n"
              "        return self._pool._lock\n"
              "def f(pool):\n"
              "    return pool._lock\n")
    assert private_reads({"owner": owner, "reader": reader}) == [
        "reader:5: self._pool._lock", "reader:7: pool._lock"]


def test_only_the_public_faces_stand_at_the_top() -> None:
    top = {path.stem for path in PACKAGE.glob("*.py")}
    assert top <= TOP, f"private modules loose at the top: {sorted(top - TOP)}; give each a room"


def test_no_module_is_too_long_to_read_in_one_sitting() -> None:
    long = {name: len(path.read_text().splitlines()) for name, path in MODULES.items()}
    long = {name: lines for name, lines in long.items() if lines > MAX_LINES}
    assert not long, f"split these along a seam a newcomer would see: {long}"
