"""A view into the pool: ``memory_summary()`` and ``_core.pool_classes``
agree with ``stats()``."""

from __future__ import annotations

import gc

import pytest

import gpuptr
from gpuptr import _core


def _by_class(device: int = 0) -> dict[int, dict[str, int]]:
    return {c["class"]: dict(c) for c in _core.pool_classes(device)}


def test_pool_classes_count_live_peak_and_cached_blocks(no_leaks):
    gc.collect()
    gpuptr.flush_pool()
    gpuptr.reset_peak_stats()
    before = _by_class()
    held = [gpuptr.alloc(3 << 20) for _ in range(3)]  # class 3 MiB
    small = gpuptr.alloc(700)  # class 768 B
    after = _by_class()

    def live(c: dict[int, dict[str, int]], k: int) -> int:
        return c.get(k, {}).get("live_blocks", 0)

    assert live(after, 3 << 20) - live(before, 3 << 20) == 3
    assert live(after, 768) - live(before, 768) == 1
    del held[0]
    now = _by_class()
    assert live(now, 3 << 20) == live(after, 3 << 20) - 1
    assert now[3 << 20]["peak_blocks"] >= live(after, 3 << 20)
    assert now[3 << 20]["cached_blocks"] >= 1, "the freed block is cached (waiting for a fence)"
    # Cached blocks are counted by the size class of their own sizes (a
    # free block can be any size its segment left).
    s = gpuptr.stats()[0]
    assert s["cached_bytes"] >= 3 << 20
    assert sum(c["cached_blocks"] for c in now.values()) >= 1
    assert s["live_bytes"] <= sum(k * c["live_blocks"] for k, c in now.items())
    del held, small


def test_memory_summary_matches_stats(no_leaks):
    keep = gpuptr.alloc(5 << 20)
    # A quiet pool: a fence finishing between the two reads would move
    # blocks from pending to ready (and count it) in the second.
    gpuptr.flush_pool()
    text = gpuptr.memory_summary(0)
    s = gpuptr.stats()[0]
    assert text.startswith("device 0")
    assert f"in {s['live_count']} allocations" in text
    assert f"pool hits {s['pool_hits']}, misses {s['pool_misses']}, fences {s['fences']}" in text
    assert "5.0 MiB" in text, "its size class has a row"
    assert gpuptr.memory_summary().startswith("device 0"), "all devices by default"
    del keep


def test_memory_summary_claims_no_bytes_the_pool_does_not_hold(no_leaks):
    # A 3 MiB block cut from a free 20 MiB segment leaves a 17 MiB free
    # block in the 20 MiB class: the table showed it as 20 MiB cached (and
    # the live block as its 3.5 MiB class), 23.5 MiB in a 20 MiB pool.
    a = gpuptr.alloc(4 << 20)
    a.free()
    gpuptr.flush_pool()
    b = gpuptr.alloc((3 << 20) + 512)
    gpuptr.flush_pool()
    s = gpuptr.stats()[0]
    text = gpuptr.memory_summary(0)
    assert s["live_bytes"] + s["cached_bytes"] == s["pool_bytes"]
    table = text.split("block size", 1)[1].splitlines()[1:]
    assert table and all(len(row.split()) == 5 for row in table), table  # size, unit, three counts
    assert "cached bytes" not in text and "live bytes" not in text
    del b


def test_memory_summary_of_a_device_that_does_not_exist_is_an_invalid_argument():
    with pytest.raises(gpuptr.InvalidArgumentError):
        gpuptr.memory_summary(99)


def test_set_pool_limit_caps_the_pool_and_shows_in_stats():
    import gpuptr as g

    dev = 1 if len(g.devices()) > 1 else 0
    g.trim()
    base = g.stats()[dev]["pool_bytes"]
    g.set_pool_limit(base + (4 << 20), device=dev)
    try:
        assert g.stats()[dev]["pool_limit"] == base + (4 << 20)
        held = []
        with pytest.raises(g.OutOfMemoryError):
            for _ in range(64):
                held.append(g.alloc(1 << 20, device=dev))
        assert len(held) <= 4 and g.stats()[dev]["pool_bytes"] <= base + (4 << 20)
        with pytest.raises(g.InvalidArgumentError):
            g.set_pool_limit(-1)
        with pytest.raises(g.InvalidArgumentError):
            g.set_pool_limit(1 << 20, device=99)
    finally:
        g.set_pool_limit(None)
    assert g.stats()[dev]["pool_limit"] is None
    assert g.alloc(1 << 20, device=dev).size == 1 << 20


def test_a_reservation_in_a_fresh_process_stays_until_trim():
    import os
    import subprocess
    import sys

    code = (
        "import gpuptr\n"
        "got = gpuptr.reserve(4 << 20, block_size=1 << 20)\n"
        "s = gpuptr.stats()[0]\n"
        "print(got, s['pool_bytes'], s['cached_bytes'])\n"
        "gpuptr.trim()\n"
        "print(gpuptr.stats()[0]['pool_bytes'])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=dict(os.environ))
    assert out.returncode == 0, out.stderr
    first, second = out.stdout.splitlines()
    assert first.split() == [str(4 << 20)] * 3, "kept: nothing else held the context"
    assert second == "0"
