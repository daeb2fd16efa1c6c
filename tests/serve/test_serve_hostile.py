"""Hostile clients against a real `clover-export serve` process (SERVING.md 5; docs/serving.md).

One server process for the module, started as a user would (API key from
CLOVER_API_KEY, two CORS origins). Every hostile request gets its OpenAI
error, and is followed by a normal request that must give the Python API's
answer and by /health 200: no request breaks the engine. At the end the
server exits 0 on SIGTERM with no traceback in its log. The pure checks
(JSON depth, Content-Type, field paths) run without a server.
"""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError

from clover_export.serve import protocol
from clover_export.serve.protocol import ApiError
from clover_export.testing.server import start_server, stop_server

KEY = "sk-clover-test-7f3a"
ORIGIN, OTHER_ORIGIN, EVIL = "https://app.example", "https://other.example", "https://evil.example"
AUTH = {"Authorization": f"Bearer {KEY}"}
JSON_AUTH = {"content-type": "application/json", **AUTH}
NORMAL = {"model": "clover-tiny", "prompt": "The answer is", "max_tokens": 12}


class Server:
    def __init__(self, proc, url):
        self.proc, self.url = proc, url

    def post(self, path, body=None, content=None, headers=None, timeout=60):
        headers = JSON_AUTH if headers is None else headers
        data = content if content is not None else json.dumps(body).encode()
        return httpx.post(self.url + path, content=data, headers=headers, timeout=timeout)


@pytest.fixture(scope="module")
def server(tiny_dir):
    proc, url = start_server("--max-batch", "12", "--log-level", "warning", "--allowed-origins",
                             f"{ORIGIN}, {OTHER_ORIGIN}", env={"CLOVER_API_KEY": KEY})
    srv = Server(proc, url)
    try:
        yield srv
    finally:
        log = stop_server(proc)
    assert proc.returncode == 0, log[-3000:]
    assert "Traceback" not in log, log[-3000:]  # no request left a traceback behind


@pytest.fixture(scope="module")
def reference(tiny_dir):
    from clover_export.runtime import Generator

    return Generator.load(None, max_slots=1)


@pytest.fixture(scope="module")
def normal_answer(server, reference):
    text = reference.generate("The answer is", raw=True, max_new_tokens=12).text
    assert server.post("/v1/completions", NORMAL).json()["choices"][0]["text"] == text
    return text


def still_serving(server, normal_answer):
    """The hostile request broke nothing: a normal request gets its Python API answer, /health is 200."""
    r = server.post("/v1/completions", NORMAL, timeout=30)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == normal_answer, r.text
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200


def check_error(r, status, code=None, param=None):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["type"] == ("invalid_request_error" if status < 500 else "service_unavailable")
    if code is not None:
        assert err["code"] == code, err
    if param is not None:
        assert err["param"] == param, err
    return err


# --- hostile bodies: each refused with its OpenAI error, then the server answers as before ------------------------
def nested(depth: int) -> bytes:
    return b'{"prompt": "Hi", "metadata": ' + b"[" * depth + b"]" * depth + b"}"


def messages_body(n: int) -> bytes:
    return json.dumps({"messages": [{"role": "user", "content": ""}] * n, "max_tokens": 8}).encode()


def ids_body(n: int) -> bytes:
    return json.dumps({"prompt": [1] * n, "max_tokens": 8}, separators=(",", ":")).encode()


MANY_MESSAGES = messages_body(120_000)  # 3.96 MB
MANY_IDS = ids_body(1_300_000)  # 2.6 MB
CONTENT_PARTS = json.dumps({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}] * 2000},
                                         {"role": "user", "content": [{"type": "text", "text": "b"}] * 49}]}).encode()
CHAT_SURROGATE = b'{"messages": [{"role": "user", "content": "\\ud800 hi"}]}'
HOSTILE = [
    # (id, body bytes, headers, status, code, param)
    ("lone-surrogate-content", CHAT_SURROGATE, JSON_AUTH, 400, None, "messages[0].content"),
    ("lone-surrogate-prompt", b'{"prompt": "\\udfff"}', JSON_AUTH, 400, None, "prompt"),
    ("lone-surrogate-stop", b'{"prompt": "Hi", "stop": ["a", "\\udc00"]}', JSON_AUTH, 400, None, "stop[1]"),
    ("lone-surrogate-key", b'{"prompt": "Hi", "\\ud83d": 1}', JSON_AUTH, 400, None, None),
    ("text-plain", CHAT_SURROGATE, {"content-type": "text/plain", **AUTH}, 415, "unsupported_media_type", None),
    ("form", b"prompt=Hi", {"content-type": "application/x-www-form-urlencoded", **AUTH}, 415, None, None),
    ("multipart", b"--x\r\n\r\n--x--", {"content-type": "multipart/form-data; boundary=x", **AUTH}, 415, None, None),
    ("no-content-type", json.dumps(NORMAL).encode(), AUTH, 415, "unsupported_media_type", None),
    (
        "latin-1-charset",
        json.dumps(NORMAL).encode(),
        {"content-type": "application/json; charset=latin-1", **AUTH},
        415,
        None,
        None,
    ),
    ("not-utf-8", b'{"prompt": "\xff\xfe"}', JSON_AUTH, 400, "invalid_json", None),
    ("nan", b'{"prompt": "Hi", "temperature": NaN}', JSON_AUTH, 400, "invalid_json", None),
    ("infinity", b'{"prompt": "Hi", "temperature": Infinity}', JSON_AUTH, 400, "invalid_json", None),
    ("-infinity", b'{"prompt": "Hi", "top_p": -Infinity}', JSON_AUTH, 400, "invalid_json", None),
    ("overflow", b'{"prompt": "Hi", "temperature": 1e400}', JSON_AUTH, 400, "invalid_json", None),
    ("huge-int", b'{"prompt": "Hi", "max_tokens": 1' + b"0" * 5000 + b"}", JSON_AUTH, 400, "invalid_json", None),
    ("depth-100", nested(100), JSON_AUTH, 400, "invalid_json", None),
    ("depth-1000", nested(1000), JSON_AUTH, 400, "invalid_json", None),
    ("depth-5000", nested(5000), JSON_AUTH, 400, "invalid_json", None),
    ("depth-100000-bare", b"[" * 100_000, JSON_AUTH, 400, "invalid_json", None),
    (
        "depth-in-message",
        b'{"messages": [{"role": "user", "content": "x", "name": ' + b'{"a":' * 3000 + b"1" + b"}" * 3000 + b"}]}",
        JSON_AUTH,
        400,
        "invalid_json",
        None,
    ),
    ("temperature-1e39", b'{"prompt": "Hi", "temperature": 1e39}', JSON_AUTH, 400, None, "temperature"),
    ("temperature-1e308", b'{"prompt": "Hi", "temperature": 1e308}', JSON_AUTH, 400, None, "temperature"),
    ("length-penalty-1e308", b'{"prompt": "Hi", "dllm_length_penalty": 1e308}', JSON_AUTH, 400, None,
     "dllm_length_penalty"),
    ("think-end-window-1e39", b'{"prompt": "Hi", "dllm_think_end_window": 1e39}', JSON_AUTH, 400, None,
     "dllm_think_end_window"),
    ("temperature-2.0001", b'{"prompt": "Hi", "temperature": 2.0001}', JSON_AUTH, 400, None, "temperature"),
    ("temperature-string", b'{"prompt": "Hi", "temperature": "1"}', JSON_AUTH, 400, None, "temperature"),
    ("max_tokens-true", b'{"prompt": "Hi", "max_tokens": true}', JSON_AUTH, 400, None, "max_tokens"),
    ("max_tokens-float", b'{"prompt": "Hi", "max_tokens": 12.0}', JSON_AUTH, 400, None, "max_tokens"),
    ("stream-yes", b'{"prompt": "Hi", "stream": "yes"}', JSON_AUTH, 400, None, "stream"),
    ("stream-1", b'{"prompt": "Hi", "stream": 1}', JSON_AUTH, 400, None, "stream"),
    ("n-true", b'{"prompt": "Hi", "n": true}', JSON_AUTH, 400, None, "n"),
    ("presence-2.5", b'{"prompt": "Hi", "presence_penalty": 2.5}', JSON_AUTH, 400, None, "presence_penalty"),
    ("frequency--2.5", b'{"prompt": "Hi", "frequency_penalty": -2.5}', JSON_AUTH, 400, None, "frequency_penalty"),
    ("top_p-0", b'{"prompt": "Hi", "top_p": 0}', JSON_AUTH, 400, None, "top_p"),
    ("content-number", b'{"messages": [{"role": "user", "content": 5}]}', JSON_AUTH, 400, None, "messages[0].content"),
    (
        "image-part",
        b'{"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}',
        JSON_AUTH,
        400,
        None,
        "messages[0].content",
    ),
    (
        "template-breaker",
        b'{"messages": [{"role": "assistant", "content": "x", "tool_calls": 7}, {"role": "user", "content": "y"}]}',
        JSON_AUTH,
        None,
        None,
        None,
    ),
    ("prompt-ids-outside-vocab", b'{"prompt": [1, 2, 99999999]}', JSON_AUTH, 400, None, "prompt"),
    ("prompt-nested-lists", b'{"prompt": [[1, 2], [3]]}', JSON_AUTH, 400, None, "prompt"),
    ("empty-prompt", b'{"prompt": ""}', JSON_AUTH, 400, None, "prompt"),
    ("array-body", b"[1, 2, 3]", JSON_AUTH, 400, "invalid_json", None),
    (
        "100000-stop-strings",
        json.dumps({"prompt": "Hi", "stop": ["ab"] * 100_000}).encode(),
        JSON_AUTH,
        400,
        None,
        "stop",
    ),
    ("min_tokens-over-max", b'{"prompt": "Hi", "max_tokens": 4, "min_tokens": 8}', JSON_AUTH, 400, None, "min_tokens"),
    ("120000-empty-messages", MANY_MESSAGES, JSON_AUTH, 400, "array_above_max_length", "messages"),
    ("2049-messages", messages_body(2049), JSON_AUTH, 400, "array_above_max_length", "messages"),
    ("2049-content-parts", CONTENT_PARTS, JSON_AUTH, 400, "array_above_max_length", "messages[1].content"),
    ("1.3M-prompt-ids", MANY_IDS, JSON_AUTH, 400, "context_length_exceeded", "prompt"),
    ("2049-prompt-ids", ids_body(2049), JSON_AUTH, 400, "context_length_exceeded", "prompt"),
    ("metadata-17-keys", json.dumps({"prompt": "Hi", "metadata": {str(i): "v" for i in range(17)}}).encode(),
     JSON_AUTH, 400, None, "metadata"),
    ("metadata-100000-keys", json.dumps({"prompt": "Hi", "metadata": {str(i): "" for i in range(100_000)}}).encode(),
     JSON_AUTH, 400, None, "metadata"),
    ("metadata-long-key", json.dumps({"prompt": "Hi", "metadata": {"k" * 65: "v"}}).encode(), JSON_AUTH, 400, None,
     "metadata." + "k" * 65),
    ("metadata-long-value", json.dumps({"prompt": "Hi", "metadata": {"k": "v" * 513}}).encode(), JSON_AUTH, 400, None,
     "metadata.k"),
    ("decoding-number", b'{"prompt": "Hi", "decoding": 1}', JSON_AUTH, 400, None, "decoding"),
    ("decoding-true", b'{"prompt": "Hi", "decoding": true}', JSON_AUTH, 400, None, "decoding"),
    ("decoding-list", b'{"prompt": "Hi", "decoding": ["ar"]}', JSON_AUTH, 400, None, "decoding"),
    ("decoding-10kB", json.dumps({"prompt": "Hi", "decoding": "ar" * 5000}).encode(), JSON_AUTH, 400, None,
     "decoding"),
    ("decoding-padded", b'{"prompt": "Hi", "decoding": " ar"}', JSON_AUTH, 400, None, "decoding"),
    ("draft_threshold-string", b'{"prompt": "Hi", "draft_threshold": "0.5"}', JSON_AUTH, 400, None,
     "draft_threshold"),
    ("draft_threshold-1e308", b'{"prompt": "Hi", "draft_threshold": 1e308}', JSON_AUTH, 400, None, "draft_threshold"),
    (
        "huge-model-name",
        json.dumps({"prompt": "Hi", "model": "m" * 100_000}).encode(),
        JSON_AUTH,
        404,
        "model_not_found",
        "model",
    ),
]


@pytest.mark.parametrize("body,headers,status,code,param", [c[1:] for c in HOSTILE], ids=[c[0] for c in HOSTILE])
def test_hostile_request_is_refused_and_the_server_goes_on(server, normal_answer, body, headers, status, code, param):
    path = "/v1/chat/completions" if b'"messages"' in body[:20] else "/v1/completions"
    r = server.post(path, content=body, headers=headers)
    if status is None:  # a template that cannot take the messages: the messages' fault, or rendered fine
        assert r.status_code in (200, 400), r.text
        if r.status_code == 400:  # the messages' fault, named down to the field
            err = check_error(r, 400)
            assert err["param"] == "messages" or err["param"].startswith("messages["), err
    else:
        err = check_error(r, status, code, param)
        assert "max_new_tokens" not in err["message"] and len(err["message"]) < 400
    still_serving(server, normal_answer)


def test_error_messages_name_the_public_parameter(server):
    err = check_error(server.post("/v1/completions", {"prompt": "Hi", "max_tokens": 0}), 400, param="max_tokens")
    assert "'max_tokens' must be an integer >= 1" in err["message"]
    err = check_error(server.post("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}), 400)
    assert err["message"].startswith("'messages[0].content' must be a valid string or a valid list")
    err = check_error(server.post("/v1/completions", {"prompt": "Hi", "max_tokens": 5000}), 400,
                      "context_length_exceeded", "prompt")
    assert "max_tokens 5000" in err["message"]
    err = check_error(server.post("/v1/chat/completions", {"messages": [{"content": "x"}]}), 400)
    assert err["param"] == "messages[0].role" and "required" in err["message"]


# --- accepted as OpenAI accepts them ------------------------------------------------------------------------------
IGNORED = [{"n": None}, {"stream": None}, {"n": 1}, {"store": True}, {"service_tier": "auto"},
           {"metadata": {"purpose": "test"}}, {"metadata": {f"{i:064d}": "v" * 512 for i in range(16)}},
           {"user": "u-1"}, {"logit_bias": {}}, {"logprobs": None},
           {"stream_options": None}, {"temperature": None, "top_p": None, "seed": None},
           {"decoding": None, "draft_threshold": None}]


@pytest.mark.parametrize("extra", IGNORED, ids=[next(iter(e)) for e in IGNORED])
def test_null_and_ignored_fields_are_accepted_and_change_nothing(server, normal_answer, extra):
    r = server.post("/v1/completions", {**NORMAL, **extra})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == normal_answer, r.text


def test_chat_ignored_fields_and_charset(server, reference):
    want = reference.generate("Hi", max_new_tokens=8, enable_thinking=False).text.strip()
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8, "parallel_tool_calls": False,
            "tool_choice": "none", "tools": [], "response_format": {"type": "text"},
            "chat_template_kwargs": {"enable_thinking": False}, "max_completion_tokens": None}
    r = server.post("/v1/chat/completions", body, headers={"content-type": "Application/JSON; charset=UTF-8", **AUTH})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == want, r.text


def test_negative_penalties_reach_the_runtime(server, reference):
    """OpenAI's [-2, 2]: -0.5 is accepted and decodes as the Python API does with it."""
    for name in ("frequency_penalty", "presence_penalty"):
        r = server.post("/v1/completions", {"prompt": "12*12=", "max_tokens": 40, name: -0.5})
        want = reference.generate("12*12=", raw=True, max_new_tokens=40, **{name: -0.5}).text
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == want, r.text


def test_vllm_ignore_eos_and_min_tokens(server, reference):
    prompt = "Reverse: 4 5 6"  # a task the default answers in a few tokens, then an end token
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=60)
    args = dict(model="clover-tiny", messages=[{"role": "user", "content": prompt}], max_tokens=64)
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    plain = client.chat.completions.create(**args, extra_body=off)
    assert plain.usage.completion_tokens < 20 and plain.choices[0].finish_reason == "stop"  # ends early by itself
    out = client.chat.completions.create(**args, extra_body={**off, "ignore_eos": True})
    assert (out.usage.completion_tokens, out.choices[0].finish_reason) == (64, "length")
    # the end tokens it generated on are in token_ids but not in the text
    want = reference.generate(prompt, max_new_tokens=64, enable_thinking=False, ignore_eos=True)
    ends = set(reference.defaults.eos_token_id) | reference.extra_end_ids
    assert ends & set(want.token_ids) and len(want.token_ids) == 64
    kept = [t for t in want.token_ids if t not in ends]
    assert want.text == reference.tokenizer.decode(kept)
    assert not any(reference.tokenizer.decode([t]) in want.text for t in ends)
    # Up to its first end token the server's answer is the reference's; past it the model is outside what it
    # learnt (near-uniform rows), where a row batched beside other requests may round a near-tie the other way
    first = next(i for i, t in enumerate(want.token_ids) if t in ends)
    head, content = reference.tokenizer.decode(want.token_ids[:first]).strip(), out.choices[0].message.content
    assert head and content.startswith(head)
    assert not any(reference.tokenizer.decode([t]) in content for t in ends)
    out = client.chat.completions.create(**args, extra_body={**off, "min_tokens": 20})
    want = reference.generate(prompt, max_new_tokens=64, enable_thinking=False, min_tokens=20)
    assert out.usage.completion_tokens == want.response_tokens >= 20
    assert out.choices[0].message.content == want.text.strip()


def test_models_retrieve_and_stream_usage_null(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=60)
    assert client.models.retrieve("clover-tiny").id == "clover-tiny"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")
    check_error(httpx.get(server.url + "/v1/models/org/other", headers=AUTH), 404, "model_not_found", "model")
    # 12 tokens; continuous_usage_stats is ignored: usage comes once, at the end
    body = {**NORMAL, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, headers=AUTH, timeout=60) as r:
        events = [e for e in r.read().decode().split("\n\n") if e]
    chunks = [json.loads(e[6:]) for e in events[:-1]]
    assert events[-1] == "data: [DONE]" and len(chunks) >= 2
    assert all("usage" in c and c["usage"] is None for c in chunks[:-1])  # OpenAI: null until the usage chunk
    assert chunks[-1]["usage"]["completion_tokens"] == 12 and chunks[-1]["choices"] == []
    # the official client reads them
    parts = list(client.completions.create(**NORMAL, stream=True, stream_options={"include_usage": True}))
    assert [p.usage is None for p in parts] == [True] * (len(parts) - 1) + [False]


# --- hostile load beside a normal request --------------------------------------------------------------------------
def timed(fn, *args, **kw):
    t0 = time.monotonic()
    out = fn(*args, **kw)
    return out, time.monotonic() - t0


BIG_MESSAGE = json.dumps({"messages": [{"role": "user", "content": "hello world " * 325_000}],
                          "max_tokens": 8}).encode()
BIG_BODIES = [
    # (id, body, how many at once, code, param)
    ("3.9-MB-message", BIG_MESSAGE, 24, "context_length_exceeded", "messages"),
    ("120000-empty-messages", MANY_MESSAGES, 8, "array_above_max_length", "messages"),
    ("1.3M-prompt-ids", MANY_IDS, 8, "context_length_exceeded", "prompt"),
    ("1M-tools", json.dumps({"messages": [{"role": "user", "content": "x"}], "tools": [{}] * 1_000_000}).encode(), 24,
     "array_above_max_length", "tools"),
]


@pytest.mark.parametrize("raw,count,code,param", [c[1:] for c in BIG_BODIES], ids=[c[0] for c in BIG_BODIES])
def test_big_bodies_beside_a_small_request(server, normal_answer, raw, count, code, param):
    """Bodies of up to 4 MB, many at once: each is refused from a count or a size before anything walks or
    tokenises it, and big bodies are checked one at a time, so the small request beside them is answered
    within a few seconds."""
    assert 2_000_000 < len(raw) < 4 << 20
    path = "/v1/chat/completions" if b'"messages"' in raw[:20] else "/v1/completions"
    _, alone = timed(server.post, "/v1/completions", NORMAL)
    with ThreadPoolExecutor(count + 1) as pool:
        bigs = [pool.submit(timed, server.post, path, content=raw) for _ in range(count)]
        time.sleep(0.5)  # the uploads are under way
        (r, took) = pool.submit(timed, server.post, "/v1/completions", NORMAL).result()
        refused = [f.result() for f in bigs]
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == normal_answer
    assert took < alone + 5, (took, alone)
    for rb, _ in refused:
        check_error(rb, 400, code, param)
    still_serving(server, normal_answer)


HOSTILE_TEMPERATURES = [b"1e39", b"1e308", b"NaN", b"Infinity", b"3", b'"2"', b"true", b"-1"]


def test_hostile_temperatures_and_max_temperature_do_not_delay_a_normal_request(server, normal_answer):
    """8 hostile temperatures are refused up front (no slot taken); 8 requests at the maximum temperature 2
    finish like any other (each block at most block_size denoise steps); a normal request beside them all is
    answered within a few seconds."""
    _, alone = timed(server.post, "/v1/completions", NORMAL)
    hot = {"prompt": "Please sort the list 3 1 2 4 9", "max_tokens": 32, "temperature": 2, "ignore_eos": True}
    with ThreadPoolExecutor(17) as pool:
        hostile = [pool.submit(server.post, "/v1/completions",
                               content=b'{"prompt": "Hi", "max_tokens": 900, "temperature": ' + t + b"}")
                   for t in HOSTILE_TEMPERATURES]
        hottest = [pool.submit(server.post, "/v1/completions", {**hot, "seed": i}) for i in range(8)]
        time.sleep(0.2)
        r, took = pool.submit(timed, server.post, "/v1/completions", NORMAL).result()
        for f in hostile:
            assert f.result().status_code == 400, f.result().text
        for f in hottest:
            out = f.result().json()
            assert out["choices"][0]["finish_reason"] == "length", out
            assert out["clover"]["denoise_steps"] <= 32  # one block of 32 positions: at most 32 steps
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == normal_answer
    assert took < alone + 5, (took, alone)
    still_serving(server, normal_answer)


# --- API key and CORS -----------------------------------------------------------------------------------------------
def test_api_key_with_the_openai_client(server, normal_answer):
    good = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=60)
    assert [m.id for m in good.models.list()] == ["clover-tiny"]
    assert good.completions.create(**NORMAL).choices[0].text == normal_answer
    bad = openai.OpenAI(base_url=server.url + "/v1", api_key="sk-wrong", max_retries=0, timeout=60)
    for call in (lambda: bad.models.list(), lambda: bad.completions.create(**NORMAL),
                 lambda: bad.chat.completions.create(model="clover-tiny", messages=[{"role": "user", "content": "x"}])):
        with pytest.raises(openai.AuthenticationError) as e:
            call()
        assert e.value.status_code == 401 and e.value.code == "invalid_api_key"


@pytest.mark.parametrize("authorization", [None, "Bearer wrong", f"Bearer {KEY}x", f"Basic {KEY}", KEY, "Bearer",
                                           f"Bearer {KEY[:-1]}"])
def test_api_key_raw_refusals(server, authorization):
    headers = {"content-type": "application/json"} | ({"Authorization": authorization} if authorization else {})
    for method, path in (("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("GET", "/v1/models"),
                         ("GET", "/v1/models/clover-tiny"), ("GET", "/v1/nothing")):
        r = httpx.request(method, server.url + path, headers=headers, content=json.dumps(NORMAL), timeout=30)
        check_error(r, 401, "invalid_api_key")
        assert r.headers["www-authenticate"] == "Bearer"


@pytest.mark.parametrize("key", ["", "   ", " sk-x", "sk-x\n"])
def test_an_empty_or_padded_api_key_is_refused_at_start(key):
    """CLOVER_API_KEY="" would otherwise serve without authentication, and a key with surrounding whitespace
    (a file's newline) could never match a header: the command refuses both in one line, before loading."""
    from click.testing import CliRunner

    from clover_export.cli import main

    nowhere = "/nonexistent/model"  # were the key taken, the command would stop here instead
    for args, env in ((["serve", nowhere], {"CLOVER_API_KEY": key}), (["serve", nowhere, "--api-key", key], {})):
        r = CliRunner().invoke(main, args, env=env)
        assert r.exit_code == 1 and "CLOVER_API_KEY" in r.output and "Traceback" not in r.output, r.output
        assert len(r.output.strip().splitlines()) <= 2, r.output


def test_api_key_leaves_health_and_metrics_open(server):
    assert httpx.get(server.url + "/health").status_code == 200
    assert httpx.get(server.url + "/metrics").status_code == 200  # open unless --protect-metrics
    r = httpx.post(server.url + "/v1/completions", json=NORMAL, headers={"Authorization": f"bearer {KEY}"}, timeout=60)
    assert r.status_code == 200  # the scheme is case-insensitive (RFC 7235)


def preflight(server, origin, path="/v1/chat/completions"):
    return httpx.options(server.url + path, headers={
        "Origin": origin, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type, x-stainless-lang"})


def test_cors_allowed_origins(server, normal_answer):
    for origin in (ORIGIN, OTHER_ORIGIN):
        r = preflight(server, origin)
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == origin
        assert "POST" in r.headers["access-control-allow-methods"]
        assert "authorization" in r.headers["access-control-allow-headers"].lower()
    r = server.post("/v1/completions", NORMAL, headers={"Origin": ORIGIN, **JSON_AUTH})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ORIGIN
    assert r.json()["choices"][0]["text"] == normal_answer
    # a 401 is readable by the allowed page (it can tell the user why)
    r = server.post("/v1/completions", NORMAL, headers={"Origin": ORIGIN, "content-type": "application/json"})
    assert r.status_code == 401 and r.headers["access-control-allow-origin"] == ORIGIN


def test_cors_other_origins_get_nothing(server, normal_answer):
    r = preflight(server, EVIL)
    assert r.status_code == 400 and "access-control-allow-origin" not in r.headers
    r = server.post("/v1/completions", NORMAL, headers={"Origin": EVIL, **JSON_AUTH})
    assert "access-control-allow-origin" not in r.headers  # the browser keeps the answer from the page
    # what a page can send cross-site without a preflight is refused before anything runs
    r = server.post("/v1/completions", content=json.dumps(NORMAL).encode(),
                    headers={"Origin": EVIL, "content-type": "text/plain", **AUTH})
    check_error(r, 415, "unsupported_media_type")
    still_serving(server, normal_answer)


# --- the pure checks ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("body,depth", [
    (b'{"a": 1}', 1), (b"[]", 1), (b"1", 0), (b'{"a": [[{"b": []}]]}', 5), (b'{"s": "[[[[{{{{"}', 1),
    (b'{"s": "\\"[[[["}', 1), (b'{"s": "\\\\", "t": [[1]]}', 3), (b'["]", [["}"]]]', 3), (b"[" * 10_000, 10_000),
])
def test_json_depth_counts_brackets_outside_strings(body, depth):
    assert protocol.json_depth(body) == depth


def depth_of(value) -> int:
    """The reference: nesting depth of the parsed value."""
    if isinstance(value, dict):
        return 1 + max(map(depth_of, value.values()), default=0)
    if isinstance(value, list):
        return 1 + max(map(depth_of, value), default=0)
    return 0


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(alphabet=st.sampled_from('[]{}"\\ ,:a\n\u00e9')),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(alphabet='[]{}"\\a', max_size=3), inner,
                                                                max_size=3),
    max_leaves=20)


@given(JSON_VALUES, st.booleans())
def test_json_depth_equals_the_parsed_depth(value, ascii_only):
    """Whatever brackets, quotes and backslashes the strings hold, escaped as json.dumps writes them."""
    assert protocol.json_depth(json.dumps(value, ensure_ascii=ascii_only).encode()) == depth_of(value)


def test_json_depth_is_cheap_on_4_mb():
    for body in (b'{"p": "' + b"[\\\"" * 1_300_000 + b'"}', b"[" * 4_000_000, b"[1]," * 1_000_000,
                 b'"' * 4_000_000, b'["a",' * 800_000, b'{"p": "' + b"\\\\" * 2_000_000 + b'"}'):
        t0 = time.perf_counter()
        protocol.json_depth(body)
        assert time.perf_counter() - t0 < 1.0


@pytest.mark.parametrize("header,ok", [
    ("application/json", True), ("application/json; charset=utf-8", True), ("APPLICATION/JSON;CHARSET=\"UTF-8\"", True),
    ("application/json; charset=utf-16", False), ("text/plain", False), ("application/jsonx", False),
    ("text/json", False), (None, False), ("", False), ("application/x-www-form-urlencoded", False),
])
def test_content_type(header, ok):
    if ok:
        protocol.check_content_type(header)
    else:
        with pytest.raises(ApiError) as e:
            protocol.check_content_type(header)
        assert e.value.status == 415


def test_parse_json_refusals_name_the_field():
    assert protocol.parse_json(b'{"a": [1.5, "\\u00e9"]}') == {"a": [1.5, "\u00e9"]}
    with pytest.raises(ApiError) as e:
        protocol.parse_json(b'{"a": {"b": [1, "\\ud800"]}}')
    assert e.value.param == "a.b[1]" and "Unicode" in e.value.message
    deepest = b'{"a": ' + b"[" * (protocol.MAX_JSON_DEPTH - 1) + b"]" * (protocol.MAX_JSON_DEPTH - 1) + b"}"
    assert protocol.json_depth(deepest) == protocol.MAX_JSON_DEPTH and protocol.parse_json(deepest)
    for bad in (
        b'{"b": ' + deepest + b"}",
        b'{"a": NaN}',
        b'{"a": -Infinity}',
        b'{"a": 1e999}',
        b"[1]",
        b'"x"',
        b"{",
        b"\xff",
    ):
        with pytest.raises(ApiError) as e:
            protocol.parse_json(bad)
        assert e.value.code == "invalid_json", bad


def test_validation_errors_as_the_client_wrote_them():
    cases = [
        ({"messages": [{"role": "user", "content": {"a": 1}}]}, "messages[0].content"),
        ({"messages": [{"role": "user", "content": [1]}]}, "messages[0].content[0]"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
        ({"messages": [{"role": "user"}], "stop": ["a", 3]}, "stop[1]"),
        ({"messages": [{"role": "user"}], "stream_options": {"include_usage": "yes"}}, "stream_options.include_usage"),
        ({"messages": [{"role": "user"}], "chat_template_kwargs": {"enable_thinking": 0}},
         "chat_template_kwargs.enable_thinking"),
    ]
    for data, path in cases:
        with pytest.raises(ValidationError) as e:
            protocol.ChatRequest.model_validate(data)
        err = protocol.validation_error(e.value, data)
        assert err.param == path and err.message.startswith(f"'{path}'"), (err.param, err.message)


def test_docs_render_the_ranges_table():
    """docs/serving.md shows the very table the validation reads."""
    from pathlib import Path

    doc = (Path(__file__).parents[2] / "docs" / "serving.md").read_text()
    table = doc.split("<!-- ranges: rendered by clover_export.serve.protocol.ranges_markdown() -->\n")[1]
    assert table.split("\n<!-- /ranges -->")[0] == protocol.ranges_markdown()
    assert f"nesting at most {protocol.MAX_JSON_DEPTH} levels" in doc
    assert f"a list of at most {protocol.MAX_STOP} strings" in doc
    for name in protocol.IGNORED:
        assert f"`{name}`" in doc
