"""The C heap of this process, as glibc's allocator sees it: bytes in use and bytes free but kept.

A server's resident memory can grow because something keeps allocating (a leak), or because the allocator
keeps freed memory it cannot give back (fragmentation: a free chunk sits below one in use). glibc's
`mallinfo2` tells the two apart: `in_use` is what live allocations hold, `free` what malloc keeps for reuse
(mmapped chunks, which glibc returns at once, count under in_use). `malloc_trim(0)` hands the free pages of
every arena back to the system. Both are glibc's; elsewhere (musl, macOS) `heap_bytes` is None and `trim`
does nothing. Written by hand over ctypes: no maintained package exposes these two calls.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import time


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


@functools.cache
def _libc():
    """glibc with mallinfo2 (2.33+) and malloc_trim, or None."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallinfo2.restype = _Mallinfo2
        libc.malloc_trim.argtypes, libc.malloc_trim.restype = [ctypes.c_size_t], ctypes.c_int
        return libc
    except (OSError, AttributeError):
        return None


def heap_bytes() -> dict[str, int] | None:
    """{"in_use": bytes held by live allocations (mmapped ones too), "free": bytes malloc keeps for reuse},
    summed over the arenas; None without glibc."""
    libc = _libc()
    if libc is None:
        return None
    m = libc.mallinfo2()
    return {"in_use": m.uordblks + m.hblkhd, "free": m.fordblks}


def trim() -> bool:
    """Give the free pages of every arena back to the system (glibc malloc_trim(0)); True if any went."""
    libc = _libc()
    return bool(libc.malloc_trim(0)) if libc is not None else False


class Trimmer:
    """A long-running loop's heap keeper: `worked()` after each unit of work trims at most every `every_s`
    seconds (default: $CLOVER_HEAP_TRIM_S, else 30; 0 or less: never); `idle()` when the work stops trims
    once if any work ran since the last trim. What a trim costs
    (a walk of the arenas' free lists, about a millisecond for a few hundred MB) is paid off the hot path."""

    ENV = "CLOVER_HEAP_TRIM_S"  # the period in seconds; 0 turns trimming off

    def __init__(self, every_s: float | None = None, clock=time.monotonic):
        if every_s is None:
            every_s = float(os.environ.get(self.ENV, "30"))
        self.every_s, self.clock = every_s, clock
        self.last, self.dirty, self.trims = clock(), False, 0

    def worked(self) -> None:
        if self.every_s <= 0:
            return
        self.dirty = True
        if self.clock() - self.last >= self.every_s:
            self._trim()

    def idle(self) -> None:
        if self.dirty:
            self._trim()

    def _trim(self) -> None:
        trim()
        self.last, self.dirty = self.clock(), False
        self.trims += 1
