"""CPU threads of the backends: deliberate, and never left changed for a library caller.

Policy, in this order:
1. an explicit `threads` (`--threads`, `Generator.load(..., threads=N)`) wins;
2. else `OMP_NUM_THREADS`, when set, is respected: torch sized its pool from
   it at start-up and is left alone; ONNX Runtime gets it as intra-op threads;
3. else the threads are sized from the work: one per `MIN_FLOPS_PER_THREAD`
   of the step, at most the cores this process may use. The embedded default
   (hidden 128) and small steps run single-threaded: their ~200 small ops per
   step gain nothing from a team and, on a busy machine, each one waits for
   descheduled workers (`python bench/cpu_contention.py` compares a thread per core with this policy
   beside 0, 2 and 4 busy processes).

torch's thread count is process-global, so the torch backend sets it for the
duration of each step and puts the caller's value back after (cost: two
`torch.set_num_threads` calls per step, ~microseconds; nothing when the
count already matches). ONNX Runtime threads belong to the session: set once
at load, with spinning off (spinning workers starve other processes and the
selection that follows on the same cores).
"""

from __future__ import annotations

import math
import os
from contextlib import contextmanager
from typing import Iterator

import torch

from clover_export.core import names
from clover_export.core.config import CloverConfig
from clover_export.core.errors import CloverError

ENV = "OMP_NUM_THREADS"
MIN_FLOPS_PER_THREAD = 5e8  # below ~10 ms of single-core work per step a second thread does not pay


def check_threads(threads: int | None) -> int | None:
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
        raise CloverError("runtime", f"threads must be a positive integer, got {threads!r}")
    return threads


def usable_cores() -> int:
    """Cores this process may run on (its affinity mask where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        return os.cpu_count() or 1


def env_threads() -> int | None:
    """OMP_NUM_THREADS when set to a positive integer, else None."""
    raw = os.environ.get(ENV, "").strip()
    return int(raw) if raw.isdigit() and int(raw) > 0 else None


def flops_per_row(cfg: CloverConfig) -> float:
    """Multiply-adds x 2 of one row through the weights it uses (routed experts at top-k of E; no embedding)."""
    total = 0.0
    for name, shape in names.expected_tensors(cfg).items():
        n = math.prod(shape)
        if name == names.EMBED:
            continue
        if ".mlp.experts." in name:
            n *= cfg.num_experts_per_tok / cfg.num_experts
        total += n
    return 2.0 * total


def threads_for_work(flops: float) -> int:
    return max(1, min(usable_cores(), int(flops // MIN_FLOPS_PER_THREAD)))


def torch_threads(explicit: int | None, flops: float) -> int | None:
    """The torch intra-op threads for a step of `flops`, or None to leave torch's setting as it is."""
    if explicit is not None:
        return explicit
    if env_threads() is not None:
        return None
    return threads_for_work(flops)


def ort_threads(explicit: int | None, flops: float) -> int:
    """ONNX Runtime intra-op threads for a session whose typical step does `flops`."""
    if explicit is not None:
        return explicit
    return env_threads() or threads_for_work(flops)


@contextmanager
def torch_thread_scope(n: int | None) -> Iterator[None]:
    """torch runs `n` intra-op threads inside; the caller's count is restored on exit (None: untouched)."""
    prev = torch.get_num_threads()
    if n is None or n == prev:
        yield
        return
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(prev)
