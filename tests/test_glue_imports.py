"""The Python glue imports one way: no module of ``gpuptr`` imports, at any
depth, a module that imports it back (counted from the ``import`` and
``from ... import`` statements of the package's own files, lazy ones inside
functions included)."""

import ast
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "python" / "gpuptr"


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
