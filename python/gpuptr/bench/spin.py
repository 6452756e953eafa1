"""The busy GPU of the bench's busy-GPU rows and of ``benches/busy_*.py``:
a numba kernel that sleeps on the device for a given number of
milliseconds, launched on a non-blocking CuPy stream, so that host-side
allocations meet a device that is still working. Importing this module
imports numba-cuda; import it where the old code imported numba (after an
RMM pool or a logging set-up that must come first)."""

from __future__ import annotations

from typing import Any

import numpy as np
from numba import cuda

__all__ = ["Spinner"]


def _spin(a: Any, ms: int) -> None:
    # The kernel: sleep for ``ms`` ms, then set ``a[0]``.
    for _ in range(ms):
        cuda.nanosleep(1000000)
    a[0] = 1


class Spinner:
    """The spin kernel, its stream (a non-blocking CuPy stream, seen by
    numba as an external stream) and its flag; made after ``warm_pairs``
    numba ``device_array(1 MiB)`` pairs on an idle GPU, as the busy rows
    warm up."""

    def __init__(self, warm_pairs: int = 20) -> None:
        import cupy as cp

        self.kernel = cuda.jit(_spin)
        self.cupy_stream = cp.cuda.Stream(non_blocking=True)  # kept alive: its handle must stay valid
        self.stream = cuda.external_stream(self.cupy_stream.ptr)
        self.flag = cuda.device_array(1, np.int32)
        for _ in range(warm_pairs):  # warm up, on an idle GPU
            cuda.device_array(1 << 20, np.uint8)

    def launch(self, ms: int) -> None:
        """Start the kernel: it keeps the device busy for ``ms`` ms."""
        self.kernel[1, 1, self.stream](self.flag, ms)

    @property
    def busy(self) -> bool:
        """Whether the kernel still runs."""
        return not self.cupy_stream.done

    def synchronize(self) -> None:
        """Wait for the kernel."""
        self.stream.synchronize()
