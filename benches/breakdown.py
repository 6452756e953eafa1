import time, cupy, gpuptr
from gpuptr.interop import from_cuda_array_interface
from gpuptr.numba import as_cuda_array
from numba import cuda
def best(f,n=20000):
    for _ in range(500): f()
    b=1e9
    for _ in range(5):
        t=time.perf_counter()
        for _ in range(n): f()
        b=min(b,(time.perf_counter()-t)/n)
    return b*1e9
a = cupy.zeros(1<<20, dtype=cupy.float32)
d = a.__cuda_array_interface__
print("cupy CAI dict:", {k: v for k, v in d.items() if k != "data"})
print("cupy __cuda_array_interface__  %.0f ns" % best(lambda: a.__cuda_array_interface__))
print("from_cai(desc)                 %.0f ns" % best(lambda: from_cuda_array_interface(d, owner=a)))
print("from_cai(desc, sync=False)     %.0f ns" % best(lambda: from_cuda_array_interface(d, owner=a, sync=False)))
print("ctx.stream_synchronize(1)      %.0f ns" % best(lambda: gpuptr.context(0).stream_synchronize(1)))
print("gpuptr as_cuda_array           %.0f ns" % best(lambda: as_cuda_array(a)))
print("gpuptr as_cuda_array sync=False %.0f ns" % best(lambda: as_cuda_array(a, sync=False)))
print("numba as_cuda_array sync=False  %.0f ns" % best(lambda: cuda.as_cuda_array(a, sync=False)))
