"""The Dask worker plugin on a CPU cluster (worker processes on the
simulator): it puts each worker on gpuptr before any task runs."""

from __future__ import annotations

import pytest

distributed = pytest.importorskip("distributed")


@pytest.fixture(scope="module")
def client():
    from distributed import Client, LocalCluster

    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0") as cluster:
        with Client(cluster) as c:
            yield c


def test_the_plugin_sets_up_gpuptr_in_every_worker(client):
    from gpuptr.dask import GpuptrPlugin, worker_reports, worker_stats

    client.register_plugin(GpuptrPlugin(pool_limit=64 << 20, reserve=4 << 20, cupy=False, torch=False))
    reports = worker_reports(client)
    assert len(reports) == 2
    for r in reports.values():
        rmm = r.pop("rmm")
        assert rmm == "installed" or "pip install rmm-cu13" in rmm, "RMM too, where it imports"
        assert r == {"numba": "installed", "cupy": "not requested", "torch": "not requested"}

    def manager():
        import os

        from numba.cuda.cudadrv import driver

        return driver._memory_manager.__module__, os.getpid()

    seen = client.run(manager)
    assert {m for m, _ in seen.values()} == {"gpuptr.numba"}
    assert len({pid for _, pid in seen.values()}) == 2, "each worker is its own process"

    stats = worker_stats(client)
    for per_device in stats.values():
        assert per_device[0]["pool_limit"] == 64 << 20
        assert per_device[0]["pool_bytes"] >= 4 << 20, "the reservation"


def test_tasks_allocate_from_the_pool_and_give_it_back(client):
    from gpuptr.dask import worker_stats

    def work(n):
        import gpuptr

        mem = gpuptr.alloc(1 << 20)
        mem.memset(n % 256)
        out = mem.copy_to_host()[0]
        return out, gpuptr.stats()[0]["live_bytes"]

    results = client.gather(client.map(work, range(20)))
    assert [r[0] for r in results] == [n % 256 for n in range(20)]
    assert all(r[1] >= 1 << 20 for r in results)
    for per_device in worker_stats(client).values():
        assert per_device[0]["live_bytes"] == 0


def test_the_plugin_makes_gpuptr_rmms_resource_in_every_worker(client):
    # A stand-in for RMM (tests/fake_rmm.py, made in each worker from its
    # source: the workers need not import the tests), holding the resource
    # a dask-cuda plugin would have set when the worker started: gpuptr's
    # plugin, registered after, replaces it.
    from pathlib import Path

    from gpuptr.dask import GpuptrPlugin, worker_reports

    source = (Path(__file__).parent / "fake_rmm.py").read_text()

    def fake_rmm_with_dask_cudas_pool(src):
        import sys
        import types

        mod = types.ModuleType("fake_rmm")
        exec(compile(src, "fake_rmm.py", "exec"), mod.__dict__)
        rmm, mr = mod.make()
        sys.modules["rmm"], sys.modules["rmm.mr"] = rmm, mr
        mr.set_current_device_resource(mr.CudaMemoryResource())  # as dask-cuda's RMMSetup

    client.run(fake_rmm_with_dask_cudas_pool, source)
    try:
        client.register_plugin(GpuptrPlugin(cupy=False, torch=False))
        assert all(r["rmm"] == "installed" for r in worker_reports(client).values())

        def through_rmm():
            import gpuptr
            import gpuptr.rmm
            import rmm

            buf = rmm.DeviceBuffer(size=1 << 20)
            live = gpuptr.stats()[0]["clients"]["rmm"]["live_bytes"]
            owner = gpuptr.context_of(buf.ptr).device.id
            del buf
            return gpuptr.rmm.installed(), live, owner, gpuptr.stats()[0]["clients"]["rmm"]["live_bytes"]

        assert set(client.run(through_rmm).values()) == {(True, 1 << 20, 0, 0)}
        client.register_plugin(GpuptrPlugin(cupy=False, torch=False, rmm=False))
        assert all(r["rmm"] == "not requested" for r in worker_reports(client).values())
    finally:

        def forget_rmm():
            import sys

            for name in ("rmm", "rmm.mr"):
                sys.modules.pop(name, None)

        client.run(forget_rmm)
