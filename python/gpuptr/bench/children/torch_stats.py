"""``torch.cuda.memory_allocated()`` itself, with eight 1 MiB tensors
live: the best ns per call under one PyTorch allocator.

Arguments: the allocator (``own``: PyTorch's caching allocator;
``gpuptr``: ``gpuptr.torch.install()``), calls per run, runs."""

import sys
from gpuptr.bench._timing import best_ns

allocator, n, repeat = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
import torch

if allocator == "gpuptr":
    import gpuptr.torch

    gpuptr.torch.install()
keep = [torch.empty(1 << 20, dtype=torch.uint8, device="cuda") for _ in range(8)]
print(best_ns(torch.cuda.memory_allocated, n, repeat))
