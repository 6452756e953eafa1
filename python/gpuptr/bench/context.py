"""The context of an address (``b.addr``, inside gpuptr memory): the
registry against the driver query, and ``wrap`` against numba's
MemoryPointer."""

from __future__ import annotations

from typing import Any, Callable

from gpuptr.bench._bench import Bench, Pair


def cupy_array() -> Any:
    """A CuPy array of 1 Mi float32 zeros (the peer rows' foreign array)."""
    import cupy

    return cupy.zeros(1 << 20, dtype=cupy.float32)


def rows(b: Bench) -> None:
    import gpuptr
    from gpuptr import _testing

    addr = b.addr
    # Rows that need only gpuptr: the registry against the driver query.
    b.row(
        "context of an address: registry hit",
        "driver query (cuPointerGetAttributes)",
        lambda: (lambda: gpuptr.context_of(addr + 64), lambda: _testing.query_context(addr + 64)),
    )

    def wrap_setup(known: bool) -> Callable[[], Pair]:
        def setup() -> Pair:
            b.need_gpu()
            from cuda.bindings import driver as cu
            from numba import cuda
            from numba.cuda.cudadrv import driver as nd

            arr = cupy_array()
            p, n = arr.data.ptr, arr.nbytes
            cuda.current_context()
            keep = gpuptr.wrap(p, n, owner=arr) if known else None
            # `keep` holds the range known for the whole row.
            ours = lambda keep=keep: gpuptr.wrap(p, n, owner=arr).context  # noqa: E731
            theirs = lambda: nd.MemoryPointer(cuda.current_context(), cu.CUdeviceptr(p), n, owner=arr)  # noqa: E731
            return ours, theirs

        return setup

    b.row("wrap + .context, known range", "numba MemoryPointer(current_context())", wrap_setup(True))
    b.row("wrap + .context, first sight", "numba MemoryPointer(current_context())", wrap_setup(False))

    def ctx_setup() -> Pair:
        b.need_gpu()
        from cuda.bindings import driver as cu

        attr = cu.CUpointer_attribute.CU_POINTER_ATTRIBUTE_CONTEXT
        return (lambda: gpuptr.context_of(addr + 64)), (lambda: cu.cuPointerGetAttribute(attr, addr + 64))

    b.row("context of an address (cached)", "cuPointerGetAttribute (cuda.bindings)", ctx_setup)
