"""One rule for the errors of like mistakes (README, "Errors"), over every
public entry point that takes a size, a count, an offset, a device, a byte
or an address:

- a value of the wrong type is a ``TypeError``;
- an int outside its argument's own range is ``InvalidArgumentError``;
- memory gpuptr cannot reach (an address with no memory there, memory that
  was freed, bounds that run past the end of their memory) is
  ``InvalidPointerError``.
"""

from __future__ import annotations

import ctypes

import pytest

import gpuptr

np = pytest.importorskip("numpy")

WRONG_TYPES = [1.5, np.float32(1.0), "8", b"8", True, np.True_, 1j, np.complex64(1), object()]
OUT_OF_RANGE = [-1, 2**64, -(2**70)]


@pytest.fixture
def mem():
    m = gpuptr.alloc(4096)
    yield m
    m.free()


def _host(kind):
    """A live host allocation of 4096 bytes: pinned, mapped or managed."""
    made = {
        "pinned": lambda: gpuptr.alloc_host(4096),
        "mapped": lambda: gpuptr.alloc_host(4096, mapped=True),
        "managed": lambda: gpuptr.alloc_managed(4096),
    }[kind]()
    _host.keep.append(made)
    return made.device_pointer_value if kind == "managed" else made.host_pointer


_host.keep = []


# Arguments that take an int, and nothing else.
INTS = {
    "alloc nbytes": lambda m, v: gpuptr.alloc(v),
    "alloc device": lambda m, v: gpuptr.alloc(8, device=v),
    "alloc_host nbytes": lambda m, v: gpuptr.alloc_host(v),
    "alloc_managed nbytes": lambda m, v: gpuptr.alloc_managed(v),
    "wrap nbytes": lambda m, v: gpuptr.wrap(m.device_pointer_value, v),
    "MemoryPointer size": lambda m, v: gpuptr.MemoryPointer(None, m.device_pointer_value, v),
    "Context.memalloc size": lambda m, v: gpuptr.context(0).memalloc(v),
    "PinnedMemory size": lambda m, v: gpuptr.PinnedMemory(None, _host("pinned"), v),
    "MappedMemory size": lambda m, v: gpuptr.MappedMemory(None, _host("mapped"), v),
    "ManagedMemory size": lambda m, v: gpuptr.ManagedMemory(None, _host("managed"), v),
    "view start": lambda m, v: m.view(v),
    "view stop": lambda m, v: m.view(0, v),
    "memset byte": lambda m, v: m.memset(v),
    "memset count": lambda m, v: m.memset(0, count=v),
    "copy_from_device count": lambda m, v: m.copy_from_device(m, count=v),
    "context device": lambda m, v: gpuptr.context(v),
    "Device": lambda m, v: gpuptr.Device(v),
    "flush_pool device": lambda m, v: gpuptr.flush_pool(v),
    "as_array shape": lambda m, v: gpuptr.as_array(m, v, "uint8"),
    "as_array dimension": lambda m, v: gpuptr.as_array(m, (1, v), "uint8"),
}

# Sizes of the pool's settings: an int, a size string or a share too.
SIZES = {
    "set_pool_limit nbytes": lambda m, v: gpuptr.set_pool_limit(v),
    "reserve nbytes": lambda m, v: gpuptr.reserve(v),
    "reserve block_size": lambda m, v: gpuptr.reserve(1 << 20, block_size=v),
}

ADDRESSES = {
    "wrap address": lambda m, v: gpuptr.wrap(v, 8),
    "MemoryPointer pointer": lambda m, v: gpuptr.MemoryPointer(None, v, 8),
    "context_of address": lambda m, v: gpuptr.context_of(v),
    "PinnedMemory pointer": lambda m, v: gpuptr.PinnedMemory(None, v, 64),
    "MappedMemory pointer": lambda m, v: gpuptr.MappedMemory(None, v, 64),
    "ManagedMemory pointer": lambda m, v: gpuptr.ManagedMemory(None, v, 64),
}


def _host_address():
    buf = ctypes.create_string_buffer(64)
    _host_address.keep = buf
    return ctypes.addressof(buf)


def _raises(error, call):
    with pytest.raises(error) as e:
        call()
    if error is TypeError:
        assert not isinstance(e.value, gpuptr.GpuptrError), e.value
    return e.value


@pytest.fixture(autouse=True)
def no_pool_limit():
    yield
    gpuptr.set_pool_limit(None)


@pytest.mark.parametrize("name", sorted(INTS) + sorted(SIZES) + sorted(ADDRESSES))
def test_a_value_of_the_wrong_type_is_a_type_error(name, mem):
    call = {**INTS, **SIZES, **ADDRESSES}[name]
    # A size of the pool's settings takes a string or a float (a share) as
    # well: only its wrong types are.
    wrong = [v for v in WRONG_TYPES if not isinstance(v, (str, float, np.floating))] if name in SIZES else WRONG_TYPES
    for value in wrong:
        _raises(TypeError, lambda: call(mem, value))


@pytest.mark.parametrize("name", sorted(INTS) + sorted(SIZES))
def test_an_int_out_of_its_arguments_range_is_invalid_argument(name, mem):
    call = {**INTS, **SIZES}[name]
    extra = {"memset byte": [256], "alloc device": [64], "context device": [64], "Device": [64]}
    for value in OUT_OF_RANGE + extra.get(name, []):
        e = _raises(gpuptr.InvalidArgumentError, lambda: call(mem, value))
        assert isinstance(e, ValueError)


@pytest.mark.parametrize("name", sorted(ADDRESSES))
def test_an_address_with_no_memory_there_is_invalid_pointer(name, mem):
    # Null (None is a null pointer, as ctypes.c_void_p(None)), no address
    # at all, host memory gpuptr does not know, and none.
    for value in [0, None, -1, 2**64, -(2**70), _host_address(), 0x1003]:
        e = _raises(gpuptr.InvalidPointerError, lambda: ADDRESSES[name](mem, value))
        assert isinstance(e, ValueError)


BEYOND = {
    "view past the end": lambda m: m.view(0, m.size + 1),
    "view starting past the end": lambda m: m.view(m.size + 1),
    "view reversed": lambda m: m.view(8, 4),
    "memset count past the end": lambda m: m.memset(0, count=m.size + 1),
    "copy_from_host past the end": lambda m: m.copy_from_host(b"x" * (m.size + 1)),
    "copy_from_device count past the end": lambda m: m.copy_from_device(gpuptr.alloc(m.size + 64), count=m.size + 1),
    "wrap past the allocation": lambda m: gpuptr.wrap(m.device_pointer_value, 1 << 40),
    "PinnedMemory past the allocation": lambda m: gpuptr.PinnedMemory(None, _host("pinned"), 4097),
    "as_array past the end": lambda m: gpuptr.as_array(m, m.size + 1, "uint8"),
    "use after free": lambda m: (m.free(), m.memset(0)),
}


@pytest.mark.parametrize("name", sorted(BEYOND))
def test_bounds_past_the_memory_and_freed_memory_are_invalid_pointer(name, mem):
    _raises(gpuptr.InvalidPointerError, lambda: BEYOND[name](mem))


def test_the_tables_cover_every_public_function_that_takes_bytes_or_an_address():
    # A new public entry point with such an argument joins the tables above.
    # (ArrayView's ``pointer`` is a MemoryPointer, not an address.)
    import inspect

    covered = {name.split()[0].split(".")[0] for name in {**INTS, **SIZES, **ADDRESSES}}
    missing = []
    for name in dir(gpuptr):
        f = getattr(gpuptr, name)
        if name.startswith("_") or not callable(f):
            continue
        try:
            params = set(inspect.signature(f).parameters)
        except (TypeError, ValueError):
            continue
        if params & {"nbytes", "address", "pointer"} and name not in covered | {"ArrayView"}:
            missing.append(name)
    assert not missing, missing


@pytest.mark.parametrize("make", [
    lambda m, c: gpuptr.MemoryPointer(c, m.device_pointer_value, 8),
    lambda m, c: gpuptr.wrap(m.device_pointer_value, 8, context=c),
    lambda m, c: gpuptr.PinnedMemory(c, 0x1000, 8),
], ids=["MemoryPointer", "wrap", "PinnedMemory"])
@pytest.mark.parametrize("context", [0, 1.5, "ctx", object()], ids=repr)
def test_a_context_of_the_wrong_type_is_a_type_error(mem, make, context):
    with pytest.raises(TypeError, match="context"):
        make(mem, context)
