"""core/heap.py against glibc itself: a planted allocation shows as in use, a fragmented heap keeps its pages
resident until a trim gives them back."""

from __future__ import annotations

import ctypes
import os

import pytest

from clover_export.core import heap

pytestmark = pytest.mark.skipif(heap.heap_bytes() is None, reason="not glibc")

libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
libc.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
CHUNK, COUNT = 4096, 20_000  # 80 MiB of small chunks (below the mmap threshold: they live in the arena)


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def test_in_use_follows_live_allocations_and_a_trim_gives_fragmented_pages_back():
    before = heap.heap_bytes()
    ptrs = [libc.malloc(CHUNK) for _ in range(COUNT)]
    for p in ptrs:
        libc.memset(p, 1, CHUNK)  # touched: resident
    held = heap.heap_bytes()
    assert held["in_use"] - before["in_use"] >= 0.95 * CHUNK * COUNT
    kept = ptrs[::64]  # one chunk in 64 stays live: the arena's top cannot shrink past them
    for i, p in enumerate(ptrs):
        if i % 64:
            libc.free(p)
    try:
        freed = heap.heap_bytes()
        assert held["in_use"] - freed["in_use"] >= 0.9 * CHUNK * COUNT
        assert freed["free"] - held["free"] >= 0.9 * CHUNK * COUNT  # kept by the allocator...
        resident = rss_mb()
        assert heap.trim()
        assert resident - rss_mb() >= 0.8 * CHUNK * COUNT / 2**20  # ...until the trim hands the pages back
    finally:
        for p in kept:
            libc.free(p)


class FakeClock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_trimmer_trims_every_period_of_work_and_once_when_the_work_stops(monkeypatch):
    calls = []
    monkeypatch.setattr(heap, "trim", lambda: calls.append(1) or True)
    clock = FakeClock()
    t = heap.Trimmer(every_s=30, clock=clock)
    t.idle()
    assert t.trims == 0  # nothing ran: nothing to give back
    for _ in range(29):
        clock.t += 1
        t.worked()
    assert t.trims == 0
    clock.t += 1
    t.worked()
    assert t.trims == 1 and not t.dirty  # 30 s of work
    t.idle()
    assert t.trims == 1  # no work since that trim
    clock.t += 1
    t.worked()
    t.idle()
    t.idle()
    assert t.trims == 2 and len(calls) == 2  # the work stopped: one trim, however long the idle


def test_trimming_is_off_at_a_period_of_zero_from_the_environment(monkeypatch):
    monkeypatch.setattr(heap, "trim", lambda: pytest.fail("trimmed while off"))
    monkeypatch.setenv(heap.Trimmer.ENV, "0")
    clock = FakeClock()
    t = heap.Trimmer(clock=clock)
    for _ in range(100):
        clock.t += 1
        t.worked()
    t.idle()
    assert t.trims == 0
    monkeypatch.setenv(heap.Trimmer.ENV, "5")
    assert heap.Trimmer().every_s == 5
