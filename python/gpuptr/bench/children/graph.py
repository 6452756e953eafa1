"""CUDA graphs: ns per cycle (best of five runs of ``n`` cycles) of a CuPy
capture of three kernels with two temporaries and ten replays (``cupy``),
or a ``torch.compile(mode="reduce-overhead")`` step of a 2-layer MLP
(``torch``).

Arguments: ``cupy`` or ``torch``, the allocator (``gpuptr``: installed;
``own``: the library's), cycles per run."""

import sys
import time
from typing import Any, Callable

what, allocator, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
if allocator == "gpuptr":
    import gpuptr

    gpuptr.install(numba=False)
sync: Callable[[], object]
if what == "cupy":
    import cupy as cp

    x = cp.ones(1 << 18, dtype=cp.float32)
    s = cp.cuda.Stream(non_blocking=True)

    def cycle() -> Any:
        # Capture three kernels with two temporaries, replay ten times.
        with s:
            s.begin_capture()
            a = x * 2.0
            b = a + 1.0
            out = b * 3.0
            g = s.end_capture()
        for _ in range(10):
            g.launch(stream=s)
        s.synchronize()
        return out

    sync = s.synchronize
else:
    import torch

    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 256)).cuda()
    step = torch.compile(model, mode="reduce-overhead")
    x = torch.randn(64, 256, device="cuda")

    def cycle() -> Any:
        with torch.no_grad():
            return step(x)

    sync = torch.cuda.synchronize
for _ in range(20):
    cycle()
sync()
best = float("inf")
for _ in range(5):
    t = time.perf_counter_ns()
    for _ in range(n):
        cycle()
    sync()
    best = min(best, (time.perf_counter_ns() - t) / n)
print(best)
