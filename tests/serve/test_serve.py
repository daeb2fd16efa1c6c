"""`clover-export serve` end to end: the official openai client against a real uvicorn server on 127.0.0.1 (SERVING.md).

One server (uvicorn in a thread, real sockets) for the module; answers are
checked against the Python API (`Generator`, one request at a time) in this
process. The subprocess/SIGTERM and Ray Serve cases are in test_serve_process.py.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import uvicorn
from hypothesis import example, given
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from clover_export.core.errors import CloverError
from clover_export.runtime.config import RuntimeConfig
from clover_export.serve.adapter import TextSplit, chars_per_token
from clover_export.serve.app import ServeOptions, build_app

MODEL_ID = "clover-tiny"
# about one token per step and no end token: stays in the batch for ~1000 steps unless cancelled
# threshold 1.0: one token a step; ignore_eos: no end token stops it early, whatever the weights answer
LONG = {"model": "clover-tiny", "prompt": "Please sort the list 3 1 2 4 9", "max_tokens": 1000, "threshold": 1.0,
        "ignore_eos": True}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ThreadServer:
    """uvicorn serving `app` on 127.0.0.1 in a background thread."""

    def __init__(self, app):
        self.app, self.port = app, free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        # keep-alive past any idle gap of a loaded test run: a client (max_retries=0) that reuses a connection
        # the server is closing at that instant sees "disconnected without a response"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning",
                                                    timeout_keep_alive=600))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self):
        self.thread.start()
        while not self.server.started:
            time.sleep(0.02)
        return self

    def wait_healthy(self, timeout=120):
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if httpx.get(self.url + "/health").status_code == 200:
                return
            time.sleep(0.1)
        raise TimeoutError("server not healthy")

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(30)


@pytest.fixture(scope="module")
def server(tiny_dir):
    app = build_app(ServeOptions(runtime=RuntimeConfig(max_slots=8), max_queue=64, max_body_bytes=64 << 10,
                                 request_timeout_s=120))
    with ThreadServer(app) as srv:
        srv.wait_healthy()
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


class Reference:
    """The Python API, one request at a time: what each HTTP request must return (memoised)."""

    def __init__(self):
        from clover_export.runtime import Generator

        self.gen = Generator.load(None, max_slots=1)
        self.tokenizer = self.gen.tokenizer
        self.memo = {}

    def generate(self, prompt=None, **kw):
        key = json.dumps([prompt, kw], sort_keys=True)
        if key not in self.memo:
            self.memo[key] = self.gen.generate(prompt, **kw)
        return self.memo[key]


@pytest.fixture(scope="module")
def reference(tiny_dir):
    return Reference()


def engine(server):
    return server.app.state.engine


def wait_idle(server, timeout=30):
    """Until no row is running or waiting, and every slot is free."""
    eng = engine(server)
    sched = eng.gen.loop.scheduler
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if not sched.running and not sched.waiting and len(sched.free_slots) == 8 and not eng._jobs:
            return True
        time.sleep(0.05)
    return False


def assert_each_answer_is_its_answer_alone(outs, reference, server) -> None:
    """outs[i] answered RAW_CASES[i % 3] (streamed when i is even): each equals the reference Generator's answer
    to that request alone; afterwards the server is idle and healthy."""
    for i, out in enumerate(outs):
        prompt, max_tokens = RAW_CASES[i % 3]
        text = "".join(p.choices[0].text for p in out) if i % 2 == 0 else out.choices[0].text
        assert text == reference.generate(prompt, raw=True, max_new_tokens=max_tokens).text
    assert wait_idle(server)
    assert httpx.get(server.url + "/health").status_code == 200


def running_soon(server, timeout=20):
    """Until a row is running in the batch."""
    sched = engine(server).gen.loop.scheduler
    end = time.monotonic() + timeout
    while not sched.running and time.monotonic() < end:
        time.sleep(0.02)
    return bool(sched.running)


# --- answers equal the Python API -------------------------------------------------------------------------
# prompts the embedded model answers in a few denoise steps (short enough for a small shared CPU)
CHAT_CASES = [
    ("What is 2 + 3?", {}, 64),
    ("What is 7 + 8?", {"enable_thinking": False}, 64),
    ("12*12=", {}, 40),
    ("Hi", {"enable_thinking": False}, 8),
]
RAW_CASES = [("The answer is", 40), ("What is 2 + 3?", 40), ("12*12=", 12), ("12*12=", 40)]


def chat_args(prompt, kw, max_tokens):
    extra = {"chat_template_kwargs": kw} if kw else None
    return dict(model=MODEL_ID, messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens,
                temperature=0, extra_body=extra)


def chat_reference(reference, prompt, kw, max_tokens):
    res = reference.generate(prompt, max_new_tokens=max_tokens, **kw)
    head, sep, tail = res.text.partition("</think>")
    thinking = kw.get("enable_thinking", True)
    reasoning, content = (head.strip(), tail.strip()) if thinking and sep else ("", res.text.strip())
    return res, reasoning, content


def test_chat_matches_python_api(client, reference):
    for prompt, kw, max_tokens in CHAT_CASES:
        out = client.chat.completions.create(**chat_args(prompt, kw, max_tokens))
        res, reasoning, content = chat_reference(reference, prompt, kw, max_tokens)
        msg = out.choices[0].message
        assert msg.content == content
        if kw.get("enable_thinking", True):
            assert msg.reasoning_content == reasoning
        assert (
            out.choices[0].finish_reason
            == {"stop": "stop", "stop_string": "stop", "length": "length"}[res.finish_reason]
        )
        assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (res.prompt_tokens, res.response_tokens)
        assert out.usage.total_tokens == res.prompt_tokens + res.response_tokens
        assert out.model_extra["clover"] == pytest.approx(clover_of(res))


def clover_of(res):
    """The `clover` object a response must carry for the Python API's Result `res`."""
    return {"decoding": res.decoding, "denoise_steps": res.denoise_steps, "forwards": res.forwards,
            "tokens_per_forward": res.tokens_per_forward, "accepted_per_forward": res.accepted_per_forward,
            "distinct_experts_per_block": res.distinct_experts_per_block}


def test_completions_match_python_api_and_finish_reasons(client, reference):
    for prompt, max_tokens in RAW_CASES:
        out = client.completions.create(model=MODEL_ID, prompt=prompt, max_tokens=max_tokens, temperature=0)
        res = reference.generate(prompt, raw=True, max_new_tokens=max_tokens)
        assert out.choices[0].text == res.text
        assert out.usage.completion_tokens == res.response_tokens
    # "length" at max_tokens; a stop string cuts the text and reports "stop"
    out = client.completions.create(model=MODEL_ID, prompt="The answer is", max_tokens=5)
    assert (out.choices[0].finish_reason, out.usage.completion_tokens) == ("length", 5)
    full = reference.generate("Sort: 7 3 9 1 4", raw=True, max_new_tokens=40).text
    stop = full[len(full) // 2:len(full) // 2 + 2]  # a string the answer holds, whatever the weights
    assert len(stop) == 2, full
    out = client.completions.create(model=MODEL_ID, prompt="Sort: 7 3 9 1 4", max_tokens=40, stop=[stop])
    assert out.choices[0].text == full[:full.index(stop)] and out.choices[0].finish_reason == "stop"
    # prompt token ids are a prompt too
    ids = reference.tokenizer.encode("The answer is", add_special_tokens=True)
    out = client.completions.create(model=MODEL_ID, prompt=ids, max_tokens=12)
    assert out.choices[0].text == reference.generate(prompt_ids=ids, max_new_tokens=12).text


# --- lossless decoding modes (DECODING.md 5) -------------------------------------------------------------------
LOSSLESS_CASES = [("12*12=", 40), ("What is 2 + 3?", 40)]
SPEC_CHAT = ("Please sort the list 3 1 2 4 9", 40)  # thinking on: the embedded model accepts some drafts here


def test_ar_and_self_spec_report_their_mode_and_agree_token_for_token(client, reference):
    """extra_body {"decoding": "ar" | "self_spec"} on both endpoints: each answer is the Python API's in that
    mode, its `clover` object names the mode and counts its forwards; greedy self_spec is ar token for token,
    in no more forwards (ar: one token per forward, nothing drafted)."""
    for prompt, max_tokens in LOSSLESS_CASES:
        outs = {}
        for mode in ("ar", "self_spec"):
            out = client.completions.create(model=MODEL_ID, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                            extra_body={"decoding": mode})
            res = reference.generate(prompt, raw=True, max_new_tokens=max_tokens, decoding=mode)
            assert out.model_extra["clover"]["decoding"] == mode
            assert out.choices[0].text == res.text
            assert out.usage.completion_tokens == res.response_tokens
            assert out.model_extra["clover"] == pytest.approx(clover_of(res))
            outs[mode] = out
        ar, spec = (outs[m].model_extra["clover"] for m in ("ar", "self_spec"))
        assert outs["self_spec"].choices[0].text == outs["ar"].choices[0].text
        assert outs["self_spec"].usage.completion_tokens == outs["ar"].usage.completion_tokens
        assert ar["accepted_per_forward"] == 0 and ar["forwards"] >= outs["ar"].usage.completion_tokens - 1
        assert 0 < spec["forwards"] <= ar["forwards"]


def test_chat_decoding_and_draft_threshold_reach_the_runtime(client, reference):
    """Chat, streamed and not: ar, self_spec and self_spec with draft_threshold 1 (no drafts: ar's forwards)
    give the same reasoning and content; each `clover` object is the Python API's for those parameters."""
    prompt, max_tokens = SPEC_CHAT
    answers = []
    for extra in ({"decoding": "ar"}, {"decoding": "self_spec"}, {"decoding": "self_spec", "draft_threshold": 1}):
        args = dict(model=MODEL_ID, messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens,
                    temperature=0, extra_body=extra)
        out = client.chat.completions.create(**args)
        res = reference.generate(prompt, max_new_tokens=max_tokens, **extra)
        msg = out.choices[0].message
        head, sep, tail = res.text.partition("</think>")
        assert (msg.reasoning_content, msg.content) == ((head.strip(), tail.strip()) if sep else (res.text.strip(), ""))
        assert out.model_extra["clover"] == pytest.approx(clover_of(res))
        chunks, _, reasoning, content = stream_chat(client, **args)  # the usage chunk reports the mode too
        assert (reasoning, content) == (msg.reasoning_content, msg.content)
        assert chunks[-1].model_extra["clover"] == pytest.approx(clover_of(res))
        answers.append((msg.reasoning_content, msg.content, out.model_extra["clover"]))
    (ar_text, ar_content, ar), (spec_text, spec_content, spec), (none_text, none_content, none) = answers
    assert ar_text == spec_text == none_text and ar_content == spec_content == none_content
    assert none["accepted_per_forward"] == 0 and none["forwards"] == ar["forwards"]
    assert spec["forwards"] <= ar["forwards"]


def stream_chat(client, **kw):
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    body = [c for c in chunks if c.choices]
    reasoning = "".join(getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in body)
    content = "".join(c.choices[0].delta.content or "" for c in body)
    return chunks, body, reasoning, content


def test_streaming_equals_non_streaming(client, reference):
    for prompt, kw, max_tokens in CHAT_CASES:
        args = chat_args(prompt, kw, max_tokens)
        whole = client.chat.completions.create(**args)
        chunks, body, reasoning, content = stream_chat(client, **args)
        assert content == whole.choices[0].message.content
        assert reasoning == (getattr(whole.choices[0].message, "reasoning_content", None) or "")
        res = reference.generate(prompt, max_new_tokens=max_tokens, **kw)
        assert len(body) == res.blocks + 1  # one chunk per committed block, then the finishing chunk
        assert [c.choices[0].finish_reason for c in body] == [None] * res.blocks + [whole.choices[0].finish_reason]
        assert body[0].choices[0].delta.role == "assistant"
        assert not chunks[-1].choices and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    for prompt, max_tokens in RAW_CASES:
        whole = client.completions.create(model=MODEL_ID, prompt=prompt, max_tokens=max_tokens)
        parts = list(client.completions.create(model=MODEL_ID, prompt=prompt, max_tokens=max_tokens, stream=True))
        assert "".join(p.choices[0].text for p in parts) == whole.choices[0].text
        assert parts[-1].choices[0].finish_reason == whole.choices[0].finish_reason
        assert parts[-1].usage is None  # only when stream_options.include_usage


def test_raw_sse_framing(server):
    """data: {chunk} per block, then data: [DONE] (SERVING.md 1), checked on the wire."""
    body = {"model": MODEL_ID, "prompt": "The answer is", "max_tokens": 40, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        text = r.read().decode()
    events = [e for e in text.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"
    assert all("choices" in json.loads(e[6:]) for e in events[:-1])


# --- one continuous batch -----------------------------------------------------------------------------------
def test_24_concurrent_mixed_requests_each_equal_their_single_answer(server, client, reference):
    jobs = []
    for i in range(24):
        stream = i % 2 == 0
        if i % 3 == 0:
            prompt, max_tokens = RAW_CASES[i % len(RAW_CASES)]
            jobs.append(("raw", prompt, {}, max_tokens, stream))
        else:
            prompt, kw, max_tokens = CHAT_CASES[i % len(CHAT_CASES)]
            jobs.append(("chat", prompt, kw, max_tokens, stream))

    def run(job):
        kind, prompt, kw, max_tokens, stream = job
        if kind == "raw":
            if stream:
                parts = client.completions.create(model=MODEL_ID, prompt=prompt, max_tokens=max_tokens, stream=True,
                                                  stream_options={"include_usage": True})
                parts = list(parts)
                return "".join(p.choices[0].text for p in parts if p.choices), parts[-1].model_extra["clover"]
            out = client.completions.create(model=MODEL_ID, prompt=prompt, max_tokens=max_tokens)
            return out.choices[0].text, out.model_extra["clover"]
        if stream:
            chunks, _, reasoning, content = stream_chat(client, **chat_args(prompt, kw, max_tokens))
            return (reasoning, content), chunks[-1].model_extra["clover"]
        msg = client.chat.completions.create(**chat_args(prompt, kw, max_tokens))
        return (
            getattr(msg.choices[0].message, "reasoning_content", None) or "",
            msg.choices[0].message.content,
        ), msg.model_extra["clover"]

    expected = []
    for kind, prompt, kw, max_tokens, _ in jobs:
        if kind == "raw":
            expected.append(reference.generate(prompt, raw=True, max_new_tokens=max_tokens).text)
        else:
            _, reasoning, content = chat_reference(reference, prompt, kw, max_tokens)
            expected.append((reasoning if kw.get("enable_thinking", True) else "", content))
    steps_before = engine(server).gen.loop.steps
    with ThreadPoolExecutor(24) as pool:
        got = list(pool.map(run, jobs))
    steps = engine(server).gen.loop.steps - steps_before
    assert [g[0] for g in got] == expected
    # the requests shared steps (one batch), rather than running one after another
    assert steps < sum(g[1]["denoise_steps"] for g in got)
    assert wait_idle(server)


# --- errors (SERVING.md 2) -----------------------------------------------------------------------------------
def post(server, path, body=None, content=None, headers=None):
    return httpx.post(server.url + path, json=body, content=content, headers=headers, timeout=60)


def check_error(r, status, param=None, code=None):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["type"] == ("invalid_request_error" if status < 500 else "service_unavailable" if status == 503
                           else "server_error")
    if param is not None:
        assert err["param"] == param
    if code is not None:
        assert err["code"] == code
    return err


CHAT = {"model": MODEL_ID, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8}
BAD_REQUESTS = [
    ({**CHAT, "nonsense": 1}, "nonsense", None),
    ({**CHAT, "threshold": 1.5}, "threshold", None),
    ({**CHAT, "temperature": -1}, "temperature", None),
    ({**CHAT, "temperature": 2.5}, "temperature", None),
    ({**CHAT, "presence_penalty": 2.5}, "presence_penalty", None),
    ({**CHAT, "max_tokens": True}, "max_tokens", None),
    ({**CHAT, "stream": "yes"}, "stream", None),
    ({**CHAT, "top_p": 0}, "top_p", None),
    ({**CHAT, "max_tokens": 0}, "max_tokens", None),
    ({**CHAT, "block_size": 8}, "block_size", None),
    ({**CHAT, "n": 9}, "n", None),
    ({**CHAT, "top_logprobs": 2}, "top_logprobs", None),
    ({**CHAT, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "string", "format": "no-such-format"}}}}, "response_format.json_schema.schema",
     None),
    ({**CHAT, "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required",
      "chat_template_kwargs": {"enable_thinking": True}}, "tool_choice", None),
    ({**CHAT, "messages": []}, "messages", None),
    ({**CHAT, "messages": [{"role": "wizard", "content": "x"}]}, None, None),
    ({**CHAT, "max_tokens": 4000}, "messages", "context_length_exceeded"),
    ({**CHAT, "chat_template_kwargs": {"foo": True}}, None, None),
    ({**CHAT, "decoding": "fast"}, "decoding", None),
    ({**CHAT, "decoding": "AR"}, "decoding", None),
    ({**CHAT, "draft_threshold": 2}, "draft_threshold", None),
    ({**CHAT, "draft_threshold": -0.1}, "draft_threshold", None),
]


@pytest.mark.parametrize("body,param,code", BAD_REQUESTS, ids=[str(i) for i in range(len(BAD_REQUESTS))])
def test_client_mistakes_are_400_with_openai_error_body(server, body, param, code):
    check_error(post(server, "/v1/chat/completions", body), 400, param, code)


def test_other_errors(server, client):
    check_error(
        post(server, "/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"}),
        400,
        code="invalid_json",
    )
    check_error(post(server, "/v1/completions", content=b"[1, 2]", headers={"content-type": "application/json"}),
                400, code="invalid_json")
    check_error(post(server, "/v1/completions", {"model": MODEL_ID, "prompt": "x" * 70_000}), 413,
                code="request_too_large")
    check_error(post(server, "/v1/completions", {"model": MODEL_ID, "prompt": "Hi", "max_tokens": 4000}), 400,
                "prompt", "context_length_exceeded")
    check_error(post(server, "/v1/completions", {"model": MODEL_ID, "prompt": ["a", "b"]}), 400, "prompt")
    check_error(post(server, "/v1/completions", {"model": MODEL_ID, "prompt": [[1, 2], [3]]}), 400, "prompt")
    check_error(post(server, "/v1/chat/completions", {**CHAT, "model": "gpt-4"}), 404, "model", "model_not_found")
    check_error(httpx.get(server.url + "/v1/nothing"), 404)
    # the official client sees the same errors as typed exceptions
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL_ID, messages=[{"role": "user", "content": "Hi"}], n=9)
    assert e.value.status_code == 400 and e.value.body["param"] == "n"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="other", prompt="Hi")
    for extra, param in (({"decoding": "fast"}, "decoding"), ({"draft_threshold": 2}, "draft_threshold")):
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model=MODEL_ID, prompt="Hi", max_tokens=8, extra_body=extra)
        assert e.value.status_code == 400 and e.value.body["param"] == param
        assert param in e.value.body["message"]
    err = check_error(post(server, "/v1/completions", {"model": MODEL_ID, "prompt": "Hi", "decoding": "fast"}), 400,
                      "decoding")
    assert '"low_confidence", "ar", "self_spec"' in err["message"] and '"fast"' in err["message"]
    # a stream that is refused is refused before any event: a plain error response
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL_ID, messages=[{"role": "user", "content": "Hi"}], stream=True,
                                       max_tokens=4000)
    assert e.value.code == "context_length_exceeded"


def test_queue_full_is_503_with_retry_after(server):
    eng = engine(server)
    saved = eng.max_pending
    eng.max_pending = 1
    try:
        long = {**LONG, "stream": True}
        with httpx.stream("POST", server.url + "/v1/completions", json=long, timeout=60):
            # headers come once the engine accepted the long request: it holds the only place
            busy = post(server, "/v1/chat/completions", CHAT)
            check_error(busy, 503, code="server_busy")
            assert int(busy.headers["retry-after"]) >= 1
    finally:
        eng.max_pending = saved
    assert wait_idle(server)
    assert post(server, "/v1/chat/completions", CHAT).status_code == 200


# --- lifecycle (SERVING.md 3) -----------------------------------------------------------------------------------
def test_abandoned_stream_frees_the_row_and_server_stays_healthy(server, client, reference):
    with httpx.stream("POST", server.url + "/v1/completions", json={**LONG, "stream": True}, timeout=60) as r:
        assert r.status_code == 200
        assert running_soon(server)
        row = engine(server).gen.loop.scheduler.running[0]
    # the client is gone: the row leaves the batch (it would run ~1000 steps otherwise)
    assert wait_idle(server, timeout=10)
    assert row.finish_reason == "cancelled" and len(row.response) < 1000
    assert httpx.get(server.url + "/health").status_code == 200
    out = client.completions.create(model=MODEL_ID, prompt="The answer is", max_tokens=40)
    assert out.choices[0].text == reference.generate("The answer is", raw=True, max_new_tokens=40).text


def test_abandoned_non_streaming_request_is_cancelled(server):
    with ThreadPoolExecutor(1) as pool:
        gone = pool.submit(httpx.post, server.url + "/v1/completions", json=LONG, timeout=httpx.Timeout(60, read=2))
        assert running_soon(server)
        row = engine(server).gen.loop.scheduler.running[0]
        with pytest.raises(httpx.ReadTimeout):
            gone.result()
    assert wait_idle(server, timeout=10)
    assert row.finish_reason == "cancelled" and len(row.response) < 1000


def test_a_request_failing_in_the_engine_fails_alone(server, client, reference, monkeypatch):
    """A fault while serving one request (injected into its delivery on the batch-loop thread) and a
    request the runtime refuses: both fail with an OpenAI error; the concurrent requests are unaffected."""
    eng = engine(server)
    real = type(eng).deliver
    story = reference.tokenizer.encode("Tell me a story", add_special_tokens=True)

    def faulty(self, job):
        if job.kwargs["prompt_ids"] == story:  # the engine receives the prompt as token ids
            raise RuntimeError("injected fault")
        return real(self, job)

    monkeypatch.setattr(type(eng), "deliver", faulty)

    def good(i):
        prompt, max_tokens = RAW_CASES[i % 3]
        return client.completions.create(model=MODEL_ID, prompt=prompt, max_tokens=max_tokens, stream=i % 2 == 0)

    def bad_stream():
        body = {"model": MODEL_ID, "prompt": "Tell me a story", "max_tokens": 40, "stream": True}
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
            return r.status_code, r.read().decode()

    with ThreadPoolExecutor(8) as pool:
        goods = [pool.submit(good, i) for i in range(6)]
        faulted = pool.submit(post, server, "/v1/completions", {"model": MODEL_ID, "prompt": "Tell me a story",
                                                                "max_tokens": 40})
        faulted_stream = pool.submit(bad_stream)
        refused = pool.submit(post, server, "/v1/completions", {"model": MODEL_ID, "prompt": "Hi", "max_tokens": 5000})
        outs = [f.result() for f in goods]
    err = check_error(faulted.result(), 500, code="engine_error")
    assert "injected fault" in err["message"]
    status, text = faulted_stream.result()
    events = [json.loads(e[6:]) for e in text.split("\n\n") if e and e != "data: [DONE]"]
    assert status == 200 and events[-1]["error"]["code"] == "engine_error" and text.endswith("data: [DONE]\n\n")
    check_error(refused.result(), 400, code="context_length_exceeded")
    assert_each_answer_is_its_answer_alone(outs, reference, server)


def test_models_and_metrics(server, client):
    models = httpx.get(server.url + "/v1/models").json()
    assert [m["id"] for m in models["data"]] == [MODEL_ID]
    assert models["data"][0]["max_model_len"] == engine(server).gen.max_context
    assert [m.id for m in client.models.list()] == [MODEL_ID]

    def figures():
        text = httpx.get(server.url + "/metrics").text
        return {s.name + json.dumps(s.labels, sort_keys=True): s.value
                for fam in text_string_to_metric_families(text) for s in fam.samples}

    before = figures()
    out = client.completions.create(model=MODEL_ID, prompt="What is 2 + 3?", max_tokens=40)
    check_error(post(server, "/v1/chat/completions", {**CHAT, "threshold": 1.5}), 400, "threshold")
    after = figures()

    def delta(name, labels=None):
        key = name + json.dumps(labels or {}, sort_keys=True)
        return after.get(key, 0) - before.get(key, 0)

    assert delta("clover_requests_total", {"endpoint": "/v1/completions", "status": "200"}) == 1
    assert delta("clover_generated_tokens_total") == out.usage.completion_tokens
    assert delta("clover_prompt_tokens_total") == out.usage.prompt_tokens
    assert delta("clover_denoise_steps_total") == out.model_extra["clover"]["denoise_steps"]
    assert delta("clover_tokens_per_forward_sum") == pytest.approx(out.model_extra["clover"]["tokens_per_forward"])
    assert delta("clover_distinct_experts_per_block_sum") == pytest.approx(
        out.model_extra["clover"]["distinct_experts_per_block"])
    for name in ("clover_time_to_first_block_seconds_count", "clover_request_latency_seconds_count"):
        assert delta(name) == 1
    assert delta("clover_step_seconds_count") >= out.model_extra["clover"]["denoise_steps"]
    assert "clover_queue_depth{}" in after and "clover_running_rows{}" in after
    # the process's C heap (glibc): the loaded model's tensors alone hold more than 1 MiB
    assert after['clover_heap_bytes{"state": "in_use"}'] > 2**20 and 'clover_heap_bytes{"state": "free"}' in after
    assert delta("clover_requests_total", {"endpoint": "/v1/chat/completions", "status": "400"}) == 1
    # low_confidence by default: counted by its mode, nothing drafted to observe
    assert delta("clover_decoding_requests_total", {"decoding": "low_confidence"}) == 1
    assert delta("clover_decoding_requests_total", {"decoding": "self_spec"}) == 0
    assert delta("clover_accepted_per_forward_count") == 0
    # a self_spec request: one observation of its accepted draft tokens per verifying forward
    before = after
    out = client.completions.create(model=MODEL_ID, prompt="What is 2 + 3?", max_tokens=40,
                                    extra_body={"decoding": "self_spec"})
    after = figures()
    assert delta("clover_decoding_requests_total", {"decoding": "self_spec"}) == 1
    assert delta("clover_accepted_per_forward_count") == 1
    assert delta("clover_accepted_per_forward_sum") == pytest.approx(out.model_extra["clover"]["accepted_per_forward"])
    assert delta("clover_tokens_per_forward_sum") == pytest.approx(out.model_extra["clover"]["tokens_per_forward"])
    # an ar request, and one whose mode is refused (400): the mode label holds the validated modes only
    before = after
    client.completions.create(model=MODEL_ID, prompt="What is 2 + 3?", max_tokens=8, extra_body={"decoding": "ar"})
    check_error(post(server, "/v1/completions", {"model": MODEL_ID, "prompt": "Hi", "decoding": "fast"}), 400,
                "decoding")
    after = figures()
    assert delta("clover_decoding_requests_total", {"decoding": "ar"}) == 1
    modes = {json.loads(k[len("clover_decoding_requests_total"):])["decoding"] for k in after
             if k.startswith("clover_decoding_requests_total{")}
    assert modes == {"low_confidence", "ar", "self_spec"}


def test_the_engine_gives_the_heap_back_when_the_batch_empties(server, client):
    trimmer = engine(server).heap_trimmer
    before = trimmer.trims
    client.completions.create(model=MODEL_ID, prompt="What is 2 + 3?", max_tokens=8)
    end = time.monotonic() + 10
    while trimmer.trims == before and time.monotonic() < end:
        time.sleep(0.05)
    assert trimmer.trims > before and not trimmer.dirty


def test_metrics_label_requests_by_route_not_by_raw_path(server):
    """Any path a client POSTs under /v1/ (404s, 405s) lands on a bounded set of series: the route's template,
    or "unmatched"; /metrics does not grow with the paths clients make up."""
    import uuid

    def series():
        text = httpx.get(server.url + "/metrics").text
        return {json.dumps(s.labels, sort_keys=True): s.value for fam in text_string_to_metric_families(text)
                for s in fam.samples if s.name == "clover_requests_total"}

    for path in ("/v1/nothing", "/v1/models/clover-tiny"):  # the 404 and 405 series exist from here on
        post(server, path, CHAT)
    before = series()
    made_up = [f"/v1/{uuid.uuid4().hex}", f"/v1/completions/{uuid.uuid4().hex}", f"/v1/models/{uuid.uuid4().hex}"]
    for path in made_up:
        assert post(server, path, CHAT).status_code in (404, 405)
    after = series()
    assert after.keys() == before.keys(), set(after) - set(before)
    assert not any(p.rsplit("/", 1)[1] in key for p in made_up for key in after)
    unmatched = json.dumps({"endpoint": "unmatched", "status": "404"}, sort_keys=True)
    template = json.dumps({"endpoint": "/v1/models/{model_id:path}", "status": "405"}, sort_keys=True)
    assert after[unmatched] - before[unmatched] == 2 and after[template] - before[template] == 1


@pytest.mark.parametrize("temperature", [1e-6, 1e-39, 1e-320])
def test_a_tiny_temperature_is_greedy(server, client, reference, temperature):
    """Temperatures below 1e-5 decode greedily (vLLM's rule, in the runtime's settings), whatever the seed; in
    float32 they would overflow the logits (1e-39) or divide by zero (1e-320)."""
    want = reference.generate("12*12=", raw=True, max_new_tokens=40).text
    for seed in (0, 1):
        r = post(server, "/v1/completions", {"model": MODEL_ID, "prompt": "12*12=", "max_tokens": 40,
                                             "temperature": temperature, "seed": seed})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == want, r.text


def test_health_is_503_until_loaded_and_stepped():
    gate = threading.Event()
    opts = ServeOptions(runtime=RuntimeConfig(max_slots=1))
    real = opts.load_generator
    opts.load_generator = lambda: (gate.wait(60), real())[1]
    with ThreadServer(build_app(opts)) as srv:
        r = httpx.get(srv.url + "/health")
        assert r.status_code == 503 and r.json()["status"] == "loading"
        check_error(post(srv, "/v1/completions", {"prompt": "Hi"}), 503, code="server_busy")
        gate.set()
        srv.wait_healthy()
        assert srv.app.state.engine.gen.loop.steps >= 1  # the warm-up step ran before 200


def test_api_key_guards_metrics_when_asked_and_no_origin_is_allowed_by_default():
    """--protect-metrics puts /metrics behind the key (/health stays open); with no --allowed-origins a
    preflight is answered 400 without CORS headers. The engine never loads here: the guards need none."""
    def no_model():
        raise CloverError("serve", "no model in this test")

    opts = ServeOptions(runtime=RuntimeConfig(max_slots=1), api_key="k-1", protect_metrics=True)
    opts.load_generator = no_model
    with ThreadServer(build_app(opts)) as srv:
        assert httpx.get(srv.url + "/metrics").status_code == 401
        assert httpx.get(srv.url + "/metrics", headers={"Authorization": "Bearer k-1"}).status_code == 200
        assert httpx.get(srv.url + "/health").status_code == 503  # open (and says the load failed)
        check_error(httpx.get(srv.url + "/v1/models"), 401, code="invalid_api_key")
        r = httpx.options(srv.url + "/v1/completions", headers={"Origin": "https://a.example",
                                                                 "Access-Control-Request-Method": "POST"})
        assert r.status_code == 400 and "access-control-allow-origin" not in r.headers


PIECES = ["a", "b", " ", "  ", "\n", "1", "==", "\u00e9", "\u4e2d", "\U0001f600", "<|im_end|>", "</think>", "\ufb01",
          "\u0301"]


@given(st.data())
def test_the_cheap_prompt_bound_never_overcounts(tiny_tokenizer, data):
    """A prompt of C characters is at least C / chars_per_token tokens, so a prompt refused on its length
    before tokenising could never have fitted. Texts made of the vocabulary's longest entries are the ones
    that come closest."""
    vocab = tiny_tokenizer.tok.get_vocab()
    longest = sorted(vocab, key=len)[-8:]
    pieces = PIECES + [tiny_tokenizer.decode([vocab[t]]) for t in longest]
    text = "".join(data.draw(st.lists(st.sampled_from(pieces), max_size=40)))
    bound = chars_per_token(tiny_tokenizer)
    assert len(tiny_tokenizer.encode(text, add_special_tokens=True)) * bound >= len(text)
    assert len(tiny_tokenizer.encode(text)) * bound >= len(text)


@pytest.fixture(scope="module")
def tiny_tokenizer(tiny_dir):
    from clover_export.model.tokenizer import ChatTokenizer

    return ChatTokenizer(tiny_dir)


# --- the streaming text split -----------------------------------------------------------------------------------
FRAGMENTS = st.sampled_from([" ", "\n", "a", "b", "<", "</", "th", "ink", ">", "</think>", "</th"])


@given(st.lists(st.lists(FRAGMENTS, max_size=4).map("".join), max_size=8), st.booleans())
@example(["a</th", "ink>b"], True)  # `</think>` split across two blocks
@example(["\n</think>\n\n2 ", "3 ", " "], True)
def test_text_split_deltas_sum_to_the_final_split(pieces, thinking):
    """Streamed reasoning/content deltas add up to the non-streaming split, whatever the block boundaries."""
    split = TextSplit(thinking)
    sent = ["", ""]
    for i, piece in enumerate(pieces + [""]):
        r, c = split.push(piece, i == len(pieces))
        sent = [sent[0] + r, sent[1] + c]
    assert tuple(sent) == TextSplit(thinking).parts("".join(pieces))


def test_a_row_failing_inside_the_runtime_step_fails_alone(server, client, reference, monkeypatch):
    """An exception raised by the backend's step for one row (the runtime undoes the step, finds the row
    that fails alone and reports it with finish_reason "error"): that request gets an OpenAI error, the
    requests batched with it finish with their single-request answers, and the server stays healthy."""
    eng = engine(server)
    backend = eng.gen.backend
    poison = "Q~Q~"
    poison_ids = set(eng.gen.tokenizer.encode(poison))
    innocent = {t for p, _ in RAW_CASES for t in eng.gen.tokenizer.encode(p)}
    poison_ids -= innocent
    assert poison_ids, "the poison text must hold a token no good prompt holds"
    real_step = backend.step

    def step(inputs, pools):
        out = real_step(inputs, pools)
        ids, n_causal = inputs["input_ids"], inputs["n_causal"]
        for r in range(ids.shape[0]):
            if poison_ids & set(ids[r, :int(n_causal[r])].tolist()):
                raise RuntimeError("poisoned row")
        return out

    monkeypatch.setattr(backend, "step", step)

    def good(i):
        prompt, max_tokens = RAW_CASES[i % 3]
        return client.completions.create(model=MODEL_ID, prompt=prompt, max_tokens=max_tokens, stream=i % 2 == 0)

    with ThreadPoolExecutor(6) as pool:
        goods = [pool.submit(good, i) for i in range(4)]
        bad = pool.submit(post, server, "/v1/completions", {"model": MODEL_ID, "prompt": poison, "max_tokens": 20})
        outs = [f.result() for f in goods]
    r = bad.result()
    assert r.status_code >= 400 and "error" in r.json(), r.text
    assert_each_answer_is_its_answer_alone(outs, reference, server)
