"""Where the time of a cuda.core ``mr.allocate(1 MiB)`` + ``close()`` goes,
under gpuptr.cuda_core and under cuda.core's DeviceMemoryResource, in one
process, each part timed apart (best of several runs, ns per call):

- the whole cycle, for each resource;
- gpuptr's part: the pool allocation and free alone (``_alloc_for``);
- cuda.core's part: a Buffer that owns a plain object, made the way
  gpuptr's are, and closed (nothing allocated);
- the path gpuptr left: a Python resource whose buffers free through
  ``mr.deallocate`` (cuda.core's callback), which allocates nothing;
- the driver's part of DeviceMemoryResource: cuMemAllocFromPoolAsync and
  cuMemFreeAsync through cuda.bindings.

Usage: python benches/cuda_core_why.py [calls]   (on the GPU)
"""

import sys


def main():
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 20000
    from cuda.bindings import driver as cu
    from cuda.core import Buffer, Device, DeviceMemoryResource

    import gpuptr
    from gpuptr import _core, cuda_core
    from gpuptr.bench import best_ns
    from gpuptr.bench.cuda_core import callback_floor, owning_floor

    dev = Device(0)
    dev.set_current()
    stream = dev.create_stream()
    ours, dmr = cuda_core.MemoryResource(0), DeviceMemoryResource(0)
    size = 1 << 20
    fixed, owner = gpuptr.alloc(size), object()
    address = fixed.device_pointer_value
    owning, nothing = owning_floor(), callback_floor()
    pool = dmr.handle if hasattr(dmr, "handle") else None
    h = int(stream.handle)

    def driver():
        err, p = cu.cuMemAllocFromPoolAsync(size, pool, h)
        cu.cuMemFreeAsync(p, h)

    rows = {
        "gpuptr.cuda_core allocate+close": lambda: ours.allocate(size, stream=stream).close(),
        "DeviceMemoryResource allocate+close": lambda: dmr.allocate(size, stream=stream).close(),
        "gpuptr's part: pool alloc+free (_alloc_for)": lambda: _core._alloc_for("cuda_core", size, 0).free(),
        "cuda.core's part: owning Buffer made+closed": lambda: owning.allocate(size).close(),
        "  the same through public Buffer.from_handle(owner=)": lambda: Buffer.from_handle(address, size, owner=owner).close(),
        "a Python resource freeing through deallocate": lambda: nothing.allocate(size, stream=stream).close(),
    }
    if pool is not None:
        rows["driver: cuMemAllocFromPoolAsync+cuMemFreeAsync (cuda.bindings)"] = driver
    for name, f in rows.items():
        try:
            print(f"{best_ns(f, n, 7):9.0f} ns  {name}", flush=True)
        except Exception as e:  # noqa: BLE001
            print(f"{'-':>9}     {name}: {type(e).__name__}: {e}", flush=True)
    stream.sync()


if __name__ == "__main__":
    main()
