"""Real training and compute loops under the library's own allocator, RMM,
gpuptr (defaults) and gpuptr's other stream rule, each in a process of its
own, the allocators alternating round by round: one table of the median
step (min-max over rounds), the peak memory counted two ways (the
allocator's own count, and the drop in the device's free memory), each as
a ratio to the library's own allocator, and gpuptr's allocation, miss and
fence counts. The workloads and the numbers are described in
``gpuptr.bench.workloads`` and ``gpuptr/bench/children/workload.py``.

Usage (on a GPU machine with torch, transformers, timm or torchvision,
CuPy, numba-cuda, RMM and cuda-bindings; what is missing is skipped):

    python benches/workloads.py [--rounds N] [--only gpt2,resnet,cupy,numba]
        [--allocators own,rmm,gpuptr,strict] [--steps N] [--warmup N]
        [--timeout S] [--cpus LIST] [--lockstep] [--json FILE]

With ``--lockstep`` a workload's children under every allocator run at
once and take their steps in turn, another allocator first each round:
on a host whose speed drifts (a VM's CPUs shared with its neighbours) the
step ratios then compare steps taken side by side. The device memory
columns are left out there (the children share the device); the
allocators' own counts stand.

The default allocators are own, rmm, gpuptr (``gpuptr.install()``'s
defaults) and whichever of strict (``stream_ordered=False``) and ordered
(``stream_ordered=True``) is not gpuptr's default. Progress goes to
stderr; the exit status is 1 if nothing could be measured.
"""

from __future__ import annotations

import sys

from gpuptr.bench.workloads import main

if __name__ == "__main__":
    sys.exit(main())
