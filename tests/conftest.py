"""Pick the driver for the whole test session before gpuptr opens one.

With ``GPUPTR_DRIVER`` unset, the CUDA driver is used where it works and
the simulator (with two devices) elsewhere. Tests marked ``gpu`` need the
CUDA driver; tests marked ``sim`` need the simulator; the rest run on both.
On the device, run both sessions:
``pytest -m gpu`` and ``GPUPTR_DRIVER=sim pytest -m "not gpu"``.
"""

from __future__ import annotations

import gc
import os

import pytest

# The soak's asserts are in helpers.py: rewritten as a test module's are,
# a failure shows their values.
pytest.register_assert_rewrite("helpers")

if not os.environ.get("GPUPTR_DRIVER", "").strip():
    from gpuptr import probe_cuda

    if not probe_cuda()[0]:
        os.environ["GPUPTR_DRIVER"] = "sim"
if os.environ.get("GPUPTR_DRIVER", "").strip().lower() == "sim":
    os.environ.setdefault("GPUPTR_SIM_DEVICES", "2")
    # Small devices, so capacity OOM is cheap to reach.
    os.environ.setdefault("GPUPTR_SIM_MEMORY", str(256 << 20))

import gpuptr  # noqa: E402

DRIVER = gpuptr.driver_info()["driver"]


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason=f"needs the CUDA driver (running on {DRIVER})")
    skip_sim = pytest.mark.skip(reason="needs GPUPTR_DRIVER=sim")
    for item in items:
        if "gpu" in item.keywords and DRIVER != "cuda":
            item.add_marker(skip_gpu)
        if "sim" in item.keywords and DRIVER != "sim":
            item.add_marker(skip_sim)
        if "multigpu" in item.keywords and gpuptr.driver_info()["device_count"] < 2:
            item.add_marker(pytest.mark.skip(reason="needs two devices"))


@pytest.fixture
def no_leaks():
    """Asserts that a test leaves gpuptr's live allocations as it found them."""
    gc.collect()
    before = [s["live_bytes"] for s in gpuptr.stats()]
    yield
    gc.collect()
    after = [s["live_bytes"] for s in gpuptr.stats()]
    assert after == before, f"live bytes {before} -> {after}"


@pytest.fixture(autouse=True)
def device_0_current():
    """Each test starts with device 0 current, whatever an earlier test
    (numba's ``cuda.gpus[1]``, CuPy's ``Device(1)``) left behind."""
    gpuptr.context(0).push()
    yield
