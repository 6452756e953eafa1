"""Side-by-side timings on one GPU, in one process (best of N, warmed up).

Rows: wrap with context against numba's MemoryPointer(current_context()),
the cached context lookup against cuPointerGetAttribute through
cuda.bindings, as_cuda_array against numba's, and raw alloc+free.
Run: python3 benches/compare.py [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import time


def best_ns(f, n: int, repeat: int = 7) -> float:
    for _ in range(min(n, 1000)):
        f()
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        for _ in range(n):
            f()
        best = min(best, (time.perf_counter() - t) / n)
    return best * 1e9


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--n", type=int, default=20000)
    args = ap.parse_args()
    n = args.n

    import cupy
    from cuda.bindings import driver as cu
    from numba import cuda
    from numba.cuda.cudadrv import driver as nd

    import gpuptr
    from gpuptr.numba import as_cuda_array

    arr = cupy.zeros(1 << 20, dtype=cupy.float32)
    p, nbytes = arr.data.ptr, arr.nbytes
    cuda.current_context()
    rows = []

    def row(name, ours, base, baseline, iters=n):
        a, b = best_ns(ours, iters), best_ns(base, iters)
        rows.append({"row": name, "gpuptr_ns": round(a, 1), "baseline": baseline, "baseline_ns": round(b, 1),
                     "speedup": round(b / a, 2)})
        print(f"{name:44s} gpuptr {a:8.0f} ns   {baseline:34s} {b:8.0f} ns   x{b / a:6.1f}", flush=True)

    def numba_wrap():
        return nd.MemoryPointer(cuda.current_context(), cu.CUdeviceptr(p), nbytes, owner=arr)

    row("wrap+context, first sight (driver query)", lambda: gpuptr.wrap(p, nbytes, owner=arr).context,
        numba_wrap, "numba MemoryPointer(current_context())")
    keep = gpuptr.wrap(p, nbytes, owner=arr)  # the range is now known
    row("wrap+context, known range (registry)", lambda: gpuptr.wrap(p, nbytes, owner=arr).context,
        numba_wrap, "numba MemoryPointer(current_context())")
    attr = cu.CUpointer_attribute.CU_POINTER_ATTRIBUTE_CONTEXT
    row("context of an address (cached)", lambda: gpuptr.context_of(p + 4096),
        lambda: cu.cuPointerGetAttribute(attr, p + 4096), "cuPointerGetAttribute (cuda.bindings)")
    row("as_cuda_array(cupy array)", lambda: as_cuda_array(arr), lambda: cuda.as_cuda_array(arr),
        "numba.cuda.as_cuda_array", iters=n // 4)
    del keep

    mp = cupy.get_default_memory_pool()
    stream = cu.CUstream(0)

    def cupy_pair():
        cupy.cuda.alloc(1 << 20)

    def async_pair():
        err, d = cu.cuMemAllocAsync(1 << 20, stream)
        cu.cuMemFreeAsync(d, stream)

    row("alloc+free 1 MiB (cuMemAlloc, no pool yet)", lambda: gpuptr.alloc(1 << 20).free(), cupy_pair,
        "cupy.cuda.alloc (CuPy pool)", iters=n // 10)
    row("alloc+free 1 MiB (cuMemAlloc, no pool yet)", lambda: gpuptr.alloc(1 << 20).free(), async_pair,
        "cuMemAllocAsync+FreeAsync (bindings)", iters=n // 10)
    mp.free_all_blocks()
    if args.json:
        import cupy as _c
        import numba_cuda

        meta = {"date": time.strftime("%Y-%m-%d"), "device": cuda.get_current_device().name.decode()
                if isinstance(cuda.get_current_device().name, bytes) else cuda.get_current_device().name,
                "numba_cuda": numba_cuda.__version__, "cupy": _c.__version__,
                "gpuptr": gpuptr.__version__}
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
