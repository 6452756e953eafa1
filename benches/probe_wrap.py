"""Quick timing probe of the wrap paths (not the full harness)."""
import time, gc
import cupy, gpuptr
from numba import cuda
from numba.cuda.cudadrv import driver as nd
from cuda.bindings import driver as cu

def best(f, n=20000, r=5):
    b = 1e9
    for _ in range(r):
        t = time.perf_counter()
        for _ in range(n):
            f()
        b = min(b, (time.perf_counter() - t) / n)
    return b * 1e9

arr = cupy.zeros(1 << 20, dtype=cupy.uint8)
p, n = arr.data.ptr, arr.nbytes
ctx = cuda.current_context()
print("numba MemoryPointer(current_context())  %.0f ns" % best(lambda: nd.MemoryPointer(cuda.current_context(), cu.CUdeviceptr(p), n, owner=arr)))
print("gpuptr.wrap miss (+.context)          %.0f ns" % best(lambda: gpuptr.wrap(p, n, owner=arr).context))
keep = gpuptr.wrap(p, n, owner=arr)
print("gpuptr.wrap hit (+.context)           %.0f ns" % best(lambda: gpuptr.wrap(p, n, owner=arr).context))
print("gpuptr.wrap hit                       %.0f ns" % best(lambda: gpuptr.wrap(p, n, owner=arr)))
print("gpuptr.context_of hit                 %.0f ns" % best(lambda: gpuptr.context_of(p)))
CU = cu.CUpointer_attribute.CU_POINTER_ATTRIBUTE_CONTEXT
print("cuPointerGetAttribute (cuda.bindings) %.0f ns" % best(lambda: cu.cuPointerGetAttribute(CU, p)))
print("gpuptr.alloc(1MiB)+free (cuMemAlloc)  %.0f ns" % best(lambda: gpuptr.alloc(1 << 20).free(), n=2000))
