"""Imports go one way. In the Python glue, no module of ``gpuptr`` imports,
at any depth, a module that imports it back (counted from the ``import``
and ``from ... import`` statements of the package's own files, lazy ones
inside functions included). In the Rust crate, no room of ``src/`` (a
folder, or a file at the top) names another that names it back, counted
from the ``crate::`` paths of its code (comments aside; a name the crate
root re-exports counts for the room it comes from)."""

import ast
import collections
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "python" / "gpuptr"
SRC = ROOT / "src"


def imports_of(path: pathlib.Path) -> set:
    """The gpuptr modules ``path`` imports, by dotted name."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "gpuptr":
            # ``from gpuptr.bench import runner`` names the submodule (its
            # package is only where it lives); ``from gpuptr import flag``
            # names the package.
            folder = PACKAGE.parent.joinpath(*node.module.split("."))
            for a in node.names:
                sub = folder / a.name
                if sub.with_suffix(".py").exists() or sub.is_dir():
                    out.add(f"{node.module}.{a.name}")
                elif node.module != "gpuptr":
                    out.add(node.module)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("gpuptr."))
    return out


def modules() -> dict:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def test_no_module_of_the_package_imports_itself_back():
    mods = modules()
    # The package's __init__ re-exports the public names, which every
    # submodule may use (``import gpuptr``): the top package is left out.
    graph = {m: {i for i in imports_of(p) if i in mods and i != m} for m, p in mods.items() if m != "gpuptr"}
    circles = []

    def walk(start, node, seen):
        for nxt in graph.get(node, ()):
            if nxt == start:
                circles.append(seen + [nxt])
            elif nxt not in seen:
                walk(start, nxt, seen + [nxt])

    for m in graph:
        walk(m, m, [m])
    assert circles == [], circles


def test_the_check_sees_a_circle():
    # The walk above finds a circle where one is: two throwaway modules.
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        a, b = pathlib.Path(d, "a.py"), pathlib.Path(d, "b.py")
        a.write_text("from gpuptr.b import x\n")
        b.write_text("def f():\n    from gpuptr.a import y\n")
        assert imports_of(a) == {"gpuptr.b"} and imports_of(b) == {"gpuptr.a"}


def circles(graph: dict) -> list:
    """The strongly connected sets of more than one node (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
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

    for v in list(graph):
        if v not in index:
            visit(v)
    return out


def rust_rooms(src: pathlib.Path) -> dict:
    """Room -> the rooms its code names through ``crate::``."""
    lib = (src / "lib.rs").read_text()
    exported = {}
    for m in re.finditer(r"pub use (\w+)::\{([^}]*)\};", lib):
        for name in re.findall(r"\w+", m.group(2)):
            exported[name] = m.group(1)
    for m in re.finditer(r"pub use (\w+)::(\w+);", lib):
        exported[m.group(2)] = m.group(1)
    rooms = {p.stem if p.is_file() else p.name for p in src.iterdir() if p.suffix == ".rs" or p.is_dir()}
    rooms.discard("lib")
    graph = collections.defaultdict(set)
    for f in src.rglob("*.rs"):
        parts = f.relative_to(src).parts
        if f.name == "lib.rs" or "tests" in parts:
            continue
        room = parts[0] if len(parts) > 1 else f.stem
        code = "\n".join(line.split("//")[0] for line in f.read_text().splitlines())
        for m in re.finditer(r"crate::(\{[^}]*\}|\w+)", code):
            names = re.findall(r"\w+", m.group(1))
            for name in names if m.group(1).startswith("{") else names[:1]:
                target = name if name in rooms else exported.get(name)
                if target and target != room:
                    graph[room].add(target)
    return graph


def test_no_room_of_the_crate_names_one_that_names_it_back():
    graph = rust_rooms(SRC)
    assert graph["runtime"] >= {"device", "context", "memory"}, "the walk reads the crate"
    assert circles(graph) == [], circles(graph)
    # The line the core stands on: each of these uses only those before it.
    line = ["driver", "pool", "device", "context", "memory", "runtime", "python"]
    for i, room in enumerate(line):
        above = set(line[i + 1 :])
        assert not graph[room] & above, f"{room} names {graph[room] & above}"


def test_the_rust_check_sees_a_circle(tmp_path):
    (tmp_path / "lib.rs").write_text("mod a;\nmod b;\npub use b::Thing;\n")
    (tmp_path / "a.rs").write_text("use crate::b::f; // crate::c in a comment is no import\n")
    (tmp_path / "b.rs").write_text("fn g() { crate::a::h() }\n")
    (tmp_path / "c.rs").write_text("use crate::{Thing};\n")
    graph = rust_rooms(tmp_path)
    assert graph == {"a": {"b"}, "b": {"a"}, "c": {"b"}}
    assert circles(graph) == [["a", "b"]]
