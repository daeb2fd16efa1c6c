"""How requests end when the client or the server goes (SERVING.md 3, 5; docs/serving.md).

- A client that disconnects: its row leaves the batch at the next engine step (in-process server, so
  the test can count the engine's steps).
- SIGTERM to a real `clover-export serve` process: it stops admitting (503 + Retry-After, /health 503)
  with the port open through the drain; running requests that finish in time finish; past
  --drain-timeout the rest end with a JSON 503, streams with an error chunk and `data: [DONE]`;
  exit 0, no traceback in the log.
"""

from __future__ import annotations

import json
import re
import signal
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from test_serve import LONG, ThreadServer, check_error

from clover_export.runtime.config import RuntimeConfig
from clover_export.serve.app import ServeOptions, build_app
from clover_export.testing.server import start_server

# exactly one token per step (threshold 1.0), end tokens ignored: ~1000 steps unless cancelled
ENDLESS = {**LONG, "max_tokens": 1000}
# the same prompt for one block: exactly 32 steps, a few seconds beside three other rows on a small CPU
ONE_BLOCK = {**LONG, "max_tokens": 32}


# --- a client that leaves ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(tiny_dir):
    with ThreadServer(build_app(ServeOptions(runtime=RuntimeConfig(max_slots=4), request_timeout_s=120))) as srv:
        srv.wait_healthy()
        yield srv


def raw_request(url: str, body: dict) -> socket.socket:
    """POST /v1/completions on a plain socket (the test decides the moment the connection closes)."""
    host, port = url.removeprefix("http://").split(":")
    data = json.dumps(body).encode()
    s = socket.create_connection((host, int(port)))
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: %d\r\n\r\n" % len(data) + data)
    return s


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "plain"])
def test_a_client_that_disconnects_leaves_the_batch_at_the_next_step(server, stream):
    eng = server.app.state.engine
    loop, sched = eng.gen.loop, eng.gen.loop.scheduler
    conn = raw_request(server.url, {**ENDLESS, "stream": stream})
    end = time.monotonic() + 30
    while not sched.running and time.monotonic() < end:
        time.sleep(0.005)
    row = sched.running[0]
    while row.denoise_steps < 5 and time.monotonic() < end:  # well inside its first block
        time.sleep(0.005)
    steps = loop.steps
    conn.close()
    while row in sched.running and time.monotonic() < end:
        time.sleep(0.001)
    assert row.finish_reason == "cancelled" and row.denoise_steps < 100
    # the step running at the disconnect completes; the row is in no later step (one more on a slow CPU)
    assert loop.steps - steps <= 2
    assert len(sched.free_slots) == 4 and httpx.get(server.url + "/health").status_code == 200


# --- SIGTERM -----------------------------------------------------------------------------------------------
def read_stream(url: str, body: dict, accepted: threading.Event) -> tuple[int, str]:
    with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=120) as r:
        accepted.set()
        return r.status_code, r.read().decode()


def sse(text: str) -> tuple[list[dict], bool]:
    events = [e for e in text.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events), text[-500:]
    return [json.loads(e[6:]) for e in events if e != "data: [DONE]"], events[-1:] == ["data: [DONE]"]


def running_rows(url: str) -> float:
    text = httpx.get(url + "/metrics").text
    return float(re.search(r"^clover_running_rows (\S+)", text, re.M).group(1))


def test_sigterm_drains_with_the_port_open_then_ends_the_rest_with_503_and_exits_0(tiny_dir):
    drain = 8.0
    proc, url = start_server("--max-batch", "4", "--drain-timeout", str(drain), "--log-level", "info")
    try:
        with ThreadPoolExecutor(4) as pool:
            endless = [pool.submit(read_stream, url, ENDLESS, threading.Event()) for _ in range(2)]
            plain = pool.submit(httpx.post, url + "/v1/completions", json=ENDLESS, timeout=120)
            end = time.monotonic() + 60
            while running_rows(url) < 3 and time.monotonic() < end:
                time.sleep(0.05)
            accepted = threading.Event()
            finishing = pool.submit(read_stream, url, ONE_BLOCK, accepted)
            assert accepted.wait(60)
            proc.send_signal(signal.SIGTERM)
            signalled = time.monotonic()
            time.sleep(0.3)
            # draining: the port answers, /health and new requests say 503
            health = httpx.get(url + "/health", timeout=10)
            assert health.status_code == 503 and health.json() == {"status": "draining"}
            assert int(health.headers["retry-after"]) >= 1
            refused = httpx.post(url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 4}, timeout=10)
            check_error(refused, 503, code="server_shutting_down")
            assert int(refused.headers["retry-after"]) >= 1
            outs = [f.result() for f in endless]
            late = plain.result()
            finished = finishing.result()
        assert proc.wait(30) == 0
        took = time.monotonic() - signalled
        log = proc.communicate()[0]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    # the one-block stream finished within the drain
    status, text = finished
    events, done = sse(text)
    assert status == 200 and done and events[-1]["choices"][0]["finish_reason"] == "length"
    # the endless ones ended past the drain timeout: an error chunk, then [DONE]; the plain one a JSON 503
    for status, text in outs:
        events, done = sse(text)
        assert status == 200 and done and len(events) >= 2
        assert events[-1]["error"]["code"] == "server_shutting_down"
        assert events[-1]["error"]["type"] == "service_unavailable"
    check_error(late, 503, code="server_shutting_down")
    assert drain <= took < drain + 15
    for bad in ("Traceback", "CancelledError", "Cancel ", "ERROR"):
        assert bad not in log, log[-3000:]
    assert "drain timeout: ending 3 running request(s) with 503" in log
    with pytest.raises(httpx.ConnectError):
        httpx.get(url + "/health")
