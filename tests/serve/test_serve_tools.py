"""Tool calls on /v1/chat/completions with the official `openai` client (docs/serving.md, Tool calls).

Two servers: `clover-export serve` as a process (tools and tool messages through the template, against
transformers' rendering of the same conversation; a named tool_choice forcing the call's opening; bad
input; the embedded default calling the one tool it was trained on, and answering with its result), and one in
this process whose engine answers scripted Qwen3.6-format texts, split into blocks at awkward places, so the
parser's answers are known for every shape of call.
"""

from __future__ import annotations

import dataclasses
import json
import types

import httpx
import openai
import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState
from test_serve import ThreadServer

from clover_export.runtime.config import RuntimeConfig
from clover_export.serve import protocol
from clover_export.serve.app import ServeOptions, build_app
from clover_export.serve.engine import Engine
from clover_export.testing.server import start_server, stop_server
from clover_export.train import tasks

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "The weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                       "required": ["city"]}}},
    {"type": "function", "function": {
        "name": "sort_digits", "description": "Sorts the digits of a number",
        "parameters": {"type": "object", "properties": {"digits": {"type": "string"}}, "required": ["digits"]}}},
]
OFF = {"chat_template_kwargs": {"enable_thinking": False}}
HISTORY = [
    {"role": "system", "content": "You answer with tools."},
    {"role": "user", "content": "Sort 312."},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "sort_digits", "arguments": '{"digits": "312"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "123"},
    {"role": "user", "content": "And the weather in Paris for 2 days?"},
]


def as_template_sees_it(messages):
    """OpenAI's messages as Qwen's templates read them: arguments as objects (vLLM converts them alike)."""
    out = []
    for m in messages:
        m = {**m, "content": m.get("content") or ""}
        if "tool_calls" in m:
            m["tool_calls"] = [{**c, "function": {**c["function"], "arguments": json.loads(c["function"]["arguments"])}}
                               for c in m["tool_calls"]]
        out.append(m)
    return out


@pytest.fixture(scope="module")
def process_server():
    proc, url = start_server("--log-level", "warning")
    yield url
    stop_server(proc)


@pytest.fixture(scope="module")
def client(process_server):
    return openai.OpenAI(base_url=process_server + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def reference_tokenizer(tiny_dir):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(tiny_dir))


def reference_ids(reference_tokenizer, messages, opening="", tools=TOOLS):
    """The prompt's token ids as transformers renders the conversation (thinking off), an opening after it."""
    text = reference_tokenizer.apply_chat_template(as_template_sees_it(messages), tools=tools, tokenize=False,
                                                   add_generation_prompt=True, enable_thinking=False)
    return reference_tokenizer(text + opening, add_special_tokens=False)["input_ids"]


def test_tools_and_tool_messages_reach_the_template(client, reference_tokenizer):
    """An agent's second turn: tools, an assistant tool call (arguments a JSON string) and the tool's result.
    The server's prompt is transformers' rendering of the same conversation, token for token (its count)."""
    out = client.chat.completions.create(model="clover-tiny", messages=HISTORY, tools=TOOLS, max_tokens=4,
                                         extra_body=OFF)
    assert out.usage.prompt_tokens == len(reference_ids(reference_tokenizer, HISTORY))
    plain = client.chat.completions.create(model="clover-tiny", messages=HISTORY, max_tokens=4, extra_body=OFF)
    assert plain.usage.prompt_tokens == len(reference_ids(reference_tokenizer, HISTORY, tools=None))
    assert plain.usage.prompt_tokens < out.usage.prompt_tokens - 20  # the tools' section is in the prompt


def heldout(task: str, items: int):
    """A held-out example of the default's tool task (never trained on): the first of `task` and length."""
    return next(ex for ex in tasks.heldout_examples() if ex.task == task and ex.items == items)


@pytest.mark.parametrize("thinking", [False, True])
@pytest.mark.parametrize("task, items", [("sort", 5), ("reverse", 7)])
def test_the_default_calls_its_tool_then_answers_with_the_result(client, thinking, task, items):
    """The embedded default was trained on one tool task (train/tasks.py): offered digit tools, it calls the
    prompt's own with the prompt's list, finish_reason "tool_calls", streamed as OpenAI's deltas too; given
    the tool's result in a `tool` message, it answers with that result. The prompt is held out."""
    ex = heldout(task, items)
    tools = [tasks.tool_spec("sort"), tasks.tool_spec("reverse")]
    kw = dict(model="clover-tiny", messages=[{"role": "user", "content": ex.prompt}], tools=tools, max_tokens=160,
              temperature=0, extra_body={"chat_template_kwargs": {"enable_thinking": thinking}})
    out = client.chat.completions.create(**kw)
    choice = out.choices[0]
    (call,) = choice.message.tool_calls
    assert call.function.name == tasks.TOOL_NAMES[task]
    assert json.loads(call.function.arguments) == tasks.tool_case(ex).arguments
    assert choice.finish_reason == "tool_calls" and not (choice.message.content or "").strip()
    streamed, deltas = stream_final(client, **kw)
    (again,) = streamed.choices[0].message.tool_calls
    assert (again.function.name, again.function.arguments) == (call.function.name, call.function.arguments)
    assert deltas[0].function.name == call.function.name and streamed.choices[0].finish_reason == "tool_calls"
    sent = {"role": "assistant", "content": choice.message.content,
            "tool_calls": [{"id": call.id, "type": "function",
                            "function": {"name": call.function.name, "arguments": call.function.arguments}}]}
    result = {"role": "tool", "tool_call_id": call.id, "content": ex.answer}
    follow = client.chat.completions.create(**{**kw, "messages": [*kw["messages"], sent, result]})
    assert follow.choices[0].message.content.strip() == ex.answer and follow.choices[0].finish_reason == "stop"
    assert not follow.choices[0].message.tool_calls


def stream_final(client, **kw):
    """The streamed answer assembled by the openai library's own accumulator (the reasoning joined into the
    message's `reasoning_content`), and the raw tool-call deltas."""
    state, deltas, reasoning = ChatCompletionStreamState(), [], []
    for chunk in client.chat.completions.create(stream=True, **kw):
        state.handle_chunk(chunk)
        for choice in chunk.choices:
            deltas += choice.delta.tool_calls or []
            reasoning.append((choice.delta.model_extra or {}).get("reasoning_content") or "")
    final = state.get_final_completion()
    if any(reasoning):
        final.choices[0].message.model_extra["reasoning_content"] = "".join(reasoning)
    return final, deltas


def test_a_named_tool_choice_opens_the_call_on_the_real_model(client, reference_tokenizer):
    """tool_choice naming a function (the model's XML format): the answer is a call of that function under a
    grammar (the prompt: transformers' rendering, no opening written by the server), whatever the weights
    write (the default was never trained on `get_weather`); streamed, the same call."""
    bounded = json.loads(json.dumps(TOOLS))  # a bounded city: weights untrained for it may write on and on
    bounded[0]["function"]["parameters"]["properties"]["city"]["maxLength"] = 20
    kw = dict(model="clover-tiny", messages=HISTORY, tools=bounded, max_tokens=300, temperature=0,
              tool_choice={"type": "function", "function": {"name": "get_weather"}})
    out = client.chat.completions.create(**kw)
    assert out.usage.prompt_tokens == len(reference_ids(reference_tokenizer, HISTORY, tools=bounded))
    (call,) = out.choices[0].message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    assert isinstance(json.loads(call.function.arguments), dict)
    assert out.choices[0].finish_reason in ("tool_calls", "length")
    assert "reasoning_content" not in out.choices[0].message.model_extra  # a forced call: thinking off
    streamed, deltas = stream_final(client, **kw)
    (again,) = streamed.choices[0].message.tool_calls
    assert (again.function.name, again.function.arguments) == (call.function.name, call.function.arguments)
    assert deltas[0].id and deltas[0].function.name == "get_weather" and deltas[0].function.arguments == ""
    assert (streamed.choices[0].message.content or "") == (out.choices[0].message.content or "")
    assert streamed.choices[0].finish_reason == out.choices[0].finish_reason


def test_a_forced_call_needs_the_template_to_write_calls_in_the_parser_format(reference_tokenizer):
    """--tool-call-parser hermes on the embedded default (whose template writes XML calls): a named call's
    hermes opening (`<tool_call>\n{"name": ...`) is not what the template writes, so forcing it is a 400
    naming tool_choice; "required" opens with `<tool_call>\n`, which the template does write, and what the
    model writes after it is no hermes call, so it comes back as content; "auto" runs."""
    proc, url = start_server("--tool-call-parser", "hermes", "--log-level", "warning")
    try:
        body = {"messages": HI, "tools": TOOLS, "max_tokens": 4, **OFF}
        r = post(url, {**body, "tool_choice": {"type": "function", "function": {"name": "sort_digits"}}})
        assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice", r.text
        assert "constrained decoding" in r.json()["error"]["message"]
        r = post(url, {**body, "tool_choice": "required"})
        message = r.json()["choices"][0]["message"]
        assert r.status_code == 200 and message["content"].startswith("<tool_call>\n") and "tool_calls" not in message
        r = post(url, {**body, "tool_choice": "auto"})
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == len(reference_ids(reference_tokenizer,
                                                                                                  HI))
    finally:
        stop_server(proc)


def post(url, body):
    return httpx.post(url + "/v1/chat/completions", json=body, timeout=60)


HI = [{"role": "user", "content": "Hi"}]
BAD = [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "rm_rf"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tool_choice": {"type": "function", "function": {"name": "get_weather"}}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0].type"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "{}"}}]}, "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}] * 2}, "tools[1].function.name"),
    ({"tools": [{"type": "function", "function": {"name": f"f{i}"}} for i in range(protocol.MAX_TOOLS + 1)]},
     "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "description": "x" * protocol.MAX_TOOL_CHARS}}]},
     "tools[0]"),
    ({"tools": TOOLS, "tool_choice": "required", "chat_template_kwargs": {"enable_thinking": True}}, "tool_choice"),
    ({"messages": [*HI, {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{not json"}}]}]},
     "messages[1].tool_calls[0].function.arguments"),
    ({"messages": [*HI, {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "[1, 2]"}}]}]},
     "messages[1].tool_calls[0].function.arguments"),
    ({"messages": [*HI, {"role": "assistant", "content": "", "tool_calls": [{"id": "c"}]}]},
     "messages[1].tool_calls[0].function.name"),
]


@pytest.mark.parametrize("extra, param", BAD, ids=[p + f"-{i}" for i, (_, p) in enumerate(BAD)])
def test_bad_tools_and_tool_choice_are_400_naming_the_field(process_server, extra, param):
    r = post(process_server, {"messages": HI, "max_tokens": 4, **extra})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error", err
    assert r.json()["error"]["message"].startswith(f"'{param}'") or param == "tools[0].type", err


# --- a scripted model: the parser's answers are known ---------------------------------------------------------------
SCRIPT: list[str] = []  # the text the next request answers, in the pieces its blocks bring


def scripted_deliver(real):
    """Engine.deliver that, once the real request is done, hands over SCRIPT's pieces as its blocks and their
    text as its result (finish "stop")."""
    def deliver(self, job):
        h = job.handle
        if not h.done:
            h.chunks.clear()
            return None
        for piece in SCRIPT:
            job.post("block", types.SimpleNamespace(text=piece, finished=False, token_ids=[]))
        h.chunks.clear()
        h.result = dataclasses.replace(h.result, text="".join(SCRIPT), finish_reason="stop")
        return real(self, job)
    return deliver


@pytest.fixture(scope="module")
def scripted(tiny_dir):
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Engine, "deliver", scripted_deliver(Engine.deliver))
        app = build_app(ServeOptions(runtime=RuntimeConfig(max_slots=2), request_timeout_s=120))
        with ThreadServer(app) as srv:
            srv.wait_healthy()
            yield openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def ask(client, pieces, stream=False, **kw):
    SCRIPT[:] = pieces
    args = dict(model="clover-tiny", messages=HI, tools=TOOLS, max_tokens=2, **{"extra_body": OFF, **kw})
    if stream:
        return stream_final(client, **args)
    return client.chat.completions.create(**args)


WEATHER = ("I will look it up.\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nNew York\n</parameter>\n"
           "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>")
SORT = "\n<tool_call>\n<function=sort_digits>\n<parameter=digits>\n0312\n</parameter>\n</function>\n</tool_call>"


def pieces(text, at):
    cuts = [0, *at, len(text)]
    return [text[a:b] for a, b in zip(cuts, cuts[1:])]


def calls(message):
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []]


@pytest.mark.parametrize("stream", [False, True])
def test_calls_with_content_before_them(scripted, stream):
    # blocks cut inside the markers, a name, a value
    out = ask(scripted, pieces(WEATHER + SORT, [5, 22, 27, 49, 60, 95, 130, 150, 170]), stream)
    if stream:
        out, deltas = out
        assert [(d.index, bool(d.id), d.function.name) for d in deltas if d.id] == [(0, True, "get_weather"),
                                                                                    (1, True, "sort_digits")]
        assert all(d.id is None and d.function.name is None for d in deltas if not d.id)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "I will look it up."
    assert calls(choice.message) == [("get_weather", {"city": "New York", "days": 3}),
                                     ("sort_digits", {"digits": "0312"})]
    assert len({c.id for c in choice.message.tool_calls}) == 2


@pytest.mark.parametrize("stream", [False, True])
def test_parallel_tool_calls_false_keeps_the_first_call(scripted, stream):
    out = ask(scripted, pieces(WEATHER + SORT, [100, 180]), stream, parallel_tool_calls=False)
    out = out[0] if stream else out
    assert calls(out.choices[0].message) == [("get_weather", {"city": "New York", "days": 3})]


BADLY = "<tool_call>\n<function=launch_rockets>\n<parameter=count>\n3\n</parameter>\n</function>\n</tool_call>"


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("text, extra", [(BADLY, {}), (WEATHER, {"tool_choice": "none"})], ids=["unknown", "none"])
def test_a_bad_call_or_tool_choice_none_is_content(scripted, stream, text, extra):
    out = ask(scripted, pieces(text, [3, 40]), stream, **extra)
    out = out[0] if stream else out
    choice = out.choices[0]
    assert choice.message.content == text and not choice.message.tool_calls and choice.finish_reason == "stop"


@pytest.mark.parametrize("stream", [False, True])
def test_reasoning_then_a_call(scripted, stream):
    text = "The user wants weather.\n</think>\n\n" + WEATHER.split("\n\n", 1)[1]
    out = ask(scripted, pieces(text, [10, 30, 31, 60]), stream, extra_body={})
    out = out[0] if stream else out
    message = out.choices[0].message
    assert message.model_extra["reasoning_content"] == "The user wants weather."
    assert message.content in (None, "") and calls(message) == [("get_weather", {"city": "New York", "days": 3})]
