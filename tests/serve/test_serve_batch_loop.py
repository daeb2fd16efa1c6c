"""The server's batch-loop thread (serve/engine.py) with a real Generator: it runs under the name `batch-loop`,
and a pass (the admissions, or one step's blocks and results of every stream) reaches the event loop in one
wakeup, each stream's events complete and in order."""

from __future__ import annotations

import asyncio
import threading
from collections import Counter

from clover_export.runtime import Generator
from clover_export.serve.engine import Engine, Job

STREAMS = 8


def test_each_pass_wakes_the_event_loop_once(tiny_dir):
    engine = Engine(lambda: Generator.load(tiny_dir, backend="torch", max_slots=STREAMS), max_pending=STREAMS)
    engine.start()
    try:
        assert engine.wait_ready(600), engine.load_error
        assert [t.name for t in threading.enumerate() if t.ident == engine._thread.ident] == ["batch-loop"]
        wakeups, streams = asyncio.run(_stream_all(engine))
    finally:
        engine.stop()
    want = [r.text for r in engine.gen.wait([engine.gen.submit("The answer is", raw=True, max_new_tokens=40)])]
    for events in streams:
        assert [k for k, _ in events][0] == "accepted" and [k for k, _ in events][-1] == "done"
        assert "".join(c.text for k, c in events if k == "block") == events[-1][1].text == want[0]
    # a wakeup is made at the end of a pass, after the admissions or after a step: the loop's step counter,
    # read then, takes each value at most twice (the step's delivery, then the next admissions)
    per_step = Counter(wakeups)
    assert max(per_step.values()) <= 2, per_step
    events = sum(len(e) for e in streams)
    assert len(wakeups) < events / 2, (len(wakeups), events)


async def _stream_all(engine: Engine) -> tuple[list[int], list[list[tuple]]]:
    """STREAMS identical greedy requests at once; (the engine's step count at each wakeup, each stream's
    events)."""
    loop = asyncio.get_running_loop()
    wakeups: list[int] = []
    real = loop.call_soon_threadsafe

    def counted(callback, *args, **kw):
        if threading.current_thread() is engine._thread:
            wakeups.append(engine.gen.loop.steps)
        return real(callback, *args, **kw)

    loop.call_soon_threadsafe = counted
    jobs = [Job(dict(prompt="The answer is", raw=True, max_new_tokens=40), loop) for _ in range(STREAMS)]
    for job in jobs:
        engine.submit(job)

    async def events(job: Job) -> list[tuple]:
        out = []
        while not out or out[-1][0] not in ("done", "error"):
            ev = await asyncio.wait_for(job.events.get(), 600)
            out.append((ev.kind, ev.value))
        return out

    return wakeups, await asyncio.gather(*(events(j) for j in jobs))
