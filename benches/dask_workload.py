"""A Dask-CUDA workload on every visible GPU, timed under a memory manager.

    python benches/dask_workload.py --manager gpuptr|default|rmm [--chunks 64]

One worker per GPU (dask-cuda's ``LocalCUDACluster``). Each task makes a
16 MiB device chunk with numba, scales it with a kernel, and half of the
chunks then move to the other worker, which sums them there. Prints one
JSON line: the manager, the wall time of the task graph (best of
``--rounds``, after a warm-up, and every round's) and every worker's
gpuptr stats where gpuptr is installed.
"""

from __future__ import annotations

import argparse
import json
import os
import time


def _held(dask_worker) -> int:
    return len(dask_worker.data)


def _collect() -> None:
    import gc

    gc.collect()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--manager", choices=["gpuptr", "default", "rmm"], required=True)
    ap.add_argument("--chunks", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()

    from dask_cuda import LocalCUDACluster
    from distributed import Client, wait

    kwargs = {}
    if args.manager == "rmm":
        # dask-cuda sets up RMM's pool in each worker; its external-library
        # list takes only CuPy and torch (26.10), so numba gets RMM's EMM
        # plugin through the environment the worker processes inherit.
        os.environ["NUMBA_CUDA_MEMORY_MANAGER"] = "rmm.allocators.numba"
        kwargs = {"rmm_pool_size": "8GB"}
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
        times = []
        for _ in range(args.rounds):
            t = time.perf_counter()
            got = graph()
            times.append(time.perf_counter() - t)
            best = min(best, times[-1])
            assert got == expected
        # Futures are released asynchronously: wait until the workers hold no
        # task data, then collect cycles, so the stats show what leaked.
        deadline = time.monotonic() + 60
        while any(client.run(_held).values()) and time.monotonic() < deadline:
            time.sleep(0.05)
        client.run(_collect)
        stats = None
        if args.manager == "gpuptr":
            from gpuptr.dask import worker_stats

            stats = worker_stats(client)
        print(json.dumps({"manager": args.manager, "workers": len(workers), "chunks": args.chunks, "best_s": best, "times_s": times, "stats": stats}))


if __name__ == "__main__":
    main()
