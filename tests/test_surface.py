"""The public surface: no test hooks in ``gpuptr``, ``gpuptr._core`` or
their stubs (they live in ``gpuptr._testing``), and one error type for each
kind of bad argument, whichever function takes it."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import gpuptr
from gpuptr import _core, _testing

HOOK_PREFIXES = ("_sim", "sim_", "_primary_context_state", "_query_context", "_reset")
STUB = Path(__file__).resolve().parent.parent / "python" / "gpuptr" / "_core.pyi"


def _stub_names() -> set[str]:
    tree = ast.parse(STUB.read_text())
    names = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    for n in tree.body:
        if isinstance(n, ast.Assign) and any(getattr(t, "id", "") == "__all__" for t in n.targets):
            names |= {e.value for e in n.value.elts}  # type: ignore[attr-defined]
    return names


@pytest.mark.parametrize(
    "where, names",
    [
        ("dir(gpuptr)", lambda: dir(gpuptr)),
        ("gpuptr.__all__", lambda: gpuptr.__all__),
        ("dir(gpuptr._core)", lambda: dir(_core)),
        ("gpuptr._core.__all__", lambda: _core.__all__),
        ("_core.pyi", _stub_names),
    ],
)
def test_no_test_hooks_on_the_public_surface(where, names):
    hooks = [n for n in names() if n.startswith(HOOK_PREFIXES)]
    assert hooks == [], f"{where} has test hooks {hooks}"


def test_the_hooks_live_in_gpuptr_testing_and_the_reset_has_a_public_name():
    assert callable(_testing.sim_live_bytes) and callable(_testing.query_context)
    assert "reset_context" in gpuptr.__all__ and gpuptr.reset_context is _core.reset_context


@pytest.mark.parametrize(
    "call",
    [
        lambda: gpuptr.alloc(64, device=-1),
        lambda: gpuptr.reserve(1 << 20, device=-1),
        lambda: gpuptr.alloc_host(64, device=-1),
        lambda: gpuptr.alloc_managed(64, device=-1),
        lambda: gpuptr.register_host(bytearray(64), device=-1),
        lambda: gpuptr.context(-1),
        lambda: gpuptr.flush_pool(-1),
        lambda: gpuptr.reset_context(-1),
    ],
)
def test_a_negative_device_is_an_invalid_argument_everywhere(call):
    with pytest.raises(gpuptr.InvalidArgumentError):
        call()


@pytest.mark.parametrize(
    "call",
    [
        lambda: gpuptr.alloc(64, device=True),
        lambda: gpuptr.alloc_host(64, device=1.0),
        lambda: gpuptr.flush_pool("0"),
        lambda: gpuptr.reset_context(None),
    ],
)
def test_a_device_that_is_not_an_int_is_a_type_error_everywhere(call):
    with pytest.raises(TypeError):
        call()


class _Index:
    """An int-like object (as numpy's integers are), or one whose
    ``__index__`` raises ``error``."""

    def __init__(self, value=0, error=None):
        self.value, self.error = value, error

    def __index__(self):
        if self.error is not None:
            raise self.error
        return self.value


def test_an_int_like_device_or_size_is_taken_and_its_own_error_propagates():
    # memory_summary(obj) compared the object with device numbers and gave
    # an empty string; an error raised in __index__ (KeyboardInterrupt among
    # them) became "must be an int".
    assert gpuptr.memory_summary(_Index(0)) == gpuptr.memory_summary(0) != ""
    gpuptr.alloc(_Index(64), device=_Index(0)).free()
    for error in (ValueError("mine"), KeyboardInterrupt()):
        for call in (
            lambda i: gpuptr.alloc(i),
            lambda i: gpuptr.alloc(64, device=i),
            lambda i: gpuptr.memory_allocated(i),
            lambda i: gpuptr.memory_summary(i),
        ):
            with pytest.raises(type(error)):
                call(_Index(error=error))


def _binding_imports():
    """Each src/python/*.rs file's references to its siblings."""
    import pathlib
    import re

    root = pathlib.Path(__file__).resolve().parents[1] / "src" / "python"
    if not root.is_dir():
        pytest.skip("needs the source tree")
    files = {p.stem: p.read_text() for p in root.glob("*.rs")}
    deps = {}
    for name, text in files.items():
        if name == "mod":
            continue
        used = set(re.findall(r"\bsuper::([a-z_]+)::", text))
        used |= {m for m in re.findall(r"use super::\{?([a-z_]+)", text)}
        deps[name] = {u for u in used if u in files and u != name}
    return files, deps


def test_binding_modules_depend_on_each_other_in_one_direction():
    _, deps = _binding_imports()
    seen, stack = set(), []

    def visit(n):
        if n in stack:
            raise AssertionError("import loop: " + " -> ".join(stack[stack.index(n):] + [n]))
        if n in seen:
            return
        stack.append(n)
        for d in sorted(deps.get(n, ())):
            visit(d)
        stack.pop()
        seen.add(n)

    for n in sorted(deps):
        visit(n)
    # `shutdown` (the calls into Python that exit closes) is a leaf below args.
    assert deps["args"] <= {"shutdown"} and deps["shutdown"] == set() and deps["dlpack"] == set(), deps


def test_the_binding_never_calls_the_driver():
    files, _ = _binding_imports()
    for name, text in files.items():
        assert "crate::driver" not in text, name
