"""The FastAPI app: OpenAI endpoints, /health, /metrics (SERVING.md 1-3).

`build_app(options)` is what uvicorn (`clover-export serve`) and Ray Serve
(`ray_app.py`) both run. The engine and the metrics are created at startup
(the lifespan), so each process or Ray replica owns its own engine.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect

from clover_export.core.errors import CloverError
from clover_export.core.step_shape import MAX_BATCH
from clover_export.runtime.config import RuntimeConfig
from clover_export.serve import adapter, doors, protocol, tool_calls
from clover_export.serve.choices import Choices
from clover_export.serve.connections import ConnectionLimits, body_timed_out
from clover_export.serve.doors.common import Call, Outcome, Pieces, matched_stop, renamed, sse
from clover_export.serve.engine import ENGINES, Engine, Event, Full, Job
from clover_export.serve.metrics import CONTENT_TYPE_LATEST, Metrics
from clover_export.serve.protocol import ApiError, ChatRequest, CompletionRequest

log = logging.getLogger("clover_export.serve")
# bodies larger than this are checked one at a time (their own thread limiter), so that small requests never
# wait behind them (docs/serving.md, Input limits)
LARGE_BODY_BYTES = 256 << 10


class ClientGone(Exception):
    """The client disconnected; its request was cancelled."""


@dataclass
class ServeOptions:
    """Everything one server process needs; plain data, so Ray can ship it to replicas."""

    model: str | None = None
    runtime: RuntimeConfig = field(default_factory=lambda: RuntimeConfig(max_slots=MAX_BATCH))  # slots: the batch
    max_queue: int = 64  # requests waiting for a row before 503
    served_model_name: str | None = None
    max_body_bytes: int = 4 << 20
    request_timeout_s: float = 600.0
    wait_until_loaded: bool = False  # startup waits for the engine (Ray replicas); else /health says 503 meanwhile
    api_key: str | None = None  # Bearer key required on /v1/* (SERVING.md 5)
    protect_metrics: bool = False  # /metrics needs the key too
    allowed_origins: tuple[str, ...] = ()  # CORS: browser origins allowed to call the API ("*": any)
    connections: ConnectionLimits = ConnectionLimits()  # request heads, slow clients, open connections
    tool_call_parser: str | None = None  # a tool_calls.PARSERS name; None or "auto": from the chat template
    # where the engine runs: "thread" (a thread of this process) or "process" (its own process, so that the HTTP
    # side does not share its GIL: serve/engine_process.py); `clover-export serve` takes "process"
    engine: str = "thread"

    def __post_init__(self):
        if self.engine not in ENGINES:
            raise CloverError("serve", f"engine must be one of {', '.join(ENGINES)}, got {self.engine!r}")

    @property
    def max_batch(self) -> int:
        """Rows in the continuous batch: the runtime's slots."""
        return self.runtime.max_slots

    @property
    def model_id(self) -> str:
        if self.served_model_name:
            return self.served_model_name
        return "clover-tiny" if self.model in (None, "tiny") else Path(self.model).resolve().name

    def load_generator(self):
        from clover_export.runtime import Generator

        return Generator.load(self.model, config=self.runtime)


def build_app(options: ServeOptions) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        state = app.state
        state.metrics = Metrics(options.model_id)
        state.large_bodies = anyio.CapacityLimiter(1)
        pending = options.max_batch + options.max_queue
        if options.engine == "process":
            from clover_export.serve.engine_process import ProcessEngine

            state.engine = ProcessEngine(options, pending, state.metrics)
        else:
            state.engine = Engine(options.load_generator, pending, state.metrics)
        state.engine.start()
        if options.wait_until_loaded:
            await asyncio.to_thread(state.engine.wait_ready, 3600)
            if state.engine.load_error:
                raise RuntimeError(f"the engine failed to load: {state.engine.load_error}")
        yield
        await asyncio.to_thread(state.engine.stop)

    app = FastAPI(title="clover-export", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.options = options
    _routes(app)
    _error_handlers(app)
    if options.api_key:
        app.add_middleware(ApiKeyGuard, key=options.api_key, protect_metrics=options.protect_metrics)
    # around the rest, so preflights and 401s carry CORS headers; no origins: preflights get 400, no CORS headers
    app.add_middleware(CORSMiddleware, allow_origins=list(options.allowed_origins), allow_methods=["GET", "POST"],
                       allow_headers=["*"], max_age=600)
    app.add_middleware(HeaderGuard, max_headers=options.connections.max_headers)  # outermost
    return app


class HeaderGuard:
    """At most `max_headers` header fields in a request, else 431 and the connection closes (docs/serving.md,
    Input limits). Their bytes are bounded before the app sees them (connections.py)."""

    def __init__(self, app, max_headers: int):
        self.app, self.max_headers = app, max_headers

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and len(scope["headers"]) > self.max_headers:
            err = ApiError(431, f"the request has {len(scope['headers'])} header fields; at most {self.max_headers}",
                           code="request_header_fields_too_large")
            await JSONResponse(err.body(), 431, headers={"Connection": "close"})(scope, receive, send)
            return
        await self.app(scope, receive, send)


class ApiKeyGuard:
    """`Authorization: Bearer KEY` on /v1/*, /tokenize, /detokenize (and /metrics when protected), else a 401 in
    the error shape of the path's door (OpenAI's elsewhere).

    A plain ASGI middleware (streams pass through untouched). Exactly one
    credential header: `Authorization`, written `Bearer` (any case, RFC 7235),
    one space, the key; or, on a door that takes it (/v1/messages), `x-api-key`
    with the key. The key is compared in constant time. /health stays open for
    load balancers.
    """

    CREDENTIAL_HEADERS = (b"authorization", b"x-api-key")

    def __init__(self, app, key: str, protect_metrics: bool = False):
        self.app, self.key, self.protect_metrics = app, key.encode(), protect_metrics

    def protects(self, path: str) -> bool:
        return (path == "/v1" or path.startswith("/v1/") or path in doors.TOKENS.PATHS
                or (self.protect_metrics and path == "/metrics"))

    def refusal(self, headers: list[tuple[bytes, bytes]], path: str = "") -> str | None:
        """Why the request may not pass, or None."""
        given = [(k, v) for k, v in headers if k in self.CREDENTIAL_HEADERS]
        if len(given) > 1:
            return "more than one Authorization (or x-api-key) header: send exactly one 'Authorization: Bearer <key>'"
        if given and given[0][0] == b"x-api-key" and doors.takes_x_api_key(path):
            return None if hmac.compare_digest(given[0][1], self.key) else "incorrect API key provided"
        values = [v for k, v in given if k == b"authorization"]
        if not values and doors.takes_x_api_key(path):
            return "missing API key: send the header 'x-api-key: <key>' or 'Authorization: Bearer <key>'"
        if not values:
            return "missing API key: send the header 'Authorization: Bearer <key>'"
        scheme, _, token = values[0].partition(b" ")
        if scheme.lower() == b"bearer" and hmac.compare_digest(token, self.key):
            return None
        return "incorrect API key provided"

    async def __call__(self, scope, receive, send):
        protected = scope["type"] == "http" and self.protects(scope["path"])
        why = self.refusal(scope["headers"], scope["path"]) if protected else None
        if why:
            err = ApiError(401, why, code="invalid_api_key")
            body = doors.error_body(scope["path"], err)
            await JSONResponse(body, 401, headers={"WWW-Authenticate": "Bearer"})(scope, receive, send)
            return
        await self.app(scope, receive, send)


def _routes(app: FastAPI) -> None:
    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await _generate(request, *await _admission(request, chat=True))

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await _generate(request, *await _admission(request, chat=False))

    @app.get("/v1/models")
    async def models(request: Request):
        return {"object": "list", "data": [_model_card(request)]}

    @app.get("/v1/models/{model_id:path}")
    async def model(request: Request, model_id: str):
        _check_model(request, model_id)
        return _model_card(request)

    @app.get("/health")
    async def health(request: Request):
        eng = request.app.state.engine
        if eng.load_error or eng.died:  # the process exits non-zero (cli/serve.py)
            return JSONResponse({"status": "failed", "error": eng.load_error or eng.died}, 503)
        if eng.draining:
            return JSONResponse({"status": "draining"}, 503, headers={"Retry-After": "1"})
        if not eng.ready:
            return JSONResponse({"status": "loading"}, 503, headers={"Retry-After": "5"})
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics(request: Request):
        m, eng = request.app.state.metrics, request.app.state.engine
        running, waiting = eng.load_figures()
        m.load(running, waiting)
        m.cache(eng.cache_figures())
        m.heap(eng.heap_figures())
        return Response(m.render(), media_type=CONTENT_TYPE_LATEST)

    _door_routes(app)


def _error_handlers(app: FastAPI) -> None:
    def reply(request: Request, e: ApiError) -> JSONResponse:
        if request.url.path.startswith("/v1/") and request.method == "POST":
            request.app.state.metrics.requests.labels(_endpoint(request), str(e.status)).inc()
        return JSONResponse(doors.error_body(request.url.path, e), e.status, headers=e.headers)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, e: ApiError):
        return reply(request, e)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException):
        code = "not_found" if e.status_code == 404 else None
        return reply(request, ApiError(e.status_code, f"{request.method} {request.url.path}: {e.detail}", code=code))

    @app.exception_handler(ClientDisconnect)
    async def client_gone(request: Request, e: ClientDisconnect):
        """The client left while its body was read (or stalled, answered 408 by connections.py): no server
        error, nothing reaches the engine; counted like every gone client. Nobody reads the answer."""
        status = 408 if body_timed_out(request.scope) else 499
        if request.url.path.startswith("/v1/") and request.method == "POST":
            request.app.state.metrics.finished(_endpoint(request), status)
        return Response(status_code=status)

    @app.exception_handler(Exception)
    async def bug(request: Request, e: Exception):
        log.exception("unexpected error")
        return reply(request, ApiError(500, f"internal error: {type(e).__name__}: {e}"))


# --- one generation request ------------------------------------------------------
async def _body_bytes(request: Request) -> bytes:
    """The body, once its Content-Type says JSON and while it stays under the limit (415, 413)."""
    protocol.check_content_type(request.headers.get("content-type"))
    limit = request.app.state.options.max_body_bytes
    if int(request.headers.get("content-length") or 0) > limit:
        raise ApiError(413, f"request body over the limit of {limit} bytes", code="request_too_large")
    body = bytearray()
    async for part in request.stream():
        body += part
        if len(body) > limit:
            raise ApiError(413, f"request body over the limit of {limit} bytes", code="request_too_large")
    return bytes(body)


async def _admission(request: Request, chat: bool) -> tuple[adapter.Submission, dict[str, Any]]:
    """Everything the request brings, checked in a worker thread before the engine sees it (SERVING.md 5):
    (its submission, the engine's `Generator.submit` kwargs with the prompt as token ids). A body over
    LARGE_BODY_BYTES waits for the large-body limiter; the others take the default thread pool."""
    body = await _body_bytes(request)
    limiter = request.app.state.large_bodies if len(body) > LARGE_BODY_BYTES else None
    return await anyio.to_thread.run_sync(_check_request, request, body, chat, limiter=limiter)


def _check_request(request: Request, body: bytes, chat: bool) -> tuple[adapter.Submission, dict[str, Any]]:
    gen = _ready_generator(request)
    data = protocol.parse_json(body, gen.max_context)
    try:
        req = (ChatRequest if chat else CompletionRequest).model_validate(data)
    except ValidationError as e:
        raise protocol.validation_error(e, data) from None
    _check_model(request, req.model)
    if chat:
        parser = tool_calls.parser_for(gen.tokenizer.template_source, request.app.state.options.tool_call_parser)
        sub = adapter.chat_submission(req, gen.defaults.enable_thinking, parser)
    else:
        sub = adapter.completion_submission(req)
    return sub, adapter.prepare(gen, sub)


def _ready_generator(request: Request):
    """The engine's Generator, once it is loaded (else a 503: nothing to check a request against yet)."""
    eng = request.app.state.engine
    if not eng.ready or eng.gen is None:
        raise ApiError(503, "the engine failed to load" if eng.load_error else "the engine is loading; retry later",
                       code="server_busy", headers={"Retry-After": "5"})
    return eng.gen


def _check_model(request: Request, model: str | None) -> None:
    model_id = request.app.state.options.model_id
    if model is not None and model != model_id:
        raise ApiError(404, f"the model {protocol.show(model)} does not exist; this server serves '{model_id}'",
                       param="model", code="model_not_found")


def _endpoint(request: Request) -> str:
    """The metrics label of a request: its route's template, or "unmatched" (a bounded set, whatever the paths)."""
    route = request.scope.get("route")
    return getattr(route, "path", None) or "unmatched"


def _model_card(request: Request) -> dict[str, Any]:
    eng, opts = request.app.state.engine, request.app.state.options
    context = eng.gen.max_context if eng.gen is not None else None
    return {"id": opts.model_id, "object": "model", "created": 0, "owned_by": "clover-export", "max_model_len": context}


def _unavailable(e: Full) -> ApiError:
    """The engine cannot take or finish the request now (busy, loading, shutting down, stopped)."""
    return ApiError(503, f"{e}", code=e.code, headers={"Retry-After": "1"})


def _failure(e: Exception, chat: bool) -> ApiError:
    if isinstance(e, ApiError):
        return e
    if isinstance(e, Full):
        return _unavailable(e)
    if isinstance(e, CloverError):
        return adapter.api_error(e, chat)
    return ApiError(500, f"the request failed in the engine: {e}", code="engine_error")


async def _next_event(job: Job, request: Request, deadline: float):
    """The job's next engine event; cancels the job when time is up or, through `_watch_client`, the
    moment the client leaves, so that its row leaves the batch at the next step (SERVING.md 3)."""
    eng = request.app.state.engine
    if job.watcher is None:
        job.watcher = asyncio.create_task(_watch_client(request, job, eng))
    try:
        ev = await asyncio.wait_for(job.events.get(), max(0.0, deadline - time.monotonic()))
    except asyncio.TimeoutError:
        eng.cancel(job)
        job.watcher.cancel()
        raise ApiError(408, "the request took longer than the server's request timeout", code="timeout") from None
    if ev.kind in ("done", "error", "gone"):
        job.watcher.cancel()
    if ev.kind == "gone":
        raise ClientGone()
    return ev


async def _watch_client(request: Request, job: Job, eng: Engine) -> None:
    """Until the client disconnects (the server also says so once the response is complete); a job
    still running then is cancelled, and its handler told."""
    try:
        while (await request.receive())["type"] != "http.disconnect":
            pass
    except Exception:  # noqa: BLE001 - a broken connection is a client gone
        pass
    if not job.released:
        eng.cancel(job)
        job.events.put_nowait(Event("gone"))


async def _generate(request: Request, sub: adapter.Submission, kwargs: dict[str, Any]):
    state, path = request.app.state, _endpoint(request)
    group = Choices(state.engine, kwargs, sub.n, ("chatcmpl-" if sub.chat else "cmpl-") + sub.id)
    try:
        group.start()
    except Full as e:
        raise _unavailable(e) from None
    deadline = time.monotonic() + state.options.request_timeout_s
    try:
        _, first = await _next_choice(group, request, deadline)
        if first.kind == "error":
            raise _failure(first.value, sub.chat)
        if sub.stream:
            return StreamingResponse(_sse(group, sub, request, deadline), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        results: list = [None] * sub.n
        while group.open:
            i, ev = await _next_choice(group, request, deadline)
            if ev.kind == "error":
                raise _failure(ev.value, sub.chat)
            if ev.kind == "done":
                results[i] = ev.value
        state.metrics.finished(path, 200, group.jobs[0], results[0], sub.decoding)
        return adapter.response(sub, state.options.model_id, results)
    except ClientGone:
        state.metrics.finished(path, 499)
        return Response(status_code=499)  # nobody reads it
    finally:
        if group.open and not sub.stream:  # failed: the choices still running leave (a stream's own: `_sse`)
            group.close()


async def _next_choice(group: Choices, request: Request, deadline: float):
    """The next (choice, event) of the request's choices (`choices.Choices.next`); a 503 when the engine cannot
    take the other choices."""
    timeout = ApiError(408, "the request took longer than the server's request timeout", code="timeout")
    try:
        return await group.next(request, deadline, ClientGone, timeout)
    except Full as e:
        group.close()
        raise _unavailable(e) from None


def _data(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


@dataclass
class _Streamed:
    """One choice's stream: its reply's deltas, its logprobs' text offsets, whether its first chunk went."""

    reply: adapter.Reply
    logprobs: adapter.CompletionLogprobs
    first: bool = True


async def _sse(group: Choices, sub: adapter.Submission, request: Request, deadline: float):
    """One `data:` chunk per committed block of each choice (and one per tool-call delta it completes), each
    choice's finishing chunk, usage if asked, `[DONE]` (SERVING.md 1; docs/serving.md, Tool calls, Choices)."""
    state, model = request.app.state, request.app.state.options.model_id
    streams = [_Streamed(adapter.Reply(sub), adapter.CompletionLogprobs(sub)) for _ in range(sub.n)]
    results: list = [None] * sub.n
    ended = False
    try:
        while group.open:
            try:
                i, ev = await _next_choice(group, request, deadline)
            except ApiError as e:  # timeout: the stream has begun, so the error goes in the stream
                i, ev = 0, Event("error", e)
            except ClientGone:
                return
            if ev.kind == "block":
                for body in _block_chunks(sub, model, streams[i], i, ev.value):
                    yield _data(body)
            elif ev.kind == "done":
                results[i] = ev.value
                for body in _final_chunks(sub, model, streams[i], i, ev.value):
                    yield _data(body)
            elif ev.kind == "error":
                err = _failure(ev.value, sub.chat)
                yield _data(err.body())
                yield "data: [DONE]\n\n"
                state.metrics.finished(_endpoint(request), err.status)
                ended = True
                return
        if sub.include_usage:
            yield _data(adapter.chunk(sub, model, res=results))
        yield "data: [DONE]\n\n"
        state.metrics.finished(_endpoint(request), 200, group.jobs[0], results[0], sub.decoding)
        ended = True
    finally:
        group.close()  # client gone: the rows still running leave the batch at the next step
        if not ended:
            state.metrics.finished(_endpoint(request), 499)


def _block_chunks(sub: adapter.Submission, model: str, st: _Streamed, index: int, block) -> list[dict[str, Any]]:
    """A block's chunks for choice `index`; the first carries the block's tokens' logprobs."""
    out = _echo_chunk(sub, model, st, index, block)
    lps = _chunk_logprobs(sub, st, block)
    for reasoning, content, call in st.reply.push(block.text, block.finished):
        out.append(adapter.chunk(sub, model, reasoning, content, at=adapter.At(index, st.first, lps), tool_call=call))
        st.first, lps = False, None
    return out


def _final_chunks(sub: adapter.Submission, model: str, st: _Streamed, index: int, res) -> list[dict[str, Any]]:
    """What the finished choice still holds back, then its finishing chunk."""
    *deltas, (reasoning, content, call) = st.reply.push("", True)
    out = _echo_chunk(sub, model, st, index, res)
    for r, c, t in deltas:
        out.append(adapter.chunk(sub, model, r, c, at=adapter.At(index, st.first), tool_call=t))
        st.first = False
    finish = st.reply.finish_reason(res.finish_reason)
    out.append(adapter.chunk(sub, model, reasoning, content, finish=finish, at=adapter.At(index, st.first),
                             tool_call=call))
    return out


def _echo_chunk(sub: adapter.Submission, model: str, st: _Streamed, index: int, event) -> list[dict]:
    """Completions with `echo`: before the choice's first chunk, one with the prompt's text (and its tokens'
    logprobs when asked: the first block's `StreamChunk`, or the `Result`, carries them)."""
    if not (sub.echo and st.first):
        return []
    lps = st.logprobs.of([], sub.echo_ids, event.prompt_logprobs) if sub.logprobs is not None else None
    st.first = False
    return [adapter.chunk(sub, model, content=sub.echo_text, at=adapter.At(index, True, lps))]


def _chunk_logprobs(sub: adapter.Submission, st: _Streamed, block) -> dict[str, Any] | None:
    """The block's tokens' logprobs in the choice's shape (None unless asked)."""
    if sub.logprobs is None:
        return None
    return adapter.chat_logprobs(sub, block.logprobs) if sub.chat else st.logprobs.of(block.logprobs)


# --- other front doors (clover_export/serve/doors): one loop for every door's Call -----------------------------------
def _door_routes(app: FastAPI) -> None:
    for door in doors.GENERATION:
        app.add_api_route(door.PATH, _door_endpoint(door), methods=["POST"])
    app.add_api_route(doors.messages.COUNT_PATH, _count_endpoint(doors.messages.admit_count), methods=["POST"])
    for path, (model, handler) in doors.TOKENS.HANDLERS.items():
        app.add_api_route(path, _tokens_endpoint(model, handler), methods=["POST"])


def _door_endpoint(door):
    async def endpoint(request: Request):
        body = await _body_bytes(request)
        limiter = request.app.state.large_bodies if len(body) > LARGE_BODY_BYTES else None
        call, kwargs = await anyio.to_thread.run_sync(_check_door, request, body, door.admit, limiter=limiter)
        return await _door(request, door, call, kwargs)
    return endpoint


def _count_endpoint(admit):
    """A door's token count: its request checked as for generation, the prompt's ids counted, nothing run."""
    async def endpoint(request: Request):
        body = await _body_bytes(request)
        limiter = request.app.state.large_bodies if len(body) > LARGE_BODY_BYTES else None
        _, kwargs = await anyio.to_thread.run_sync(_check_door, request, body, admit, limiter=limiter)
        return {"input_tokens": len(kwargs["prompt_ids"])}
    return endpoint


def _check_door(request: Request, body: bytes, admit) -> tuple[Call, dict[str, Any]]:
    """A door's request (`admit`: its door's) checked as `_check_request` checks OpenAI's: (its Call, the
    engine's submit kwargs)."""
    gen = _ready_generator(request)
    data = protocol.parse_json(body, gen.max_context)
    parser = tool_calls.parser_for(gen.tokenizer.template_source, request.app.state.options.tool_call_parser)
    try:
        call = admit(data, gen.defaults.enable_thinking, parser)
    except ValidationError as e:
        raise protocol.validation_error(e, data) from None
    _check_model(request, call.model)
    call.model = request.app.state.options.model_id  # the answer names the served model, asked for or not
    try:
        return call, adapter.prepare(gen, call.sub)
    except ApiError as e:
        raise renamed(e, call.renames) from None


def _tokens_endpoint(model, handler):
    async def endpoint(request: Request):
        body = await _body_bytes(request)
        limiter = request.app.state.large_bodies if len(body) > LARGE_BODY_BYTES else None
        return await anyio.to_thread.run_sync(_tokens, request, body, (model, handler), limiter=limiter)
    return endpoint


def _tokens(request: Request, body: bytes, door: tuple) -> dict[str, Any]:
    model, handler = door
    gen = _ready_generator(request)
    data = protocol.parse_json(body, gen.max_context)
    try:
        req = model.model_validate(data)
    except ValidationError as e:
        raise protocol.validation_error(e, data) from None
    _check_model(request, req.model)
    return handler(req, gen)


async def _door(request: Request, door, call: Call, kwargs: dict[str, Any]):
    """`_generate` for a door: the engine's events as output pieces, folded by the door's Writer."""
    state, sub = request.app.state, call.sub
    job = Job(kwargs, asyncio.get_running_loop(), name=f"{door.__name__.rsplit('.', 1)[-1]}-{sub.id}")
    try:
        state.engine.submit(job)
    except Full as e:
        raise _unavailable(e) from None
    deadline = time.monotonic() + state.options.request_timeout_s
    try:
        first = await _next_event(job, request, deadline)
        if first.kind == "error":
            raise renamed(_failure(first.value, True), call.renames)
        writer, pieces = door.Writer(call), Pieces(sub)
        if sub.stream:
            events = _door_events(request, job, (writer, pieces, call), first.value, deadline)
            return StreamingResponse(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        while True:
            ev = await _next_event(job, request, deadline)
            if ev.kind == "error":
                raise renamed(_failure(ev.value, True), call.renames)
            for piece in _pieces_of(pieces, ev):
                writer.feed(piece)
            if ev.kind == "done":
                state.metrics.finished(_endpoint(request), 200, job, ev.value, sub.decoding)
                return writer.body(_outcome(request, job, sub, ev.value))
    except ClientGone:
        state.metrics.finished(_endpoint(request), 499)
        return Response(status_code=499)  # nobody reads it


def _pieces_of(pieces: Pieces, ev: Event) -> list:
    """The output pieces an engine event adds: a block's, or at "done" the text held back until the end."""
    return pieces.push(ev.value.text, ev.value.finished) if ev.kind == "block" else pieces.push("", True)


def _outcome(request: Request, job: Job, sub: adapter.Submission, res) -> Outcome:
    """What the doors report beyond the Result: the stop string that ended it, the reasoning's token count."""
    tokenizer, stop = request.app.state.engine.gen.tokenizer, None
    if res.finish_reason == "stop_string":
        full = tokenizer.decode(getattr(job.handle.request, "response", res.token_ids))
        stop = matched_stop(sub.params.get("stop", []), res.text, full)
    reasoning = 0
    if sub.thinking:
        ids, end = res.token_ids, tokenizer.think_end_id
        reasoning = ids.index(end) + 1 if end in ids else len(ids)
    return Outcome(res, stop, reasoning)


async def _door_events(request: Request, job: Job, fold: tuple, prompt_tokens: int, deadline: float):
    """The door's stream: its opening events, one batch of events per committed block, its closing events; a
    failure after the start is the door's error event (SERVING.md 1)."""
    state, (writer, pieces, call) = request.app.state, fold
    ended = False
    try:
        for name, data in writer.start(prompt_tokens):
            yield sse(name, data)
        while True:
            try:
                ev = await _next_event(job, request, deadline)
            except ApiError as e:  # timeout: the stream has begun, so the error goes in the stream
                ev = Event("error", e)
            except ClientGone:
                return
            if ev.kind == "error":
                err = renamed(_failure(ev.value, True), call.renames)
                for name, data in writer.error(err):
                    yield sse(name, data)
                state.metrics.finished(_endpoint(request), err.status)
                ended = True
                return
            for piece in _pieces_of(pieces, ev):
                for name, data in writer.feed(piece):
                    yield sse(name, data)
            if ev.kind == "done":
                for name, data in writer.finish(_outcome(request, job, call.sub, ev.value)):
                    yield sse(name, data)
                state.metrics.finished(_endpoint(request), 200, job, ev.value, call.sub.decoding)
                ended = True
                return
    finally:
        if job.watcher is not None:
            job.watcher.cancel()
        if not ended:  # client gone: the row leaves the batch at the next step
            state.engine.cancel(job)
            state.metrics.finished(_endpoint(request), 499)
