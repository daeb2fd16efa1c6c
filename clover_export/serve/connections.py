"""The server's HTTP/1.1 connections: uvicorn's h11 protocol with deadlines and caps (docs/serving.md, Input limits).

`clover-export serve` always speaks HTTP/1.1 through h11 (pure Python, always installed with uvicorn), never
through whatever `http="auto"` finds (httptools buffers a header of any size and times nothing out). h11 bounds
the request head (`max_header_bytes`: 400 past it); this protocol adds what uvicorn lacks:

- `max_connections`: a connection past it is answered 503 (`Retry-After: 1`) and closed at once, so one machine
  cannot take every file descriptor.
- `header_timeout_s`: a request head must be complete this long after the connection opens (or after its first
  byte, on a reused connection); else 408 (or, when nothing came, a silent close) and the connection closes.
- `body_timeout_s`: a request body may pause at most this long between two reads; else 408 and the connection
  closes (the app sees a gone client; `body_timed_out` tells it why). Once the answer is out (a 401, a 413),
  the rest of an unfinished body gets this long in all, then the connection closes.

A connection closed for a deadline costs one log line at most. The request head's header count is the app's
check (`app.HeaderGuard`), since it is per request.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import STATUS_PHRASES, H11Protocol

from clover_export.serve.protocol import ApiError

log = logging.getLogger("clover_export.serve")
BODY_TIMED_OUT = "clover.body_timed_out"  # the scope key set on a request whose body stalled (answered 408)
REFUSAL_LOG_EVERY_S = 10.0  # refused connections: one log line per this many seconds at most


@dataclass(frozen=True)
class ConnectionLimits:
    """What one client may cost the server before it has sent a whole request (docs/serving.md, Input limits)."""

    max_header_bytes: int = 16 << 10  # request line + headers (h11's own default); past it 400
    max_headers: int = 100  # header fields of one request; past it 431 (checked by the app, app.HeaderGuard)
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    max_connections: int = 1024


def uvicorn_settings(limits: ConnectionLimits) -> dict[str, Any]:
    """The uvicorn.Config arguments that put `limits` in force: the guarded h11 protocol, no WebSocket upgrades."""
    protocol = type("GuardedProtocol", (GuardedH11Protocol,), {"limits": limits})
    return {"http": protocol, "ws": "none", "h11_max_incomplete_event_size": limits.max_header_bytes}


def body_timed_out(scope: dict[str, Any]) -> bool:
    return bool(scope.get(BODY_TIMED_OUT))


def _error_body(status: int, message: str) -> bytes:
    """OpenAI's error body, as the app's errors have it."""
    return json.dumps(ApiError(status, message).body()).encode()


def _headers(body: bytes, retry_after: bool = False) -> list[tuple[bytes, bytes]]:
    headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body)),
               (b"connection", b"close")]
    return headers + [(b"retry-after", b"1")] if retry_after else headers


def _raw_response(status: int, message: str, retry_after: bool = False) -> bytes:
    """A whole `Connection: close` response, for a connection h11 has no request on (it can send none there)."""
    body = _error_body(status, message)
    head = [b"HTTP/1.1 %d %s" % (status, STATUS_PHRASES[status])] + [k + b": " + v for k, v in
                                                                     _headers(body, retry_after)]
    return b"\r\n".join(head) + b"\r\n\r\n" + body


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol, plus the connection cap, the request-head deadline and the body-pause timeout."""

    limits: ConnectionLimits = ConnectionLimits()
    _last_refusal_log = 0.0  # class-wide: refusals are logged once per REFUSAL_LOG_EVERY_S

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.head_timer: asyncio.TimerHandle | None = None
        self.body_timer: asyncio.TimerHandle | None = None
        self.received_any = False

    # --- asyncio.Protocol ---------------------------------------------------------
    def connection_made(self, transport) -> None:  # type: ignore[override]
        if len(self.connections) >= self.limits.max_connections:
            self._refuse(transport)
            return
        super().connection_made(transport)
        self.head_timer = self.loop.call_later(self.limits.header_timeout_s, self._head_timed_out)

    def data_received(self, data: bytes) -> None:
        if self.flow is None:  # refused (max_connections): closing already
            return
        self.received_any = True
        if self.head_timer is None and self.conn.their_state is h11.IDLE:  # a new request on a reused connection
            self.head_timer = self.loop.call_later(self.limits.header_timeout_s, self._head_timed_out)
        super().data_received(data)
        self._follow_request()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_timers()
        super().connection_lost(exc)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self.conn.their_state is h11.SEND_BODY and self.cycle.response_complete:
            self._restart_body_timer()  # answered before its body was read: the rest gets one deadline in all
        else:
            self._follow_request()  # a pipelined request may have begun

    # --- the deadlines --------------------------------------------------------------
    def _follow_request(self) -> None:
        """After each read: the head is in (its deadline ends); a body still coming restarts its pause timer,
        until the answer is out (then the rest of the body gets one more pause at most)."""
        state = self.conn.their_state
        if state is not h11.IDLE and self.head_timer is not None:
            self.head_timer.cancel()
            self.head_timer = None
        if state is not h11.SEND_BODY:
            if self.body_timer is not None:
                self.body_timer.cancel()
                self.body_timer = None
        elif self.body_timer is None or not (self.cycle and self.cycle.response_complete):
            self._restart_body_timer()

    def _restart_body_timer(self) -> None:
        if self.body_timer is not None:
            self.body_timer.cancel()
        self.body_timer = self.loop.call_later(self.limits.body_timeout_s, self._body_timed_out)

    def _head_timed_out(self) -> None:
        self.head_timer = None
        if self.transport.is_closing():
            return
        if self.received_any:  # a head begun and never finished: say so; an idle connection just closes
            log.info("%s: closed: no complete request head within %g s", self._peer(), self.limits.header_timeout_s)
            message = f"the request head did not arrive within {self.limits.header_timeout_s:g} s"
            self.transport.write(_raw_response(408, message))
        self.transport.close()

    def _body_timed_out(self) -> None:
        self.body_timer = None
        if self.transport.is_closing() or self.conn.their_state is not h11.SEND_BODY:
            return
        if self.flow.read_paused:  # the app has not read what came: the pause is ours, not the client's
            self.body_timer = self.loop.call_later(self.limits.body_timeout_s, self._body_timed_out)
            return
        cycle = self.cycle
        log.info("%s: closed: the request body paused for %g s", self._peer(), self.limits.body_timeout_s)
        if cycle is not None and not cycle.response_started:
            cycle.scope[BODY_TIMED_OUT] = True  # type: ignore[literal-required]
            self._send_408(cycle)
        self.transport.close()

    def _send_408(self, cycle) -> None:
        """Answer in the app's place, which then sees a disconnect (its later sends go nowhere)."""
        body = _error_body(408, f"the request body paused for more than {self.limits.body_timeout_s:g} s")
        response = h11.Response(status_code=408, headers=_headers(body), reason=STATUS_PHRASES[408])
        for event in (response, h11.Data(data=body), h11.EndOfMessage()):
            self.transport.write(self.conn.send(event))
        cycle.response_started = cycle.response_complete = cycle.disconnected = True
        cycle.message_event.set()

    def _cancel_timers(self) -> None:
        for timer in (self.head_timer, self.body_timer):
            if timer is not None:
                timer.cancel()
        self.head_timer = self.body_timer = None

    def _refuse(self, transport) -> None:
        """Past max_connections: 503 and close, before the connection costs anything more."""
        self.transport = transport
        transport.write(_raw_response(503, "too many open connections; retry later", retry_after=True))
        transport.close()
        now = time.monotonic()
        if now - GuardedH11Protocol._last_refusal_log >= REFUSAL_LOG_EVERY_S:
            GuardedH11Protocol._last_refusal_log = now
            log.warning("refusing connections: %d open, the limit (--max-connections)", len(self.connections))

    def _peer(self) -> str:
        return "%s:%d" % self.client if self.client else "a client"
