"""gpuptr in every Dask worker.

``GpuptrPlugin`` is a ``distributed`` WorkerPlugin that sets gpuptr up in
each worker process before its tasks allocate: numba (and CuPy, PyTorch and
RMM, so cuDF and the other RAPIDS libraries, where they are installed) on
gpuptr's pool, an optional cap on the pool and an optional reservation.
With dask-cuda, one worker per GPU::

    from dask_cuda import LocalCUDACluster
    from distributed import Client
    from gpuptr.dask import GpuptrPlugin, worker_stats

    cluster = LocalCUDACluster()            # one worker per visible GPU
    client = Client(cluster)
    client.register_plugin(GpuptrPlugin(pool_limit=40 << 30, reserve=2 << 30))
    ...                                     # numba / CuPy / torch / cuDF tasks
    worker_stats(client)                    # {worker address: gpuptr.stats()}

dask-cuda sets ``CUDA_VISIBLE_DEVICES`` per worker, so each worker's device
0 is its own GPU. Register the plugin before submitting work: a worker that
ran CUDA code already keeps the allocators it started with (``install``
then raises ``gpuptr.InstallError``, reported by ``register_plugin``).

RMM: gpuptr's resource wins. dask-cuda applies its ``rmm_*`` options
(``LocalCUDACluster(rmm_pool_size=...)``, ``rmm_async``, ...) in a plugin
the worker runs when it starts, before it registers with the scheduler; a
plugin registered with ``client.register_plugin`` runs after that, so
``GpuptrPlugin`` then makes gpuptr's pool RMM's resource on every device of
the worker, and RMM lets go of the pool dask-cuda made. Size gpuptr's pool
with ``pool_limit`` and ``reserve`` instead; ``GpuptrPlugin(rmm=False)``
leaves dask-cuda's RMM resource in place.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Union

try:
    from distributed import WorkerPlugin
except ImportError as _e:
    raise ImportError(f"gpuptr.dask needs distributed: pip install distributed (gpuptr's [dask] extra) ({_e})", name=_e.name) from _e

__all__ = ["GpuptrPlugin", "worker_reports", "worker_stats"]


class GpuptrPlugin(WorkerPlugin):  # type: ignore[misc]  # distributed ships no types
    """Set up gpuptr in each worker: ``gpuptr.install(numba, cupy, torch,
    rmm, stream_ordered=...)``, then the pool cap (``pool_limit`` per device, as
    RMM's maximum pool size) and a reservation of ``reserve`` in blocks of
    ``block_size`` (as RMM's initial pool size). Sizes are written as
    dask-cuda's ``rmm_pool_size`` is: an int of bytes, ``"40GB"``,
    ``"40GiB"``, or a share of the device (``0.8``, ``"80%"``); a bad one
    raises ``InvalidArgumentError`` naming it when the worker starts. What
    ``install`` reported is kept in the worker as ``worker.gpuptr_report``."""

    name = "gpuptr"

    def __init__(
        self,
        *,
        numba: bool = True,
        cupy: bool = True,
        torch: bool = True,
        rmm: bool = True,
        stream_ordered: bool = True,
        pool_limit: Union[int, float, str, None] = None,
        reserve: Union[int, float, str] = 0,
        block_size: Union[int, str] = 1 << 20,
    ) -> None:
        self.numba, self.cupy, self.torch, self.rmm = numba, cupy, torch, rmm
        self.stream_ordered = stream_ordered
        self.pool_limit = pool_limit
        self.reserve = reserve
        self.block_size = block_size

    def setup(self, worker: Any) -> None:
        import gpuptr

        if self.pool_limit is not None:
            gpuptr.set_pool_limit(self.pool_limit)
        report = gpuptr.install(
            numba=self.numba,
            cupy=self.cupy,
            torch=self.torch,
            # A plugin pickled by an older gpuptr has no rmm attribute.
            rmm=getattr(self, "rmm", True),
            stream_ordered=self.stream_ordered,
        )
        if self.reserve:
            gpuptr.reserve(self.reserve, block_size=self.block_size)
        worker.gpuptr_report = report


def _stats() -> List[Dict[str, Any]]:
    import gpuptr

    return [dict(s) for s in gpuptr.stats()]


def _report(dask_worker: Any) -> Dict[str, str]:
    return dict(getattr(dask_worker, "gpuptr_report", {}))


def worker_stats(client: Any) -> Dict[str, List[Dict[str, Any]]]:
    """``gpuptr.stats()`` of every worker, by worker address."""
    result: Dict[str, List[Dict[str, Any]]] = client.run(_stats)
    return result


def worker_reports(client: Any) -> Dict[str, Dict[str, str]]:
    """What ``gpuptr.install`` did in every worker, by worker address."""
    result: Dict[str, Dict[str, str]] = client.run(_report)
    return result
