"""One batch-loop thread per process: it owns the Generator and steps it while there is work (SERVING.md 3, 5).
`clover-export serve` runs it in a process of its own, behind engine_process.py's ProcessEngine.

HTTP handlers never touch the Generator: they hand a `Job` to the engine
and read its events from an asyncio queue. Submissions, cancellations and
steps all happen on the batch-loop thread, between steps, so every request
joins the same continuous batch, a cancelled request leaves it at the next
step, and no lock spans a generation. The events of one pass (the admissions,
or a step's blocks and results for every stream) reach each event loop in one
wakeup: a wakeup per stream and block would take the GIL from the next step
each time.

The engine never dies of a request. Anything a request raises while it is
admitted, stepped or delivered fails that request alone (logged once, one
line; the traceback at debug level); a step that fails without naming its
rows (the runtime isolates the rows it can, loop.py) fails the rows holding
a slot. Only a fault no request can be blamed for stops the batch-loop thread:
it then ends every request with a 503, `died` says why, `/health` turns 503
and `stopped` is set, so the server process exits non-zero (cli/serve.py).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from clover_export.core import heap
from clover_export.core.errors import CloverError

log = logging.getLogger("clover_export.serve")
_job_names = itertools.count(1)
MESSAGE_CHARS = 300  # an exception's text in a log line or an error body (a prompt may be megabytes)
ENGINES = ("process", "thread")  # where a server's engine runs: its own process (engine_process.py), or this thread


@dataclass
class Event:
    kind: str  # "accepted" (prompt_tokens), "block" (StreamChunk), "done" (Result), "error" (an exception),
    #            "gone" (the client left; posted by the HTTP side)
    value: Any = None


class Job:
    """One HTTP request's link to its runtime request."""

    def __init__(self, kwargs: dict[str, Any], aloop: asyncio.AbstractEventLoop, name: str | None = None):
        self.kwargs = kwargs
        self.aloop = aloop
        self.name = name or f"job-{next(_job_names)}"  # the request id in log lines
        self.events: asyncio.Queue[Event] = asyncio.Queue()
        self.handle = None  # the runtime Stream, set on the batch-loop thread
        self.submitted = time.perf_counter()
        self.first_block: float | None = None
        self.released = False  # its final event ("done" or "error") is posted
        self.watcher: asyncio.Task | None = None  # the HTTP side's disconnect watch
        self.pipe_id: int | None = None  # its id on the engine process's pipe (engine_process.py)

    def post(self, kind: str, value: Any = None) -> None:
        """Thread-safe: queue an event for the HTTP side now (the engine batches its own: `Engine._flush`)."""
        post_events(self.aloop, [(self, Event(kind, value))])

    def holds_row(self) -> bool:
        """Admitted and holding a slot of the batch (its rows are in the next step)."""
        req = self.handle.request if self.handle is not None else None
        return req is not None and req.slot is not None and not req.finished


def post_events(aloop: asyncio.AbstractEventLoop, events: list[tuple[Job, Event]]) -> None:
    """Thread-safe: put each (job, event) on its job's queue, in order, in one callback of `aloop`."""
    try:
        aloop.call_soon_threadsafe(_put_events, events)
    except RuntimeError:  # the event loop is gone (shutdown)
        pass


def post_by_loop(events: list[tuple[Job, Event]]) -> None:
    """Hand events over: one call_soon_threadsafe per event loop, each job's events in order."""
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[Job, Event]]] = {}
    for job, event in events:
        by_loop.setdefault(job.aloop, []).append((job, event))
    for aloop, batch in by_loop.items():
        post_events(aloop, batch)


def _put_events(events: list[tuple[Job, Event]]) -> None:
    for job, event in events:
        job.events.put_nowait(event)


class Full(Exception):
    """The engine cannot take, or finish, a request now: a 503 with Retry-After (SERVING.md 2, 5).

    `code`: server_busy (queue full, engine loading), server_shutting_down
    (SIGTERM: draining, or past the drain timeout), engine_stopped.
    """

    def __init__(self, message: str, code: str = "server_busy"):
        super().__init__(message)
        self.code = code

    def __reduce__(self):  # sent from the engine process with its code (engine_process.py)
        return (type(self), (str(self), self.code))


def shutting_down() -> Full:
    return Full("the server is shutting down; retry later", "server_shutting_down")


def check_admission(engine, stopping: bool) -> None:
    """`Full` unless `engine` (an Engine or a ProcessEngine, its lock held) takes one more request now."""
    if engine.died is not None:
        raise Full(f"the engine stopped ({engine.died}); retry later", "engine_stopped")
    if engine.draining or stopping:
        raise shutting_down()
    if not engine.ready:
        raise Full("the engine is loading; retry later")
    if len(engine._live) >= engine.max_pending:
        raise Full(f"the queue is full ({len(engine._live)} requests); retry later")


def short(e: BaseException) -> str:
    """`Type: message`, the message cut to MESSAGE_CHARS."""
    text = str(e)
    if len(text) > MESSAGE_CHARS:
        text = text[:MESSAGE_CHARS] + f"... ({len(text)} characters)"
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


@dataclass
class Engine:
    """Owns the Generator on one thread; `submit`/`cancel`/`drain`/`abort` are safe from any thread."""

    load: Callable[[], Any]  # () -> Generator, called on the batch-loop thread
    max_pending: int  # running rows + queued requests admitted at once
    metrics: Any = None
    gen: Any = None
    ready: bool = False  # loaded and one step ran
    draining: bool = False  # stopped admitting (shutdown)
    load_error: str | None = None
    died: str | None = None  # why the batch-loop thread stopped while serving
    stopped: threading.Event = field(default_factory=threading.Event)  # the batch-loop thread has ended
    _inbox: list[Job] = field(default_factory=list)
    _cancels: list[Job] = field(default_factory=list)
    _jobs: dict[int, Job] = field(default_factory=dict)
    _live: set[Job] = field(default_factory=set)  # submitted, not cancelled, final event not yet posted
    _outbox: list[tuple[Job, Event]] = field(default_factory=list)  # this pass's events, for `_flush`
    _stop: bool = False
    _abort: Exception | None = None
    _cond: threading.Condition = field(default_factory=threading.Condition)
    _thread: threading.Thread | None = None
    # the C heap's free pages go back to the system every 30 s of stepping and when the batch empties: the
    # steps' varying tensor sizes otherwise fragment glibc's arenas and resident memory creeps (core/heap.py)
    heap_trimmer: heap.Trimmer = field(default_factory=heap.Trimmer)

    # --- any thread ---------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="batch-loop", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """End every request (503) and the batch-loop thread."""
        with self._cond:
            self._stop = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout)

    def submit(self, job: Job) -> None:
        with self._cond:
            check_admission(self, self._stop)
            self._live.add(job)
            self._inbox.append(job)
            self._cond.notify()

    def cancel(self, job: Job) -> None:
        """Leave the batch at the next step (client gone, timeout); no effect once finished. The request stops
        counting against `max_pending` at once: the next admission has its place, even before the engine
        thread has dropped it (docs/serving.md, A full server)."""
        with self._cond:
            self._live.discard(job)
            if job in self._inbox:  # not admitted yet: the runtime never sees it
                self._inbox.remove(job)
                job.released = True
                return
            self._cancels.append(job)
            self._cond.notify()

    def drain(self) -> None:
        """Stop admitting: new requests get a 503 (server_shutting_down); running ones go on."""
        with self._cond:
            self.draining = True

    def abort(self, error: Exception) -> None:
        """End every admitted or queued request with `error` before the next step."""
        with self._cond:
            self._abort = error
            self._cond.notify()

    def idle(self) -> bool:
        """No request admitted or queued (every one has had its final event)."""
        return not self._live

    def wait_idle(self, timeout: float) -> bool:
        end = time.monotonic() + timeout
        while not self.idle() and not self.stopped.is_set() and time.monotonic() < end:
            time.sleep(0.02)
        return self.idle()

    def shut_down(self, drain_timeout: float, grace: float = 5.0) -> bool:
        """SIGTERM (SERVING.md 5): stop admitting, give running requests `drain_timeout` seconds, then end
        the rest with a 503 (streams: an error chunk). True when every request finished on its own."""
        self.drain()
        running = len(self._live)
        if running:
            log.info("draining: %d request(s) running, %.0f s to finish", running, drain_timeout)
        if self.wait_idle(drain_timeout):
            return True
        log.warning("drain timeout: ending %d running request(s) with 503", len(self._live))
        self.abort(shutting_down())
        self.wait_idle(grace)
        return False

    def wait_ready(self, timeout: float) -> bool:
        end = time.monotonic() + timeout
        while not self.ready and self.load_error is None and time.monotonic() < end:
            time.sleep(0.05)
        return self.ready

    # --- batch-loop thread --------------------------------------------------------
    def _run(self) -> None:
        try:
            if self._load():
                self._serve()
        except BaseException as e:  # noqa: BLE001 - a fault no request can be blamed for: the engine stops
            self._die(e)
        finally:
            self.stopped.set()

    def _load(self) -> bool:
        try:
            self.gen = self.load()
            self._warm_up()
        except Exception as e:  # reported by /health; the command exits 1 saying why
            self.load_error = str(e) if isinstance(e, CloverError) else short(e)
            log.error("engine failed to load: %s", self.load_error)
            return False
        self.ready = True
        return True

    def _warm_up(self) -> None:
        """One step of a one-token request, so /health reports a working engine."""
        h = self.gen.submit("hi", raw=True, max_new_tokens=1)
        self.gen.step()
        h.cancel()

    def _serve(self) -> None:
        """Between steps: admit, cancel, abort; then one step for every running request."""
        while True:
            with self._cond:
                while not (self._inbox or self._cancels or self._stop or self._abort or self.gen.loop.has_work()):
                    self.heap_trimmer.idle()
                    self._cond.wait()
                inbox, self._inbox = self._inbox, []
                cancels, self._cancels = self._cancels, []
                abort, self._abort = self._abort, None
                stop = self._stop
            for job in inbox:
                self._admit(job)
            for job in cancels:
                self._drop(job, None)
            if abort is not None or stop:
                for job in list(self._jobs.values()):
                    self._drop(job, abort or shutting_down())
            self._flush()  # before the step: an admitted stream's headers go out while it runs
            if stop:
                return
            if self.gen.loop.has_work():
                self._step()
                self._flush()
                self.heap_trimmer.worked()

    def _admit(self, job: Job) -> None:
        try:
            job.handle = self.gen.submit(**job.kwargs)
        except CloverError as e:  # refused before any compute: this request only
            self._release(job, "error", e)
            return
        except Exception as e:  # noqa: BLE001 - anything else a request brings fails it alone
            self._fail(job, "while being admitted", e)
            return
        self._jobs[job.handle.request_id] = job
        self._post(job, "accepted", job.handle.request.prompt_len)

    def _step(self) -> None:
        t0 = time.perf_counter()
        try:
            self.gen.step()
        except Exception as e:  # noqa: BLE001 - the runtime could not tell whose fault it was
            self._fail_step(e)
            return
        if self.metrics is not None:
            try:
                sched = self.gen.loop.scheduler
                self.metrics.step(time.perf_counter() - t0, len(sched.running), len(sched.waiting))
            except Exception as e:  # noqa: BLE001 - figures are not worth a request
                log.warning("step metrics failed: %s", short(e))
        for job in list(self._jobs.values()):
            try:
                self.deliver(job)
            except Exception as e:  # noqa: BLE001 - a fault while delivering one request fails it alone
                self._fail(job, "while its blocks were delivered", e)

    def _fail_step(self, e: Exception) -> None:
        """A step raised past the runtime's own isolation: its rows fail (all requests when none holds a row)."""
        blamed = [j for j in self._jobs.values() if j.holds_row()] or list(self._jobs.values())
        if not blamed:  # a step failing with no request in it: the engine itself is broken
            raise e
        log.error("an engine step failed (%s); its %d request(s) fail: %s", short(e), len(blamed),
                  ", ".join(j.name for j in blamed))
        log.debug("engine step failure", exc_info=e)
        for job in blamed:
            self._drop(job, RuntimeError(f"the engine step failed: {short(e)}"))

    def _fail(self, job: Job, where: str, e: Exception) -> None:
        """One request fails (500 engine_error): logged once, the others go on."""
        log.error("request %s failed %s: %s", job.name, where, short(e))
        log.debug("request %s failure", job.name, exc_info=e)
        error = RuntimeError(short(e))
        if job.handle is None:
            self._release(job, "error", error)
        else:
            self._drop(job, error)

    def deliver(self, job: Job) -> None:
        """Hand the request's new blocks (and its result once finished) to its HTTP side."""
        h = job.handle
        while h.chunks:
            chunk = h.chunks.popleft()
            if job.first_block is None:
                job.first_block = time.perf_counter()
            self._post(job, "block", chunk)
        if h.done and h.result.finish_reason == "error":  # the runtime failed this row alone (loop.py)
            log.error("request %s failed in the runtime: %s", job.name, h.result.error)
            self._release(job, "error", RuntimeError(h.result.error or "the request failed"))
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
        try:
            job.handle.cancel()
        except Exception as e:  # noqa: BLE001 - its slot may stay taken; the request still ends
            log.error("request %s could not be cancelled: %s", job.name, short(e))
            error = error or RuntimeError(f"cancelling failed: {short(e)}")
        result = job.handle.result
        if error is None and result is None:
            error = RuntimeError("the request was cancelled without a result")
        self._release(job, "error" if error else "done", error or result)

    def _release(self, job: Job, kind: str, value: Any) -> None:
        if job.handle is not None:
            self._jobs.pop(job.handle.request_id, None)
        with self._cond:
            self._live.discard(job)
        job.released = True
        self._post(job, kind, value)

    def _post(self, job: Job, kind: str, value: Any = None) -> None:
        """Queue an event for the job's HTTP side; `_flush` hands them over."""
        self._outbox.append((job, Event(kind, value)))

    def _flush(self) -> None:
        """Hand this pass's events over (`post_by_loop`)."""
        events, self._outbox = self._outbox, []
        post_by_loop(events)

    def _die(self, e: BaseException) -> None:
        """The batch-loop thread stops: every request ends with a 503 now; /health and the process say so."""
        with self._cond:
            self.died = short(e)
            jobs = list(self._live)  # admitted, queued, or taken from the inbox and not yet admitted
            self._live.clear()
            self._jobs.clear()
            self._inbox.clear()
        log.critical("the engine stopped (%s); ending %d request(s); the server exits", self.died, len(jobs),
                     exc_info=e)
        error = Full(f"the engine stopped ({self.died}); retry later", "engine_stopped")
        self._flush()  # what this pass delivered comes before the 503
        for job in jobs:
            job.released = True
            job.post("error", error)

    # --- figures for /metrics -----------------------------------------------------
    def load_figures(self) -> tuple[int, int]:
        """(running rows, waiting requests), read without stopping the engine."""
        if self.gen is None:
            return 0, 0
        sched = self.gen.loop.scheduler
        return len(sched.running), len(sched.waiting) + len(self._inbox)

    def cache_figures(self) -> dict[str, float] | None:
        """The prefix cache's figures (`PrefixCache.figures`); None before loading or with the cache off."""
        cache = self.gen.prefix_cache if self.gen is not None else None
        return cache.figures() if cache is not None else None

    def heap_figures(self) -> dict[str, int] | None:
        """The C heap of the engine's process (core/heap.py)."""
        return heap.heap_bytes()
