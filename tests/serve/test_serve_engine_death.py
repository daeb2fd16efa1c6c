"""The engine never dies of a request; if it stops anyway, /health and new requests get 503 at once and
the server process exits non-zero, for a supervisor to restart it (SERVING.md 5; docs/serving.md).

Faults are injected by monkeypatching the runtime: in this process for an in-process server, and in a
server subprocess through a launcher that patches before it runs the real `clover-export serve`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from click.testing import CliRunner
from test_serve import LONG, ThreadServer, check_error

from clover_export.cli import main
from clover_export.runtime.config import RuntimeConfig
from clover_export.serve.app import ServeOptions, build_app
from clover_export.serve.engine import Job
from clover_export.testing.server import free_port

MODEL_ID = "clover-tiny"
GOOD = [("The answer is", 12), ("What is 2 + 3?", 40), ("12*12=", 12)]


def completion(url, prompt, max_tokens, stream=False, **extra):
    body = {"model": MODEL_ID, "prompt": prompt, "max_tokens": max_tokens, "stream": stream, **extra}
    if not stream:
        return httpx.post(url + "/v1/completions", json=body, timeout=60)
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
        return r.status_code, r.read().decode()


def sse_events(text):
    """The JSON events of an SSE body, and whether it ended with `data: [DONE]`."""
    events = [e for e in text.split("\n\n") if e]
    return [json.loads(e[6:]) for e in events if e != "data: [DONE]"], events[-1:] == ["data: [DONE]"]


def text_of(url, prompt, max_tokens, stream):
    out = completion(url, prompt, max_tokens, stream)
    if stream:
        status, body = out
        events, done = sse_events(body)
        assert status == 200 and done
        return "".join(e["choices"][0]["text"] for e in events if e.get("choices"))
    assert out.status_code == 200, out.text
    return out.json()["choices"][0]["text"]


@pytest.fixture(scope="module")
def reference(tiny_dir):
    from clover_export.runtime import Generator

    gen = Generator.load(None, max_slots=1)
    return {(p, n): gen.generate(p, raw=True, max_new_tokens=n).text for p, n in GOOD}


def new_server(**kw):
    opts = dict(runtime=RuntimeConfig(max_slots=4), max_queue=8, request_timeout_s=60)
    return ThreadServer(build_app(ServeOptions(**{**opts, **kw})))


@pytest.fixture(scope="module")
def server(tiny_dir):
    with new_server() as srv:
        srv.wait_healthy()
        yield srv


def engine_of(srv):
    return srv.app.state.engine


def serve_records(caplog, level=logging.WARNING):
    return [r for r in caplog.records if r.name == "clover_export.serve" and r.levelno >= level]


def goods_and_one_bad(url, bad):
    """The GOOD requests (streamed and not) next to `bad()`; returns (texts by case, bad's outcome)."""
    with ThreadPoolExecutor(8) as pool:
        goods = {(p, n, s): pool.submit(text_of, url, p, n, s) for p, n in GOOD for s in (False, True)}
        outcome = pool.submit(bad)
        return {k: f.result() for k, f in goods.items()}, outcome.result()


# --- the engine never dies of a request ------------------------------------------------------------------
def test_an_unexpected_error_while_admitting_fails_that_request_alone(server, reference, monkeypatch, caplog):
    """A TypeError raised while the engine admits a request (as a lone surrogate did in the tokenizer; here
    from the runtime's queue, which only the engine thread calls) is a 500 for that request, one log line
    naming it, no traceback; the requests beside it get their answers."""
    eng = engine_of(server)
    real = eng.gen.loop.add

    def add(req):
        if req.max_new_tokens == 7:
            raise TypeError("TextInputSequence must be str")
        return real(req)

    monkeypatch.setattr(eng.gen.loop, "add", add)
    caplog.set_level(logging.INFO)
    texts, bad = goods_and_one_bad(server.url, lambda: completion(server.url, "Hi", 7))
    err = check_error(bad, 500, code="engine_error")
    assert "TypeError: TextInputSequence must be str" in err["message"]
    assert texts == {(p, n, s): reference[p, n] for p, n, s in texts}
    failed = serve_records(caplog)
    assert len(failed) == 1 and "TypeError: TextInputSequence must be str" in failed[0].getMessage()
    assert failed[0].exc_info is None and "failed while being admitted" in failed[0].getMessage()
    assert failed[0].getMessage().startswith("request cmpl-")  # the id its response would carry
    assert eng._thread.is_alive() and httpx.get(server.url + "/health").json() == {"status": "ok"}
    assert not eng.gen.handles  # nothing left behind by the refused request
    assert text_of(server.url, "The answer is", 12, False) == reference["The answer is", 12]


def final_events(eng, kwargs_list, timeout=60):
    """Submit one Job per kwargs straight to the engine; their final events ("done" or "error")."""
    async def run():
        aloop = asyncio.get_running_loop()
        jobs = [Job(kw, aloop) for kw in kwargs_list]
        for job in jobs:
            eng.submit(job)

        async def final(job):
            while (ev := await asyncio.wait_for(job.events.get(), timeout)).kind not in ("done", "error"):
                pass
            return ev

        return await asyncio.gather(*(final(job) for job in jobs))

    return asyncio.run(run())


def test_a_prompt_the_tokenizer_cannot_take_fails_alone_on_the_engine(server, reference, caplog):
    """A lone surrogate handed to the engine (what `Generator.submit` accepts: a raw prompt string) makes
    the tokenizer raise TypeError on the engine thread: that request fails, the one beside it finishes."""
    eng = engine_of(server)
    caplog.set_level(logging.INFO)
    bad, good = final_events(eng, [dict(prompt="\ud800 hi", raw=True, max_new_tokens=4),
                                   dict(prompt="The answer is", raw=True, max_new_tokens=12)])
    assert bad.kind == "error" and "TypeError" in str(bad.value)
    assert good.kind == "done" and good.value.text == reference["The answer is", 12]
    assert len(serve_records(caplog)) == 1 and eng._thread.is_alive() and eng.idle()


def test_a_step_failing_past_the_runtime_isolation_fails_the_rows_of_that_step(server, reference, monkeypatch,
                                                                                caplog):
    """A fault the runtime cannot pin on a row (here in the scheduler's update, after the backend ran) fails
    the requests holding a row in that step; the engine goes on and later requests get their answers."""
    eng = engine_of(server)
    sched = eng.gen.loop.scheduler
    real = sched.update

    def update(plan, *args, **kwargs):
        if any(r.max_new_tokens == 9 for r in plan.requests):
            raise IndexError("injected update fault")
        return real(plan, *args, **kwargs)

    monkeypatch.setattr(sched, "update", update)
    caplog.set_level(logging.INFO)
    with ThreadPoolExecutor(2) as pool:
        beside = pool.submit(completion, server.url, LONG["prompt"], 1000, True, threshold=1.0)
        end = time.monotonic() + 30
        while not sched.running and time.monotonic() < end:
            time.sleep(0.01)
        bad = completion(server.url, "Hi", 9)
        status, body = beside.result()
    err = check_error(bad, 500, code="engine_error")
    assert "IndexError: injected update fault" in err["message"]
    events, done = sse_events(body)
    assert status == 200 and done and events[-1]["error"]["code"] == "engine_error"
    records = serve_records(caplog)
    assert len(records) == 1 and "its 2 request(s) fail" in records[0].getMessage()
    monkeypatch.undo()
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    assert text_of(server.url, "What is 2 + 3?", 40, True) == reference["What is 2 + 3?", 40]
    assert not sched.running and len(sched.free_slots) == 4


# --- an engine that stops anyway ---------------------------------------------------------------------------
def poison_has_work(loop, marker=13):
    """Loop.has_work raises once a request with max_new_tokens == marker waits: a fault outside any step,
    which no request can be blamed for (the engine calls it between steps)."""
    real = loop.has_work

    def has_work():
        if any(r.max_new_tokens == marker for r in loop.scheduler.waiting):
            raise RuntimeError("injected scheduler fault")
        return real()

    return has_work


def test_a_stopped_engine_ends_every_request_and_health_and_new_requests_are_503(tiny_dir, monkeypatch, caplog):
    caplog.set_level(logging.INFO)
    with new_server() as srv:
        srv.wait_healthy()
        eng = engine_of(srv)
        monkeypatch.setattr(eng.gen.loop, "has_work", poison_has_work(eng.gen.loop))
        with ThreadPoolExecutor(2) as pool:
            running = pool.submit(completion, srv.url, LONG["prompt"], 1000, True, threshold=1.0)
            end = time.monotonic() + 30
            while not eng.gen.loop.scheduler.running and time.monotonic() < end:
                time.sleep(0.01)
            poisoned = completion(srv.url, "Hi", 13)
            status, body = running.result()
        check_error(poisoned, 503, code="engine_stopped")
        assert poisoned.headers["retry-after"]
        events, done = sse_events(body)
        assert status == 200 and done and events[-1]["error"]["code"] == "engine_stopped"
        assert eng.stopped.is_set() and not eng._thread.is_alive()
        health = httpx.get(srv.url + "/health")
        assert health.status_code == 503 and health.json()["status"] == "failed"
        assert "injected scheduler fault" in health.json()["error"]
        t0 = time.monotonic()
        check_error(completion(srv.url, "The answer is", 12), 503, code="engine_stopped")
        assert time.monotonic() - t0 < 5  # at once, no hang
    records = serve_records(caplog)
    assert len(records) == 1 and records[0].levelno == logging.CRITICAL and records[0].exc_info is not None


LAUNCHER = """
import sys
from clover_export.runtime.scheduler import Scheduler
real = Scheduler.has_work
def has_work(self):
    if any(r.max_new_tokens == 13 for r in self.waiting):
        raise RuntimeError("injected scheduler fault")
    return real(self)
Scheduler.has_work = has_work
from clover_export.cli import main
main(args=["serve", "--engine", "thread", *sys.argv[1:]], prog_name="clover-export")
"""


def test_a_server_process_whose_engine_stops_exits_non_zero(tiny_dir):
    """The real `clover-export serve` with the scheduler fault patched in by a launcher: the clients get
    503 endings, the process exits 1 on its own saying why, with one traceback (the fault's) in its log."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([sys.executable, "-c", LAUNCHER, "--port", str(port), "--log-level", "warning"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=dict(os.environ, PYTHONUNBUFFERED="1"))
    try:
        end = time.monotonic() + 240
        while time.monotonic() < end and proc.poll() is None:
            try:
                if httpx.get(url + "/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.3)
        health_seen = []

        def watch_health():
            while proc.poll() is None:
                try:
                    health_seen.append(httpx.get(url + "/health", timeout=5).status_code)
                except httpx.HTTPError:
                    health_seen.append("closed")
                time.sleep(0.02)

        with ThreadPoolExecutor(3) as pool:
            running = pool.submit(completion, url, LONG["prompt"], 1000, True, threshold=1.0, ignore_eos=True)
            time.sleep(1.0)
            threading.Thread(target=watch_health, daemon=True).start()
            poisoned = completion(url, "Hi", 13)
            died_at = len(health_seen)
            status, body = running.result()
        check_error(poisoned, 503, code="engine_stopped")
        events, done = sse_events(body)
        assert status == 200 and done and events[-1]["error"]["code"] == "engine_stopped"
        assert proc.wait(30) == 1
        log = proc.communicate()[0]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert 200 not in health_seen[died_at:]
    assert "error: [serve] the engine stopped: RuntimeError: injected scheduler fault" in log
    assert log.count("Traceback") == 1, log[-3000:]


def test_serve_backend_triton_on_the_cpu_is_one_line_and_exit_1(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    r = CliRunner().invoke(main, ["serve", "--backend", "triton", "--device", "cpu", "--port", str(free_port())])
    assert r.exit_code == 1 and "Traceback" not in r.output
    lines = [ln for ln in r.output.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and "the triton backend on the CPU needs TRITON_INTERPRET=1" in lines[0]
