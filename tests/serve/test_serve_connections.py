"""Clients that leave, stall or overfill, on raw sockets against a real `clover-export serve` process
(docs/serving.md: Input limits, Authentication, A full server).

One server for the module, with short deadlines (--header-timeout / --body-timeout 2 s), a small batch and
queue, a connection cap and an API key; its log goes to a file, so each test counts the lines it caused.
Every test ends with a normal request answered: no client of these breaks the server.
"""

from __future__ import annotations

import json
import re
import socket
import struct
import threading
import time

import httpx
import pytest

from clover_export.testing.server import start_server, stop_server

KEY = "sk-clover-conn-5e1b"
AUTH = f"Authorization: Bearer {KEY}\r\n".encode()
TIMEOUT_S = 2.0  # --header-timeout and --body-timeout of the module's server
SLACK_S = 2.5  # a loaded CI machine
MAX_BATCH, MAX_QUEUE, MAX_HEADERS, MAX_CONNECTIONS = 2, 10, 30, 120
NORMAL = {"prompt": "The answer is", "max_tokens": 4}
ENDLESS = {"prompt": "Please sort the list 3 1 2 4 9", "max_tokens": 1000, "threshold": 1.0, "ignore_eos": True}


class Server:
    def __init__(self, proc, port, log_path):
        self.proc, self.port, self.log_path = proc, port, log_path
        self.url = f"http://127.0.0.1:{port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def log_lines(self) -> int:
        return len(self.log().splitlines())

    def rss_mb(self) -> float:
        status = open(f"/proc/{self.proc.pid}/status").read()
        return int(re.search(r"VmRSS:\s+(\d+) kB", status).group(1)) / 1024

    def metrics(self) -> dict[str, float]:
        text = httpx.get(self.url + "/metrics", timeout=30).text
        return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                if line and not line.startswith("#")}

    def requests_counted(self, status: int) -> float:
        return self.metrics().get(f'clover_requests_total{{endpoint="/v1/completions",status="{status}"}}', 0.0)

    def connect(self) -> socket.socket:
        return socket.create_connection(("127.0.0.1", self.port), timeout=30)


@pytest.fixture(scope="module")
def server(tiny_dir, tmp_path_factory):
    log_path = tmp_path_factory.mktemp("conn") / "server.log"
    args = ["--max-batch", str(MAX_BATCH), "--max-queue", str(MAX_QUEUE), "--header-timeout", str(TIMEOUT_S),
            "--body-timeout", str(TIMEOUT_S), "--max-headers", str(MAX_HEADERS), "--max-connections",
            str(MAX_CONNECTIONS), "--log-level", "info"]
    proc, url = start_server(*args, env={"CLOVER_API_KEY": KEY}, log=log_path)
    srv = Server(proc, int(url.rsplit(":", 1)[1]), log_path)
    try:
        yield srv
    finally:
        log = stop_server(proc, log_path)
    assert proc.returncode == 0, log[-3000:]
    assert "Traceback" not in log and "Exception in ASGI" not in log, log[-6000:]


# --- raw HTTP -------------------------------------------------------------------------------------------------------
def post_head(path: str, length: int | None, extra: bytes = b"") -> bytes:
    size = b"Transfer-Encoding: chunked\r\n" if length is None else b"Content-Length: %d\r\n" % length
    return (b"POST " + path.encode() + b" HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n" + AUTH + size
            + extra + b"\r\n")


def post(srv: Server, body: dict, extra: bytes = b"") -> socket.socket:
    data = json.dumps(body).encode()
    s = srv.connect()
    s.sendall(post_head("/v1/completions", len(data), extra) + data)
    return s


def read_all(s: socket.socket, within: float) -> tuple[float | None, bytes]:
    """(seconds until the server closed the connection, or None if it stayed open; what it sent)."""
    s.settimeout(within)
    t0, data = time.monotonic(), b""
    try:
        while chunk := s.recv(65536):
            data += chunk
    except socket.timeout:
        return None, data
    except ConnectionResetError:
        pass
    return time.monotonic() - t0, data


def status_of(response: bytes) -> int | None:
    m = re.match(rb"HTTP/1\.1 (\d{3}) ", response)
    return int(m.group(1)) if m else None


def exchange(srv: Server, request: bytes, within: float = 60) -> tuple[int | None, bytes]:
    """Send a whole request (it asks for Connection: close); (status, body)."""
    with srv.connect() as s:
        s.sendall(request)
        _, data = read_all(s, within)
    return status_of(data), data.partition(b"\r\n\r\n")[2]


def normal_request(srv: Server, extra: bytes = b"") -> tuple[int | None, bytes]:
    data = json.dumps(NORMAL).encode()
    return exchange(srv, post_head("/v1/completions", len(data), b"Connection: close\r\n" + extra) + data)


def still_serving(srv: Server) -> None:
    status, body = normal_request(srv)
    assert status == 200 and json.loads(body)["choices"][0]["finish_reason"], body[:500]
    assert httpx.get(srv.url + "/health", timeout=10).status_code == 200


def close_abruptly(s: socket.socket) -> None:
    """RST instead of FIN (SO_LINGER 0)."""
    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    s.close()


# --- 1. a client that drops its upload ------------------------------------------------------------------------------
DROPPED_UPLOADS = {
    "content-length-short": post_head("/v1/completions", 100) + b'{"prompt": ',
    "chunked-unfinished": post_head("/v1/completions", None) + b'6\r\n{"prom\r\n',
    "expect-100-then-nothing": post_head("/v1/completions", 30, b"Expect: 100-continue\r\n"),
}


@pytest.mark.parametrize("rst", [False, True], ids=["fin", "rst"])
@pytest.mark.parametrize("upload", DROPPED_UPLOADS.values(), ids=DROPPED_UPLOADS.keys())
def test_a_client_that_drops_its_upload_is_a_gone_client_not_a_500(server, upload, rst):
    """The client leaves while its body is read: counted as 499 (as every gone client), no 500, no log line
    (the log is checked for tracebacks at the end), nothing queued for the engine."""
    gone, failed, lines = server.requests_counted(499), server.requests_counted(500), server.log_lines()
    s = server.connect()
    s.sendall(upload)
    if b"Expect" in upload:
        s.settimeout(10)
        assert s.recv(100).startswith(b"HTTP/1.1 100 Continue")  # the app asked for the body: then nothing came
    time.sleep(0.3)  # the server is reading the body
    close_abruptly(s) if rst else s.close()
    end = time.monotonic() + 10
    while server.requests_counted(499) == gone and time.monotonic() < end:
        time.sleep(0.1)
    assert server.requests_counted(499) == gone + 1
    assert server.requests_counted(500) == failed
    new = server.log().splitlines()[lines:]
    assert not [ln for ln in new if "/v1/completions" in ln or "error" in ln.lower()], new
    assert server.metrics()["clover_queue_depth"] == 0
    still_serving(server)


# --- 2. abandoned requests leave the queue at once ------------------------------------------------------------------
def load(srv: Server) -> float:
    m = srv.metrics()
    return m["clover_running_rows"] + m["clover_queue_depth"]


@pytest.mark.parametrize("rst", [False, True], ids=["fin", "rst"])
def test_requests_abandoned_in_the_queue_free_it_before_the_next_admission(server, rst):
    """A full server (every row and queue place taken by endless requests) whose clients all leave: the very
    next request is admitted, no 503 and no retry needed."""
    capacity = MAX_BATCH + MAX_QUEUE
    clients = [post(server, ENDLESS) for _ in range(capacity)]
    end = time.monotonic() + 60
    while load(server) < capacity and time.monotonic() < end:
        time.sleep(0.1)
    assert load(server) == capacity
    status, body = normal_request(server)
    assert status == 503 and b"the queue is full" in body  # full indeed
    for s in clients:
        close_abruptly(s) if rst else s.close()
    t0 = time.monotonic()
    status, body = normal_request(server)
    assert status == 200, (status, body[:300], time.monotonic() - t0)
    end = time.monotonic() + 30
    while load(server) and time.monotonic() < end:  # and the engine has dropped them all
        time.sleep(0.1)
    assert load(server) == 0


# --- 3. slow and oversized request heads and bodies -----------------------------------------------------------------
def test_a_huge_unfinished_header_is_cut_off_without_memory(server):
    """10 connections each sending 32 MiB of one header line: each is closed (400) after the first 16 KiB
    (--max-header-bytes), and the server's memory does not grow by what they sent."""
    before = server.rss_mb()
    socks = [server.connect() for _ in range(10)]
    for s in socks:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: ")
    sent = [0] * len(socks)

    def flood(i):
        piece = b"a" * (1 << 20)
        try:
            for _ in range(32):
                socks[i].sendall(piece)
                sent[i] += len(piece)
        except OSError:  # the server closed it
            pass

    threads = [threading.Thread(target=flood, args=(i,)) for i in range(len(socks))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    grown = server.rss_mb() - before
    assert grown < 48, (grown, sent)  # 10 x 32 MiB were offered
    for s in socks:
        took, data = read_all(s, 10)
        assert took is not None, "still open"
        assert data == b"" or status_of(data) == 400, data[:200]
        s.close()
    still_serving(server)


def trickle(s: socket.socket, lines: list[bytes], every: float, until: float) -> None:
    """Send one line every `every` seconds until the server closes the connection or `until` passes."""
    for line in lines:
        if time.monotonic() > until:
            return
        try:
            s.sendall(line)
        except OSError:
            return
        time.sleep(every)


def closed_in_time(socks: list[socket.socket], started: float, deadline: float) -> list[tuple[float | None, bytes]]:
    """For each socket: (seconds from `started` until the server closed it, None if it was still open at
    `started + deadline`; what the server sent)."""
    out = []
    for s in socks:
        took, data = read_all(s, max(0.1, started + deadline - time.monotonic()))
        out.append((None if took is None else time.monotonic() - started, data))
    return out


def test_slow_and_silent_request_heads_are_closed_at_the_header_timeout(server):
    """20 connections trickling header lines (slowloris) and 20 that never send a byte: all closed within
    --header-timeout; the trickling ones get a 408 and one log line each, the silent ones no line."""
    lines = server.log_lines()
    t0 = time.monotonic()
    silent = [server.connect() for _ in range(20)]
    slow = [server.connect() for _ in range(20)]
    header_lines = [b"POST /v1/completions HTTP/1.1\r\n"] + [b"X-Pad-%d: v\r\n" % i for i in range(1000)]
    threads = [threading.Thread(target=trickle, args=(s, header_lines, 0.2, t0 + 30), daemon=True) for s in slow]
    for t in threads:
        t.start()
    results = closed_in_time(silent + slow, t0, TIMEOUT_S + SLACK_S)
    for took, data in results[:20]:
        assert took is not None and data == b"", (took, data[:100])
    for took, data in results[20:]:
        assert took is not None and status_of(data) == 408, (took, data[:100])
    for s in silent + slow:
        s.close()
    new = server.log().splitlines()[lines:]
    assert len([ln for ln in new if "no complete request head" in ln]) == 20 and len(new) <= 20 + 5, new
    still_serving(server)


def test_an_unfinished_body_is_answered_408_and_closed_at_the_body_timeout(server):
    """20 chunked bodies that stop after their first chunk: each gets a 408 and its connection closes within
    --body-timeout; counted as 408, not 500; one log line each."""
    timed_out, failed, lines = server.requests_counted(408), server.requests_counted(500), server.log_lines()
    t0 = time.monotonic()
    socks = [server.connect() for _ in range(20)]
    for s in socks:
        s.sendall(post_head("/v1/completions", None) + b'6\r\n{"prom\r\n')
    for took, data in closed_in_time(socks, t0, TIMEOUT_S + SLACK_S):
        assert took is not None and status_of(data) == 408, (took, data[:200])
        assert b"the request body paused" in data
    for s in socks:
        s.close()
    end = time.monotonic() + 5
    while server.requests_counted(408) < timed_out + 20 and time.monotonic() < end:
        time.sleep(0.1)
    assert server.requests_counted(408) == timed_out + 20 and server.requests_counted(500) == failed
    new = server.log().splitlines()[lines:]
    assert len([ln for ln in new if "the request body paused" in ln]) == 20 and len(new) <= 20 + 5, new
    still_serving(server)


def test_a_body_still_trickling_after_the_answer_is_closed(server):
    """A refused request (415: not JSON, answered before its body is read) whose client goes on sending its
    announced 10 MB body a few bytes at a time: the connection closes --body-timeout after the answer."""
    s = server.connect()
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: text/plain\r\n" + AUTH
              + b"Content-Length: 10000000\r\n\r\nabc")
    s.settimeout(10)
    assert status_of(s.recv(4096)) == 415
    t0 = time.monotonic()
    threading.Thread(target=trickle, args=(s, [b"x"] * 1000, 0.2, t0 + 30), daemon=True).start()
    took, _ = closed_in_time([s], t0, TIMEOUT_S + SLACK_S)[0]
    s.close()
    assert took is not None
    still_serving(server)


def test_too_many_header_fields_are_refused(server):
    padding = b"".join(b"X-Pad-%d: v\r\n" % i for i in range(MAX_HEADERS))
    status, body = normal_request(server, padding)
    assert status == 431 and json.loads(body)["error"]["code"] == "request_header_fields_too_large"
    # at the limit it passes: Host, Content-Type, Authorization, Content-Length, Connection + the padding
    status, body = normal_request(server, padding[: padding.index(b"X-Pad-%d:" % (MAX_HEADERS - 5))])
    assert status == 200, body[:300]
    still_serving(server)


def test_connections_past_the_cap_get_503_and_are_closed(server):
    """--max-connections open (idle) connections: the next one gets 503 with Retry-After and is closed at
    once; one log line for the whole burst; once they close, requests are answered again."""
    lines = server.log_lines()
    held = [server.connect() for _ in range(MAX_CONNECTIONS)]
    extra = [server.connect() for _ in range(5)]
    for s in extra:
        took, data = read_all(s, TIMEOUT_S)  # before the held ones reach --header-timeout
        assert took is not None and status_of(data) == 503 and b"retry-after: 1" in data.lower(), data[:200]
        s.close()
    for s in held:
        s.close()
    end, status = time.monotonic() + 5, None
    while status != 200 and time.monotonic() < end:  # the server sees the closes (a client honouring Retry-After)
        status, _ = normal_request(server)
        time.sleep(0.2)
    assert status == 200
    new = server.log().splitlines()[lines:]
    assert len([ln for ln in new if "refusing connections" in ln]) == 1, new


# --- 7. the API key: one header, one strict form --------------------------------------------------------------------
GOOD = f"Bearer {KEY}".encode()
AUTHORIZATIONS = {
    "one": ([b"Authorization: " + GOOD], 200),
    "scheme-any-case": ([b"Authorization: bEARER " + KEY.encode()], 200),
    "two-good-then-bad": ([b"Authorization: " + GOOD, b"Authorization: Bearer wrong"], 401),
    "two-bad-then-good": ([b"Authorization: Bearer wrong", b"Authorization: " + GOOD], 401),
    "two-good": ([b"Authorization: " + GOOD, b"Authorization: " + GOOD], 401),
    "two-x-api-key": ([b"Authorization: " + GOOD, b"x-api-key: " + KEY.encode(), b"X-Api-Key: other"], 401),
    "two-spaces": ([b"Authorization: Bearer  " + KEY.encode()], 401),
    "tab": ([b"Authorization: Bearer\t" + KEY.encode()], 401),
    "no-space": ([b"Authorization: Bearer" + KEY.encode()], 401),
    "key-with-a-space-inside": ([b"Authorization: Bearer " + KEY[:4].encode() + b" " + KEY[4:].encode()], 401),
}


@pytest.mark.parametrize("headers,status", AUTHORIZATIONS.values(), ids=AUTHORIZATIONS.keys())
def test_authorization_is_one_header_in_one_form(server, headers, status):
    data = json.dumps(NORMAL).encode()
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nConnection: close\r\n"
            + b"Content-Length: %d\r\n" % len(data) + b"".join(h + b"\r\n" for h in headers) + b"\r\n")
    got, body = exchange(server, head + data)
    assert got == status, body[:300]
    if status == 401:
        err = json.loads(body)["error"]
        assert err["code"] == "invalid_api_key"
        if len(headers) > 1:
            assert "more than one Authorization" in err["message"]
