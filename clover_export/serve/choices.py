"""The `n` choices of one chat or completions request (docs/serving.md, Choices).

Each choice is its own engine request (its own batch row). The first is submitted at once; the others once
its first block has come, when its prompt is in the caches, so they resume from it through the prefix cache
(docs/prefix_cache.md) and the prompt is computed once. With a seed, choice i samples with seed + i. Their
events come merged, each tagged with its choice index; one watch on the client cancels them all when it
leaves, as a deadline does.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from clover_export.core.generation import SEED_RANGE
from clover_export.serve.engine import Engine, Event, Job

DONE = ("done", "error")


class Tagged:
    """Job i's event queue: its events go to the request's one queue as (i, event)."""

    def __init__(self, queue: asyncio.Queue, index: int):
        self.queue, self.index = queue, index

    def put_nowait(self, event: Event) -> None:
        self.queue.put_nowait((self.index, event))


def choice_kwargs(kwargs: dict[str, Any], i: int) -> dict[str, Any]:
    """Choice i's engine arguments: the request's, its seed + i when a seed is given (wrapping in its range)."""
    if i == 0 or kwargs.get("seed") is None:
        return kwargs
    return {**kwargs, "seed": (kwargs["seed"] + i) % (int(SEED_RANGE.high) + 1)}


class Choices:
    def __init__(self, eng: Engine, kwargs: dict[str, Any], n: int, name: str):
        aloop = asyncio.get_running_loop()
        self.eng, self.queue = eng, asyncio.Queue()
        self.jobs = [Job(choice_kwargs(kwargs, i), aloop, name=name if i == 0 else f"{name}-{i}") for i in range(n)]
        for i, job in enumerate(self.jobs):
            job.events = Tagged(self.queue, i)
        self.submitted = 0
        self.open = n  # choices without their final event
        self.watcher: asyncio.Task | None = None

    def start(self) -> None:
        """Submit the first choice (`Full` when the engine cannot take it)."""
        self.eng.submit(self.jobs[0])
        self.submitted = 1

    async def next(self, request, deadline: float, gone: type[Exception], timeout_error: Exception
                   ) -> tuple[int, Event]:
        """The next (choice index, event); raises `gone` when the client left, `timeout_error` when time is up
        (every choice cancelled either way). The other choices are submitted after the first's first block."""
        if self.watcher is None:
            self.watcher = asyncio.create_task(self._watch(request))
        try:
            i, ev = await asyncio.wait_for(self.queue.get(), max(0.0, deadline - time.monotonic()))
        except asyncio.TimeoutError:
            self.cancel()
            raise timeout_error from None
        if ev.kind == "gone":
            raise gone()
        if i == 0 and ev.kind in ("block", "done") and self.submitted < len(self.jobs):
            self._submit_rest()
        if ev.kind in DONE:
            self.open -= 1
            if ev.kind == "error" or not self.open:
                self.close()
        return i, ev

    def _submit_rest(self) -> None:
        for job in self.jobs[1:]:
            self.eng.submit(job)  # Full: the request fails as a whole (the caller cancels the others)
            self.submitted += 1

    async def _watch(self, request) -> None:
        """Until the client disconnects; then every choice still running is cancelled and the handler told."""
        try:
            while (await request.receive())["type"] != "http.disconnect":
                pass
        except Exception:  # noqa: BLE001 - a broken connection is a client gone
            pass
        if self.cancel():
            self.queue.put_nowait((-1, Event("gone")))

    def cancel(self) -> bool:
        """Cancel every submitted choice not yet released; True when one was."""
        live = [job for job in self.jobs[:self.submitted] if not job.released]
        for job in live:
            self.eng.cancel(job)
        return bool(live)

    def close(self) -> None:
        """Stop watching the client; choices still running (after another's error) are cancelled."""
        if self.watcher is not None:
            self.watcher.cancel()
        self.cancel()
