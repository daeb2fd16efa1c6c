"""The engine in its own process (serve/engine_process.py; docs/serving.md, The engine process): the same answers
as the in-process engine, its figures on /metrics, cancellation and admission decided in the HTTP process, and
an engine process that dies takes the server down with 503s, never leaving a request hanging; nor does it
outlive its server.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from test_serve import ThreadServer, check_error

from clover_export.core.errors import CloverError
from clover_export.runtime.config import RuntimeConfig
from clover_export.serve.app import ServeOptions, build_app
from clover_export.serve.engine_process import ProcessEngine
from clover_export.testing.server import engine_processes, gone, start_server, stop_server

MODEL_ID = "clover-tiny"
GOOD = [("The answer is", 12), ("What is 2 + 3?", 40), ("12*12=", 12)]
SCHEMA = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"], "additionalProperties": False}


@pytest.fixture(scope="module")
def server(tiny_dir):
    app = build_app(ServeOptions(runtime=RuntimeConfig(max_slots=4), max_queue=2, request_timeout_s=120,
                                 engine="process"))
    with ThreadServer(app) as srv:
        srv.wait_healthy()
        yield srv


@pytest.fixture(scope="module")
def reference(tiny_dir):
    """The in-process Generator's greedy answers, and a constrained chat's."""
    from clover_export.constraints import compile
    from clover_export.runtime import Generator

    gen = Generator.load(None, max_slots=1)
    out = {(p, n): gen.generate(p, raw=True, max_new_tokens=n).text for p, n in GOOD}
    spec = {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}
    grammar = compile(spec, gen.grammar_vocab())
    out["schema"] = gen.generate(messages=[{"role": "user", "content": "What is 2 + 3?"}], max_new_tokens=30,
                                 grammar=grammar, do_sample=False).text
    return out


def figures(url):
    out = {}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        for s in family.samples:
            out[s.name + json.dumps(s.labels, sort_keys=True) if s.labels else s.name] = s.value
    return out


def test_an_unknown_engine_is_refused_naming_the_choices():
    with pytest.raises(CloverError, match="engine must be one of process, thread, got 'fork'"):
        ServeOptions(engine="fork")


def test_the_engine_runs_in_another_process(server):
    eng = server.app.state.engine
    assert isinstance(eng, ProcessEngine) and eng._process.pid != os.getpid() and eng._process.poll() is None
    assert not hasattr(eng.gen, "loop")  # the HTTP side holds no model: a Frontend


def test_answers_equal_the_in_process_generator(server, reference):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    for (prompt, n) in GOOD:
        text = reference[(prompt, n)]
        r = client.completions.create(model=MODEL_ID, prompt=prompt, max_tokens=n, temperature=0)
        assert r.choices[0].text == text
        chunks = client.completions.create(model=MODEL_ID, prompt=prompt, max_tokens=n, temperature=0, stream=True)
        assert "".join(c.choices[0].text for c in chunks if c.choices) == text
    # a grammar crosses as its spec and is compiled again in the engine's process
    r = client.chat.completions.create(
        model=MODEL_ID, messages=[{"role": "user", "content": "What is 2 + 3?"}], max_tokens=30, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}})
    assert r.choices[0].message.content == reference["schema"]
    assert isinstance(json.loads(reference["schema"])["x"], int)


def test_stop_strings_logprobs_and_choices_cross_the_pipe(server, reference):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    text = reference[("What is 2 + 3?", 40)]
    stop = text[len(text) // 2:len(text) // 2 + 2]
    r = client.completions.create(model=MODEL_ID, prompt="What is 2 + 3?", max_tokens=40, temperature=0, stop=[stop],
                                  logprobs=2, n=2)
    for choice in r.choices:
        assert choice.finish_reason == "stop" and choice.text == text[:text.index(stop)]
        assert len(choice.logprobs.tokens) >= 1 and all(len(t) <= 2 for t in choice.logprobs.top_logprobs)


def test_a_door_reads_the_finished_request_s_record(server):
    """The Messages door names the stop sequence that ended the answer: it looks in the runtime's record of the
    response, which comes back with the result."""
    body = {"model": MODEL_ID, "max_tokens": 40, "temperature": 0,
            "messages": [{"role": "user", "content": "What is 2 + 3?"}]}
    full = httpx.post(server.url + "/v1/messages", json=body, timeout=60).json()
    text = "".join(part.get("text", "") for part in full["content"])
    stop = text[len(text) // 2:len(text) // 2 + 2]
    r = httpx.post(server.url + "/v1/messages", json={**body, "stop_sequences": [stop]}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["stop_reason"] == "stop_sequence" and r.json()["stop_sequence"] == stop


def test_metrics_carry_the_engine_process_figures_and_return_to_zero(server):
    before = figures(server.url)
    body = {"messages": [{"role": "user", "content": "Please sort the list 3 1 2 4 9"}], "max_tokens": 32,
            "temperature": 0, "decoding": "self_spec"}
    httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60).raise_for_status()
    end = time.monotonic() + 5
    while True:  # the load figures come with each pass's events; cache and heap every FIGURES_S
        after = figures(server.url)
        if after["clover_running_rows"] == 0 and after["clover_queue_depth"] == 0 or time.monotonic() > end:
            break
        time.sleep(0.1)
    assert after["clover_running_rows"] == 0 and after["clover_queue_depth"] == 0
    assert after["clover_step_seconds_count"] > before.get("clover_step_seconds_count", 0)
    assert after['clover_heap_bytes{"state": "in_use"}'] > 0  # the engine process's heap
    assert after["clover_prefix_cache_budget_bytes"] > 0
    drafts = 'vllm:spec_decode_num_draft_tokens_total{"model_name": "clover-tiny"}'
    assert after[drafts] > before.get(drafts, 0)  # the runtime's draft counters come back with the result


def test_a_full_queue_is_refused_here_and_a_cancelled_stream_frees_its_place(server):
    eng = server.app.state.engine
    body = {"prompt": "Please sort the list 3 1 2 4 9", "max_tokens": 1000, "stream": True, "threshold": 1.0,
            "ignore_eos": True}
    stop = threading.Event()

    def hold(started: threading.Event):
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=120) as r:
            it = r.iter_lines()
            next(it)
            started.set()
            stop.wait(60)  # then the client leaves mid-stream

    threads = []
    for _ in range(eng.max_pending):  # 4 rows + 2 queued
        started = threading.Event()
        t = threading.Thread(target=hold, args=(started,), daemon=True)
        t.start()
        threads.append((t, started))
    end = time.monotonic() + 60
    while len(eng._live) < eng.max_pending and time.monotonic() < end:
        time.sleep(0.05)
    check_error(httpx.post(server.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 4}), 503,
                code="server_busy")
    stop.set()
    for t, _ in threads:
        t.join(60)
    end = time.monotonic() + 5  # a cancelled row leaves at the next step; finishing would take 1000 steps
    while (eng._live or eng._jobs or figures(server.url)["clover_running_rows"]) and time.monotonic() < end:
        time.sleep(0.1)
    assert not eng._live and not eng._jobs  # every job got its final event back from the engine process
    assert figures(server.url)["clover_running_rows"] == 0
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 4}, timeout=60)
    assert r.status_code == 200


def test_a_killed_engine_process_ends_every_request_with_503_and_the_server_exits_1():
    proc, url = start_server("--log-level", "warning")
    try:
        (child,) = engine_processes(proc.pid)
        body = {"prompt": "Please sort the list 3 1 2 4 9", "max_tokens": 1000, "stream": True, "threshold": 1.0,
                "ignore_eos": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")
            os.kill(child, signal.SIGKILL)
            rest = [line for line in lines if line]
        assert rest[-1] == "data: [DONE]"
        assert json.loads(rest[-2][6:])["error"]["code"] == "engine_stopped"
        assert proc.wait(60) == 1
        log = proc.communicate()[0]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert "error: [serve] the engine stopped: the engine process exited (killed by SIGKILL)" in log


def test_the_engine_process_does_not_outlive_a_killed_server():
    proc, _ = start_server("--log-level", "warning")
    try:
        (child,) = engine_processes(proc.pid)
        proc.kill()
        proc.wait(30)
        assert gone(child, 30)  # its end of the pipe closed: it stops on its own
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate()


def has_torch(pid: int) -> bool:
    """Whether process `pid` has torch's library mapped (it does once anything imported torch)."""
    return "libtorch_cpu" in Path(f"/proc/{pid}/maps").read_text()


TOOL = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}
EVERY_DOOR = [  # (path, body; the model is added): what each door and feature does in the HTTP process
    ("/v1/completions", {"prompt": "The answer is", "max_tokens": 4, "logprobs": 2, "echo": True}),
    ("/v1/completions", {"prompt": "12*12=", "max_tokens": 4, "stream": True, "n": 2}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "What is 2 + 3?"}], "max_tokens": 30,
                              "response_format": {"type": "json_schema", "json_schema": {"name": "a",
                                                                                         "schema": SCHEMA}},
                              "logprobs": True, "top_logprobs": 2}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Add 2 and 3"}], "max_tokens": 40,
                              "tools": [TOOL], "tool_choice": "required"}),
    ("/v1/messages", {"max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}]}),
    ("/v1/messages/count_tokens", {"messages": [{"role": "user", "content": "Hi"}]}),
    ("/v1/responses", {"input": "Hi", "max_output_tokens": 4}),
    ("/tokenize", {"prompt": "Hi"}),
    ("/detokenize", {"tokens": [1, 2]}),
]


def test_the_http_process_imports_no_torch_through_any_door():
    """The HTTP process checks, tokenizes and compiles grammars without torch (runtime/frontend.py); the model
    and torch live in the engine process alone."""
    proc, url = start_server("--log-level", "warning")
    try:
        for path, body in EVERY_DOOR:
            r = httpx.post(url + path, json={"model": MODEL_ID, **body}, timeout=120)
            assert r.status_code == 200, (path, r.text[:300])
        for path in ("/v1/models", "/metrics", "/health"):
            assert httpx.get(url + path, timeout=30).status_code == 200
        (engine,) = engine_processes(proc.pid)
        assert has_torch(engine)  # the probe sees torch where it is
        assert not has_torch(proc.pid)
    finally:
        stop_server(proc)
