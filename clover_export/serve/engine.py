"""One engine thread per process: it owns the Generator and steps it while there is work (SERVING.md 3).

HTTP handlers never touch the Generator: they hand a `Job` to the engine
and read its events from an asyncio queue. Submissions, cancellations and
steps all happen on the engine thread, between steps, so every request
joins the same continuous batch and no lock spans a generation. A request
the runtime refuses, or whose delivery fails, fails alone; the others go on.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable

from clover_export.errors import CloverError

log = logging.getLogger("clover_export.serve")


@dataclass
class Event:
    kind: str  # "accepted" (prompt_tokens), "block" (StreamChunk), "done" (Result), "error" (ApiError-ready exc)
    value: Any = None


class Job:
    """One HTTP request's link to its runtime request."""

    def __init__(self, kwargs: dict[str, Any], aloop: asyncio.AbstractEventLoop):
        self.kwargs = kwargs
        self.aloop = aloop
        self.events: asyncio.Queue[Event] = asyncio.Queue()
        self.handle = None  # the runtime Stream, set on the engine thread
        self.submitted = time.perf_counter()
        self.first_block: float | None = None

    def post(self, kind: str, value: Any = None) -> None:
        """Thread-safe: queue an event for the HTTP side."""
        try:
            self.aloop.call_soon_threadsafe(self.events.put_nowait, Event(kind, value))
        except RuntimeError:  # the event loop is gone (shutdown)
            pass


class Full(Exception):
    """The queue is full, or the engine is draining or not loaded."""


@dataclass
class Engine:
    """Owns the Generator on one thread; `submit`/`cancel` are safe from any thread."""

    load: Callable[[], Any]  # () -> Generator, called on the engine thread
    max_pending: int  # running rows + queued requests admitted at once
    metrics: Any = None
    gen: Any = None
    ready: bool = False  # loaded and one step ran
    draining: bool = False
    load_error: str | None = None
    _inbox: list[Job] = field(default_factory=list)
    _cancels: list[Job] = field(default_factory=list)
    _jobs: dict[int, Job] = field(default_factory=dict)
    _pending: int = 0
    _stop: bool = False
    _cond: threading.Condition = field(default_factory=threading.Condition)
    _thread: threading.Thread | None = None

    # --- any thread ---------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="clover-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout)

    def submit(self, job: Job) -> None:
        with self._cond:
            if not self.ready or self.draining or self._stop:
                raise Full("the engine is " + ("draining" if self.draining or self._stop else "loading"))
            if self._pending >= self.max_pending:
                raise Full(f"the queue is full ({self._pending} requests)")
            self._pending += 1
            self._inbox.append(job)
            self._cond.notify()

    def cancel(self, job: Job) -> None:
        """Leave the batch at the next step (client gone, timeout); no effect once finished."""
        with self._cond:
            self._cancels.append(job)
            self._cond.notify()

    def wait_ready(self, timeout: float) -> bool:
        end = time.monotonic() + timeout
        while not self.ready and self.load_error is None and time.monotonic() < end:
            time.sleep(0.05)
        return self.ready

    # --- engine thread ------------------------------------------------------------
    def _run(self) -> None:
        try:
            self.gen = self.load()
            self._warm_up()
        except Exception as e:  # reported by /health; the process stays up to say why
            self.load_error = str(e) if isinstance(e, CloverError) else f"{type(e).__name__}: {e}"
            log.error("engine failed to load: %s", self.load_error)
            return
        self.ready = True
        while True:
            with self._cond:
                while not (self._inbox or self._cancels or self._stop or self.gen.loop.has_work()):
                    self._cond.wait()
                inbox, self._inbox = self._inbox, []
                cancels, self._cancels = self._cancels, []
                stop = self._stop
            for job in inbox:
                self._admit(job)
            for job in cancels:
                self._drop(job, None)
            if stop:
                for job in list(self._jobs.values()):
                    self._drop(job, CloverError("serve", "the server is shutting down"))
                return
            if self.gen.loop.has_work():
                self._step()

    def _warm_up(self) -> None:
        """One step of a one-token request, so /health reports a working engine."""
        h = self.gen.submit("hi", raw=True, max_new_tokens=1)
        self.gen.step()
        h.cancel()

    def _admit(self, job: Job) -> None:
        try:
            job.handle = self.gen.submit(**job.kwargs)
        except CloverError as e:  # refused before any compute: this request only
            self._release(job, "error", e)
            return
        self._jobs[job.handle.request_id] = job
        job.post("accepted", job.handle.request.prompt_len)

    def _step(self) -> None:
        t0 = time.perf_counter()
        try:
            self.gen.step()
        except Exception as e:  # the runtime could not tell whose fault it was: the step's rows fail
            log.error("engine step failed:\n%s", traceback.format_exc())
            for job in [j for j in self._jobs.values() if j.handle.request.slot is not None]:
                self._drop(job, RuntimeError(f"the engine step failed: {type(e).__name__}: {e}"))
            return
        if self.metrics is not None:
            sched = self.gen.loop.scheduler
            self.metrics.step(time.perf_counter() - t0, len(sched.running), len(sched.waiting))
        for job in list(self._jobs.values()):
            try:
                self.deliver(job)
            except Exception as e:  # a fault while delivering one request fails that request alone
                log.error("request %s failed:\n%s", job.handle.request_id, traceback.format_exc())
                self._drop(job, RuntimeError(f"{type(e).__name__}: {e}"))

    def deliver(self, job: Job) -> None:
        """Hand the request's new blocks (and its result once finished) to its HTTP side."""
        h = job.handle
        while h.chunks:
            chunk = h.chunks.popleft()
            if job.first_block is None:
                job.first_block = time.perf_counter()
            job.post("block", chunk)
        if h.done and h.result.finish_reason == "error":  # a runtime that isolates a failing row reports it so
            self._release(job, "error", RuntimeError(getattr(h.result, "error", None) or "the request failed"))
        elif h.done:
            self._release(job, "done", h.result)

    def _drop(self, job: Job, error: Exception | None) -> None:
        """Cancel (error None) or fail one request; its slot is free for the next step."""
        if job.handle is None:  # not admitted: still queued (cancelled early), or already refused
            with self._cond:
                queued = job in self._inbox
                if queued:
                    self._inbox.remove(job)
            if queued:
                self._release(job, "error", error or CloverError("serve", "cancelled before it started"))
            return
        if job.handle.request_id not in self._jobs:
            return
        job.handle.cancel()
        self._release(job, "error" if error else "done", error or job.handle.result)

    def _release(self, job: Job, kind: str, value: Any) -> None:
        if job.handle is not None:
            self._jobs.pop(job.handle.request_id, None)
        with self._cond:
            self._pending -= 1
        job.post(kind, value)

    # --- figures for /metrics -----------------------------------------------------
    def load_figures(self) -> tuple[int, int]:
        """(running rows, waiting requests), read without stopping the engine."""
        if self.gen is None:
            return 0, 0
        sched = self.gen.loop.scheduler
        return len(sched.running), len(sched.waiting) + len(self._inbox)
