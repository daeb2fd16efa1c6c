"""The engine in a process of its own: the HTTP side and the batch loop stop sharing one GIL (docs/serving.md,
The engine process).

In one process the batch-loop thread gives up the GIL around every torch op (thousands a forward) and
takes it back after; each time the event loop or a tokenizing worker holds it then, the step waits, and
the hand-over itself costs a wake-up. Python busy a few per cent of the time beside the model slows its
steps 7-21 % (bench/gil_contention.py); across processes the same work costs at most 2 %. So `clover-export
serve` runs the `Engine` (engine.py, unchanged) in a child process, as vLLM's V1 engine core does, and the
HTTP process holds a `ProcessEngine`: the same interface, over one pipe.

- Parent -> child: ("submit", id, kwargs, name), ("cancel", id), ("drain",), ("abort", error), ("stop",).
  A request's grammar travels as its spec and is compiled again in the child (cached per spec there).
- Child -> parent: ("ready", cfg, source_dir, block_size, max_context) or ("load_error", why);
  ("events", [(id, kind, value), ...], (running, waiting)): one message per pass of the batch loop, as the
  in-process engine posts one callback per pass; ("step", seconds, running, waiting) for /metrics;
  ("figures", {...}) when the load, prefix-cache or heap figures change (read every FIGURES_S); ("ended", died)
  last.

The HTTP side checks and tokenizes requests against a `Frontend` (the model's config, tokenizer and
defaults, no weights), so a request the engine would refuse is still refused before it is sent. The
child ignores SIGINT and SIGTERM: the parent drains it (cli/serve.py); it exits when the pipe closes, so
it never outlives the server. If it dies (killed, out of memory), every request ends with a 503
(engine_stopped), `died` says why, and the server exits non-zero, as when the in-process engine stops.
"""

from __future__ import annotations

import itertools
import logging
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from clover_export.core.errors import CloverError
from clover_export.serve.engine import Engine, Event, Full, Job, check_admission, post_by_loop, short, shutting_down

log = logging.getLogger("clover_export.serve")
FIGURES_S = 0.5  # how often the child reads its load, prefix-cache and heap figures (sent when they change)


@dataclass
class GrammarSpec:
    """A request's grammar on its way to the child: the spec it was compiled from in the HTTP process."""

    spec: Any


@dataclass
class RequestRecord:
    """What the HTTP side reads of a finished request's runtime record (`job.handle.request`): the response
    before stop strings cut it, and the draft counters of /metrics."""

    response: list[int]
    verifications: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0


# --- the HTTP process ---------------------------------------------------------------------------------------------
@dataclass
class ProcessEngine:
    """`Engine`'s interface for the HTTP side, with the Engine itself in a child process.

    `gen` is a `runtime.frontend.Frontend` once the child has loaded the model. Admission (`max_pending`,
    loading, draining, stopped) is decided here, at once, as the in-process engine decides it.
    """

    options: Any  # ServeOptions: plain data, sent to the child
    max_pending: int
    metrics: Any = None
    gen: Any = None
    ready: bool = False
    draining: bool = False
    load_error: str | None = None
    died: str | None = None
    stopped: threading.Event = field(default_factory=threading.Event)
    _jobs: dict[int, Job] = field(default_factory=dict)  # sent, final event not yet received
    _live: set[Job] = field(default_factory=set)  # counted against max_pending
    _ids: Any = field(default_factory=lambda: itertools.count(1))
    _lock: threading.Lock = field(default_factory=threading.Lock)  # _jobs, _live; never held while sending
    _send_lock: threading.Lock = field(default_factory=threading.Lock)  # the pipe's sending end
    _figures: dict[str, Any] = field(default_factory=lambda: {"running": 0, "waiting": 0, "cache": None,
                                                               "heap": None})
    _stopping: bool = False
    _conn: Any = None
    _process: Any = None
    _reader: threading.Thread | None = None

    def start(self) -> None:
        """Start the child: a fresh interpreter (`python -m` this module; not fork, which would copy the locks
        of this process's threads, nor multiprocessing's spawn, which imports the caller's main module again)
        given its end of a socket pair."""
        from multiprocessing.connection import Connection

        ours, theirs = socket.socketpair()
        # the child imports this package from where this process did, installed or not
        root = str(Path(__file__).resolve().parents[2])
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
        with theirs:
            self._process = subprocess.Popen([sys.executable, "-m", __name__, str(theirs.fileno())],
                                             pass_fds=[theirs.fileno()], env=env)
        # the child's end is closed here: its exit closes the pipe for the reader
        self._conn = Connection(ours.detach())
        serve_log = logging.getLogger("clover_export.serve")
        handler = next(iter(serve_log.handlers), None)
        fmt = getattr(getattr(handler, "formatter", None), "_fmt", None)
        self._send(("options", self.options, serve_log.getEffectiveLevel(), fmt))
        self._reader = threading.Thread(target=self._read, name="engine-pipe", daemon=True)
        self._reader.start()

    def stop(self, timeout: float = 30.0) -> None:
        """End every request (503) and the child."""
        self._stopping = True
        self._send(("stop",))
        if self._reader is not None:
            self._reader.join(timeout)
        if self._process is not None:
            try:
                self._process.wait(5)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait(5)

    def submit(self, job: Job) -> None:
        kwargs = dict(job.kwargs)
        if kwargs.get("grammar") is not None:
            kwargs["grammar"] = GrammarSpec(kwargs["grammar"].spec)
        with self._send_lock:  # registered and sent in one go: a cancel can only follow the submission
            with self._lock:
                check_admission(self, self._stopping)
                job.pipe_id = next(self._ids)
                self._live.add(job)
                self._jobs[job.pipe_id] = job
            try:
                self._conn.send(("submit", job.pipe_id, kwargs, job.name))
            except Exception as e:
                with self._lock:
                    self._live.discard(job)
                    self._jobs.pop(job.pipe_id, None)
                if isinstance(e, (OSError, ValueError)):  # the pipe is closed: the reader is ending every request
                    raise Full("the engine process is gone; retry later", "engine_stopped") from None
                raise

    def cancel(self, job: Job) -> None:
        """As `Engine.cancel`: the request stops counting against `max_pending` at once."""
        with self._lock:
            self._live.discard(job)
            sent = job.pipe_id in self._jobs
        if sent:
            self._send(("cancel", job.pipe_id))

    def drain(self) -> None:
        self.draining = True
        self._send(("drain",))

    def abort(self, error: Exception) -> None:
        self._send(("abort", error))

    def idle(self) -> bool:
        return not self._live

    wait_idle = Engine.wait_idle
    shut_down = Engine.shut_down
    wait_ready = Engine.wait_ready

    # --- figures for /metrics (the child's, as last sent) --------------------------------------------------------
    def load_figures(self) -> tuple[int, int]:
        return self._figures["running"], self._figures["waiting"]

    def cache_figures(self) -> dict[str, float] | None:
        return self._figures["cache"]

    def heap_figures(self) -> dict[str, int] | None:
        return self._figures["heap"]

    # --- the pipe ------------------------------------------------------------------------------------------------
    def _send(self, message: tuple) -> None:
        """A message to the child. The reader never waits for this lock, so the child's messages are always
        read: a send blocked on a full pipe waits only for the child's main thread to read it."""
        with self._send_lock:
            try:
                self._conn.send(message)
            except (OSError, ValueError):  # the child is gone: the reader says why
                pass

    def _read(self) -> None:
        """The child's messages, until its end of the pipe closes."""
        why = None
        try:
            while True:
                message = self._conn.recv()
                kind = message[0]
                if kind == "events":
                    self._deliver(message[1])
                    self._figures = {**self._figures, "running": message[2][0], "waiting": message[2][1]}
                elif kind == "step":
                    if self.metrics is not None:
                        self.metrics.step(*message[1:])
                elif kind == "figures":
                    self._figures = message[1]
                elif kind == "ready":
                    from clover_export.runtime.frontend import Frontend

                    try:
                        self.gen = Frontend(*message[1:])
                    except Exception as e:  # noqa: BLE001 - as a model that fails to load
                        self.load_error = str(e) if isinstance(e, CloverError) else short(e)
                        self._send(("stop",))
                    else:
                        self.ready = True
                elif kind == "load_error":
                    self.load_error = message[1]
                elif kind == "ended":
                    why = message[1]
                    break
        except (EOFError, OSError):  # the child died without a word
            try:
                code = self._process.wait(5)
            except subprocess.TimeoutExpired:
                code = None
            why = f"the engine process exited ({_exit_status(code)})"
            if not self._stopping:
                log.critical("the engine stopped (%s); the server exits", why)
        except Exception as e:  # noqa: BLE001 - a message this side could not take: the engine is unusable
            why = f"the engine process's messages could not be read: {short(e)}"
            log.critical("the engine stopped (%s); the server exits", why, exc_info=e)
            self._process.kill()
        finally:
            self._end(why)

    def _deliver(self, events: list[tuple[int, str, Any]]) -> None:
        """One pass's events to their jobs' event loops (one callback per loop, as `Engine._flush`)."""
        out: list[tuple[Job, Event]] = []
        now = time.perf_counter()
        with self._lock:
            for pipe_id, kind, value in events:
                job = self._jobs.get(pipe_id)
                if job is None:  # ended here already (a cancel that crossed its final event)
                    continue
                if kind == "block" and job.first_block is None:
                    job.first_block = now
                elif kind == "done":
                    value, record = value
                    job.handle = SimpleNamespace(request=record)
                if kind in ("done", "error"):
                    del self._jobs[pipe_id]
                    self._live.discard(job)
                    job.released = True
                out.append((job, Event(kind, value)))
        post_by_loop(out)

    def _end(self, why: str | None) -> None:
        """The child has ended: every request still open ends with a 503."""
        with self._lock:
            if why is not None and not self._stopping and self.load_error is None:
                if self.ready:
                    self.died = why
                else:  # it never loaded: the command says the model could not be loaded
                    self.load_error = why
            jobs = list(self._jobs.values())
            self._jobs.clear()
            self._live.clear()
        error = (Full(f"the engine stopped ({self.died}); retry later", "engine_stopped") if self.died
                 else shutting_down())
        for job in jobs:
            job.released = True
            job.post("error", error)
        self.stopped.set()


def _exit_status(code: int | None) -> str:
    if code is None:
        return "still running, not answering"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


# --- the child process --------------------------------------------------------------------------------------------
class _Outbox:
    """The child's stand-in for the HTTP side's event loop: `Engine._flush` hands it a pass's events, which go
    to the parent as one message; `Engine.metrics.step` sends the step's figures."""

    def __init__(self, conn, jobs: dict[int, Job]):
        self.conn, self.jobs, self.lock = conn, jobs, threading.Lock()  # jobs: by pipe id, until their final event
        self.load = lambda: (0, 0)  # the engine's (running, waiting), sent with each pass's events

    def send(self, message: tuple) -> None:
        with self.lock:
            try:
                self.conn.send(message)
            except (OSError, ValueError):  # the parent is gone; the child's main loop sees the pipe closed
                pass

    def call_soon_threadsafe(self, _put, events: list[tuple[Job, Event]]) -> None:
        out = []
        for job, ev in events:
            final = ev.kind in ("done", "error")
            if (self.jobs.pop if final else self.jobs.get)(job.pipe_id, None) is None:  # its final event went
                continue
            value = ev.value
            if ev.kind == "done":
                req = job.handle.request
                value = (value, RequestRecord(list(req.response), getattr(req, "verifications", 0),
                                              getattr(req, "drafted_tokens", 0), getattr(req, "accepted_tokens", 0)))
            elif ev.kind == "error":
                value = picklable(value)
            out.append((job.pipe_id, ev.kind, value))
        if out:
            self.send(("events", out, self.load()))

    def step(self, seconds: float, running: int, waiting: int) -> None:  # Engine.metrics
        self.send(("step", seconds, running, waiting))


def picklable(e: BaseException) -> BaseException:
    """`e` if it survives pickling whole, else a RuntimeError with its text."""
    try:
        pickle.loads(pickle.dumps(e))
        return e
    except Exception:  # noqa: BLE001
        return RuntimeError(short(e))


def child_main(fd: int) -> None:
    """The engine process: load, serve the parent's messages until told to stop or the pipe closes."""
    from multiprocessing.connection import Connection

    for sig in (signal.SIGINT, signal.SIGTERM):  # the parent drains this process; Ctrl-C reaches both
        signal.signal(sig, signal.SIG_IGN)
    conn = Connection(fd)
    try:
        _, options, log_level, log_format = conn.recv()
    except (EOFError, OSError):
        return
    _log_to_stderr(log_level, log_format)
    jobs: dict[int, Job] = {}
    outbox = _Outbox(conn, jobs)
    engine = Engine(options.load_generator, max_pending=sys.maxsize, metrics=outbox)
    outbox.load = engine.load_figures
    engine.start()
    while not engine.ready and engine.load_error is None and not engine.stopped.is_set():
        try:
            stop = conn.poll(0.05) and conn.recv()[0] == "stop"  # told to stop while loading
        except (EOFError, OSError):  # the parent is gone
            stop = True
        if stop:
            engine.stop()
            outbox.send(("ended", None))
            return
    if engine.load_error is not None or not engine.ready:
        outbox.send(("load_error", engine.load_error or engine.died or "the engine stopped while loading"))
        outbox.send(("ended", None))
        return
    gen = engine.gen
    outbox.send(("ready", gen.cfg, str(gen.source_dir), gen.block_size, gen.max_context))
    figures: dict[str, Any] = {}
    next_figures = 0.0
    try:
        while not engine.stopped.is_set():
            if conn.poll(FIGURES_S):
                message = conn.recv()
                if _take(message, engine, outbox, jobs):
                    break
            if time.monotonic() >= next_figures:
                next_figures = time.monotonic() + FIGURES_S
                now = _figures(engine)
                if now != figures:
                    figures = now
                    outbox.send(("figures", now))
    except (EOFError, OSError):  # the parent is gone
        engine.stop()
    engine.stopped.wait(60)
    outbox.send(("ended", engine.died))


def _take(message: tuple, engine: Engine, outbox: _Outbox, jobs: dict[int, Job]) -> bool:
    """One message from the parent; True when it says stop."""
    kind = message[0]
    if kind == "submit":
        _, pipe_id, kwargs, name = message
        job = Job(kwargs, outbox, name=name)
        job.pipe_id, jobs[pipe_id] = pipe_id, job
        try:
            grammar = kwargs.get("grammar")
            if isinstance(grammar, GrammarSpec):  # compiled again for this process's vocabulary (cached per spec)
                from clover_export.constraints import compile

                kwargs["grammar"] = compile(grammar.spec, engine.gen.grammar_vocab())
            engine.submit(job)
        except Exception as e:  # noqa: BLE001 - this request alone fails (a Full is the parent's 503)
            outbox.call_soon_threadsafe(None, [(job, Event("error", e))])
    elif kind == "cancel":
        job = jobs.get(message[1])
        if job is not None:
            engine.cancel(job)
            if job.handle is None and job.released and job.pipe_id in jobs:  # taken off the queue: no event follows
                outbox.call_soon_threadsafe(None, [(job, Event("error", CloverError("serve", "cancelled")))])
    elif kind == "drain":
        engine.drain()
    elif kind == "abort":
        engine.abort(message[1])
    elif kind == "stop":
        engine.stop()
        return True
    return False


def _figures(engine: Engine) -> dict[str, Any]:
    running, waiting = engine.load_figures()
    return {"running": running, "waiting": waiting, "cache": engine.cache_figures(), "heap": engine.heap_figures()}


def _log_to_stderr(level: int, fmt: str | None) -> None:
    """The engine's lines (failed requests, a fault) on stderr, at the server's level and in its format."""
    serve_log = logging.getLogger("clover_export.serve")
    handler = logging.StreamHandler(sys.stderr)
    if fmt and "levelprefix" in fmt:
        from uvicorn.logging import DefaultFormatter

        handler.setFormatter(DefaultFormatter(fmt, use_colors=False))
    elif fmt:
        handler.setFormatter(logging.Formatter(fmt))
    serve_log.handlers = [handler]
    serve_log.setLevel(level)
    serve_log.propagate = False


if __name__ == "__main__":  # run as `python -m`: this file is __main__; its classes must pickle by their module's name
    from clover_export.serve.engine_process import child_main as main

    main(int(sys.argv[1]))
