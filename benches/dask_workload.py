"""A Dask-CUDA workload on every visible GPU, timed under a memory manager.

    python benches/dask_workload.py --manager gpuptr|default|rmm [--chunks 64]

One worker per GPU (dask-cuda's ``LocalCUDACluster``). Each task makes a
16 MiB device chunk with numba, scales it with a kernel, and half of the
chunks then move to the other worker, which sums them there. Prints one
JSON line: the manager, the wall time of the task graph (best of 3, after
a warm-up) and every worker's gpuptr stats where gpuptr is installed.
"""

from __future__ import annotations

import argparse
import json
import time


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--manager", choices=["gpuptr", "default", "rmm"], required=True)
    ap.add_argument("--chunks", type=int, default=64)
    args = ap.parse_args()

    from dask_cuda import LocalCUDACluster
    from distributed import Client, wait

    kwargs = {}
    if args.manager == "rmm":
        kwargs = {"rmm_pool_size": "8GB", "rmm_allocator_external_lib_list": ["numba"]}
    with LocalCUDACluster(**kwargs) as cluster, Client(cluster) as client:
        if args.manager == "gpuptr":
            from gpuptr.dask import GpuptrPlugin

            client.register_plugin(GpuptrPlugin(cupy=False, torch=False))
        workers = sorted(client.scheduler_info()["workers"])

        def make(i):
            import numpy as np
            from numba import cuda

            @cuda.jit
            def scale(a, k):
                j = cuda.grid(1)
                if j < a.size:
                    a[j] = a[j] * k

            a = cuda.device_array(1 << 22, dtype=np.float32)
            a[:] = float(i % 7)
            scale[(a.size + 255) // 256, 256](a, 2.0)
            cuda.synchronize()
            return a

        def total(a):
            return float(a.copy_to_host().sum())

        def graph():
            made = [client.submit(make, i, workers=[workers[i % len(workers)]], pure=False) for i in range(args.chunks)]
            sums = [
                client.submit(total, m, workers=[workers[(i + (i % 2)) % len(workers)]], pure=False)
                for i, m in enumerate(made)
            ]
            wait(sums)
            out = client.gather(sums)
            del made, sums
            return out

        expected = [float((i % 7) * 2.0 * (1 << 22)) for i in range(args.chunks)]
        assert graph() == expected
        best = float("inf")
        for _ in range(3):
            t = time.perf_counter()
            got = graph()
            best = min(best, time.perf_counter() - t)
            assert got == expected
        stats = None
        if args.manager == "gpuptr":
            from gpuptr.dask import worker_stats

            stats = worker_stats(client)
        print(json.dumps({"manager": args.manager, "workers": len(workers), "chunks": args.chunks, "best_s": best, "stats": stats}))


if __name__ == "__main__":
    main()
