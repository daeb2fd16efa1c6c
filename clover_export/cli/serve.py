"""`clover-export serve`: the OpenAI-compatible server (uvicorn), or Ray Serve replicas with --replicas."""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path

import click

from clover_export.cli.options import runtime_options
from clover_export.core.errors import CloverError
from clover_export.core.step_shape import MAX_BATCH
from clover_export.serve.engine import ENGINES, shutting_down


@click.command()
@click.argument("model", required=False)
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on (0.0.0.0: all).")
@click.option("--port", type=click.IntRange(0, 65535), default=8000, show_default=True)
@click.option("--max-batch", type=click.IntRange(min=1), default=MAX_BATCH, show_default=True,
              help="Requests decoding together in the continuous batch (runtime slots).")
@click.option("--max-queue", type=click.IntRange(min=0), default=64, show_default=True,
              help="Requests waiting for a slot; past it the server answers 503 with Retry-After.")
@click.option("--served-model-name", default=None,
              help="Model id of the API (`model` field, /v1/models). Default: the folder's name, or clover-tiny.")
@click.option("--replicas", type=click.IntRange(min=1), default=None,
              help="Run N engine replicas behind Ray Serve (needs the `ray` extra); one GPU each where GPUs exist.")
@click.option("--max-body-bytes", type=click.IntRange(min=1), default=4 << 20, show_default=True,
              help="Largest request body; larger ones get 413.")
@click.option("--api-key", envvar="CLOVER_API_KEY", show_envvar=True, default=None,
              help="Require 'Authorization: Bearer KEY' on /v1/* (401 otherwise). Prefer the environment "
                   "variable: a command line is visible to other users.")
@click.option(
    "--protect-metrics", is_flag=True, help="With --api-key: /metrics needs the key too (/health stays open)."
)
@click.option("--allowed-origins", default="",
              help="Comma-separated browser origins allowed to call the API (CORS), e.g. "
                   "https://app.example.com; '*' allows any. Default: none.")
@click.option("--max-header-bytes", type=click.IntRange(min=1024), default=16 << 10, show_default=True,
              help="Largest request head (request line and headers); larger ones get 400 and the connection closes.")
@click.option("--max-headers", type=click.IntRange(min=1), default=100, show_default=True,
              help="Most header fields in one request; more get 431.")
@click.option("--header-timeout", type=click.FloatRange(min=0, min_open=True), default=10.0, show_default=True,
              help="Seconds a connection has to send a whole request head (from its opening, or from the first "
                   "byte of a request on a reused connection); then it is closed.")
@click.option("--body-timeout", type=click.FloatRange(min=0, min_open=True), default=30.0, show_default=True,
              help="Seconds a request body may pause between two reads; then 408 and the connection closes.")
@click.option("--max-connections", type=click.IntRange(min=1), default=1024, show_default=True,
              help="Open client connections; past it a new connection gets 503 with Retry-After and is closed.")
@click.option("--request-timeout", type=click.FloatRange(min=0, min_open=True), default=600.0, show_default=True,
              help="Seconds before a request is cancelled.")
@click.option("--drain-timeout", type=click.FloatRange(min=0), default=30.0, show_default=True,
              help="On SIGTERM: seconds running requests get to finish (new ones get 503, the port stays open); "
                   "then they end with a 503 error.")
@runtime_options
@click.option("--prefix-cache/--no-prefix-cache", default=True, show_default=True,
              help="Resume requests from earlier requests' caches where their prompts start the same "
                   "(docs/prefix_cache.md); usage.prompt_tokens_details.cached_tokens says how many tokens.")
@click.option("--prefix-cache-gb", type=click.FloatRange(min=0), default=None,
              help="Memory for the prefix cache's GDN state snapshots, beyond the cache pools "
                   "[default: 4]; finished sequences also stay in idle slots until a request needs one.")
@click.option("--tool-call-parser", type=click.Choice(["auto", "qwen3_coder", "hermes"]), default="auto",
              show_default=True,
              help="How tool calls are read from the model's text: qwen3_coder (Qwen3.6's <function=...> XML), "
                   "hermes (JSON in <tool_call>), or auto: the format the chat template writes calls in.")
@click.option("--engine", "engine", type=click.Choice(ENGINES), default="process", show_default=True,
              help="Where the engine runs: its own process (the HTTP side does not slow its steps: they share no "
                   "GIL), or a thread of the server's process (one process). With --replicas, each replica's.")
@click.option("--log-level", type=click.Choice(["critical", "error", "warning", "info", "debug"]), default="info")
def serve(model, host, port, max_batch, max_queue, served_model_name, replicas, max_body_bytes,
          request_timeout, drain_timeout, runtime, log_level, api_key, protect_metrics,
          allowed_origins, prefix_cache, prefix_cache_gb, max_header_bytes, max_headers, header_timeout, body_timeout,
          max_connections, tool_call_parser, engine):
    """Serve MODEL over the OpenAI API: /v1/chat/completions, /v1/completions, /v1/models, /health, /metrics.

    MODEL is a model folder, an exported artifact (ort), an engine (trt), or
    left out for the embedded default. All requests decode in one continuous
    batch; SIGTERM (or Ctrl-C) stops admitting, lets running requests finish
    for --drain-timeout seconds, ends the rest with a 503, and exits 0. If the
    engine stops on a fault, /health turns 503 and the command exits 1 (let a
    supervisor restart it). Example:

        clover-export serve --port 8000 &
        curl localhost:8000/v1/chat/completions -H 'Content-Type: application/json' \\
          -d '{"messages": [{"role": "user", "content": "What is 2 + 3?"}], "max_tokens": 64}'
    """
    from clover_export.serve.app import ServeOptions
    from clover_export.serve.connections import ConnectionLimits

    if api_key is None:
        api_key = os.environ.get("CLOVER_API_KEY")  # click reads an empty variable as unset
    if api_key is not None and (not api_key or api_key != api_key.strip()):
        raise CloverError("serve", "the API key (--api-key or CLOVER_API_KEY) is empty or has surrounding whitespace",
                          "give the key itself, or unset CLOVER_API_KEY to serve without one")
    cache = prefix_cache_gb if prefix_cache and prefix_cache_gb is not None else prefix_cache
    runtime = dataclasses.replace(runtime, max_slots=max_batch, prefix_cache=cache)
    opts = ServeOptions(model=model, runtime=runtime, max_queue=max_queue, served_model_name=served_model_name,
                        api_key=api_key, protect_metrics=protect_metrics,
                        allowed_origins=tuple(o.strip() for o in allowed_origins.split(",") if o.strip()),
                        max_body_bytes=max_body_bytes, request_timeout_s=request_timeout,
                        tool_call_parser=tool_call_parser, engine=engine,
                        connections=ConnectionLimits(max_header_bytes=max_header_bytes, max_headers=max_headers,
                                                     header_timeout_s=header_timeout, body_timeout_s=body_timeout,
                                                     max_connections=max_connections))
    if model not in (None, "tiny") and not Path(model).exists():
        raise CloverError(
            "serve",
            f"{model}: no such file or folder",
            "pass a model folder, an exported artifact, an engine, or leave MODEL out for the embedded default",
        )
    _check_port(host, port)
    if runtime.backend == "triton":  # the device check needs no model: fail before the server starts
        from clover_export.backends.triton_backend import check_target

        check_target(runtime.device or ("cuda" if _cuda_available() else "cpu"), runtime.dtype)
    if replicas is not None:
        from clover_export.serve.ray_app import check_replicas, run_replicas

        check_replicas(opts)
        status = 0
        try:
            run_replicas(opts, replicas, host, port)
        except CloverError as e:  # Ray Serve gave up on the replicas; Ray is shut down
            click.echo(f"error: {e}", err=True)
            status = 1
        # Ray is shut down; its C++ threads can abort the interpreter's own teardown (SIGABRT, ray-project/ray
        # issue 37288), so the process ends here, streams flushed
        logging.shutdown()
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        os._exit(status)
    _run_uvicorn(opts, host, port, drain_timeout, log_level)


def _check_port(host: str, port: int) -> None:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            raise CloverError("serve", f"cannot listen on {host}:{port}: {e.strerror}",
                              "pick another --port, or stop the process using it") from None


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


ENDING_GRACE_S = 5.0  # after the drain: time for the last responses to be written before uvicorn cancels them


def _run_uvicorn(opts, host: str, port: int, drain_timeout: float, log_level: str) -> None:
    import uvicorn

    from clover_export.serve.app import build_app
    from clover_export.serve.connections import uvicorn_settings

    app = build_app(opts)

    class DrainingServer(uvicorn.Server):
        """SIGTERM/SIGINT drain the engine first (SERVING.md 5), the port still open; then uvicorn stops."""

        signals = 0

        def handle_exit(self, sig, frame):
            self.signals += 1
            engine = getattr(app.state, "engine", None)
            if engine is None or not engine.ready or engine.died or self.signals > 2:
                super().handle_exit(sig, frame)  # nothing to drain (or a third signal): uvicorn stops now
            elif self.signals == 1:
                threading.Thread(target=self.drain, args=(engine,), name="clover-drain", daemon=True).start()
            else:  # a second signal: skip the rest of the drain
                engine.abort(shutting_down())

        def drain(self, engine):
            engine.shut_down(drain_timeout, ENDING_GRACE_S)
            self.should_exit = True

    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=ENDING_GRACE_S,
                            server_header=False, **uvicorn_settings(opts.connections))
    _log_like_uvicorn(log_level)
    _allow_open_files(opts.connections.max_connections)
    # uvicorn re-raises the signal it caught once it has shut down; a no-op handler makes that exit 0
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    server = DrainingServer(config)
    threading.Thread(target=_exit_when_engine_fails, args=(app, server), daemon=True).start()
    server.run()
    engine = getattr(app.state, "engine", None)
    if engine is not None and engine.load_error:
        raise CloverError("serve", f"the model could not be loaded: {engine.load_error}")
    if engine is not None and engine.died:
        raise CloverError("serve", f"the engine stopped: {engine.died}",
                          "the server exits 1 so that a supervisor restarts it; the log holds the traceback")


FD_RESERVE = 256  # open files beside the client connections: the model's files, the log, the runtime's own


def _allow_open_files(max_connections: int) -> None:
    """Raise the soft open-file limit (`ulimit -n`) so that --max-connections connections fit, up to the hard
    limit; a warning when they cannot (accepting past the limit fails, and asyncio logs every failure)."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = max_connections + FD_RESERVE
    if soft == resource.RLIM_INFINITY or soft >= want:
        return
    allowed = want if hard == resource.RLIM_INFINITY else min(want, hard)
    resource.setrlimit(resource.RLIMIT_NOFILE, (allowed, hard))
    if allowed < want:
        logging.getLogger("clover_export.serve").warning(
            "--max-connections %d needs %d open files, the limit is %d (ulimit -n): lower --max-connections to %d",
            max_connections, want, allowed, max(1, allowed - FD_RESERVE))


def _log_like_uvicorn(log_level: str) -> None:
    """The server's own lines (drain, failed requests, an engine that stops) through uvicorn's handler and level."""
    serve_log = logging.getLogger("clover_export.serve")
    serve_log.handlers = list(logging.getLogger("uvicorn").handlers)
    serve_log.setLevel(log_level.upper())
    serve_log.propagate = False


def _exit_when_engine_fails(app, server) -> None:
    """A server whose engine cannot load, or stopped, is of no use: stop it (the command then exits 1 saying why)."""
    while getattr(app.state, "engine", None) is None:
        time.sleep(0.1)
    engine = app.state.engine
    engine.stopped.wait()
    if engine.load_error or engine.died:
        server.should_exit = True


COMMANDS = [serve]
