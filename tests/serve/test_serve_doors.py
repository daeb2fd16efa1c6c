"""The other front doors of `clover-export serve` (docs/serving.md: Anthropic Messages, OpenAI Responses, Tokenizer
endpoints, vLLM-compatible metrics), against a real server process with an API key, through the official clients.

Expected values come from elsewhere: the same greedy request through /v1/chat/completions on the same server (the
text must be equal), the `tokenizers` library reading the model's tokenizer.json, prompts written out by hand.
"""

from __future__ import annotations

import json

import anthropic
import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from test_serve import ThreadServer
from test_serve_tools import SCRIPT, SORT, TOOLS, WEATHER, heldout, pieces, scripted_deliver

from clover_export.runtime.config import RuntimeConfig
from clover_export.serve.app import ServeOptions, build_app
from clover_export.serve.doors import common, messages
from clover_export.serve.engine import Engine
from clover_export.testing.server import start_server, stop_server
from clover_export.train import tasks

KEY = "sk-clover-doors-7c2d"
MODEL = "clover-tiny"
BEARER = {"Authorization": f"Bearer {KEY}"}
SYSTEM = "Be brief."
SYSTEM_HI = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"  # the embedded ChatML template
HI = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]}
GREEDY = {"temperature": 0}  # the anthropic SDK no longer takes temperature as an argument; the API still does
QUESTION = "Please sort the list 3 1 2 4 9"  # the embedded model answers it greedily with a few words


@pytest.fixture(scope="module")
def server(tiny_dir):
    proc, url = start_server("--max-batch", "4", "--log-level", "warning", env={"CLOVER_API_KEY": KEY})
    try:
        yield url
        assert httpx.get(url + "/health", timeout=10).status_code == 200
    finally:
        log = stop_server(proc)
    assert proc.returncode == 0, log[-3000:]
    assert "Traceback" not in log, log[-3000:]


@pytest.fixture(scope="module")
def claude(server):
    return anthropic.Anthropic(base_url=server, api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=server + "/v1", api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def library(tiny_dir):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(tiny_dir / "tokenizer.json"))


def chat(server, chat_messages, max_tokens=40, thinking=None, **extra):
    """The same greedy request through /v1/chat/completions: (message, finish_reason, usage)."""
    body = {"messages": chat_messages, "max_tokens": max_tokens, "temperature": 0, **extra}
    if thinking is not None:
        body["chat_template_kwargs"] = {"enable_thinking": thinking}
    r = httpx.post(server + "/v1/chat/completions", json=body, headers=BEARER, timeout=120)
    assert r.status_code == 200, r.text
    out = r.json()
    return out["choices"][0]["message"], out["choices"][0]["finish_reason"], out["usage"]


def post(server, path, body, headers=None):
    return httpx.post(server + path, json=body, headers=BEARER if headers is None else headers, timeout=120)


# --- /v1/messages: the anthropic SDK -----------------------------------------------------------------------------
def texts(message) -> str:
    return "".join(b.text for b in message.content if b.type == "text")


@pytest.mark.parametrize("thinking", [None, {"type": "enabled", "budget_tokens": 1024}, {"type": "disabled"}])
def test_messages_create_answers_as_chat_completions(server, claude, thinking):
    kw = {"thinking": thinking} if thinking else {}
    out = claude.messages.create(model=MODEL, max_tokens=40, extra_body=GREEDY,
                                 messages=[{"role": "user", "content": QUESTION}], **kw)
    flag = None if thinking is None else thinking["type"] == "enabled"
    msg, finish, use = chat(server, [{"role": "user", "content": QUESTION}], thinking=flag)
    assert msg["content"] and texts(out) == msg["content"]
    thought = "".join(b.thinking for b in out.content if b.type == "thinking")
    assert thought == msg.get("reasoning_content", "")
    assert out.stop_reason == {"stop": "end_turn", "length": "max_tokens"}[finish]
    assert out.usage.input_tokens + out.usage.cache_read_input_tokens == use["prompt_tokens"]
    assert out.usage.output_tokens == use["completion_tokens"]
    assert (out.model, out.role, out.type) == (MODEL, "assistant", "message") and out.id.startswith("msg_")


@pytest.mark.parametrize("thinking,opening", [({"type": "disabled"}, "<think>\n\n</think>\n\n"),
                                              ({"type": "enabled", "budget_tokens": 1024}, "<think>\n")])
def test_system_and_thinking_render_as_the_template_writes_them(server, claude, library, thinking, opening):
    """The prompt written out by hand (the embedded ChatML template): the system prompt as blocks, thinking on or
    off; its token count is the answer's input tokens."""
    out = claude.messages.create(model=MODEL, max_tokens=4, extra_body=GREEDY, thinking=thinking,
                                 system=[{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}],
                                 messages=[{"role": "user", "content": "Hi"}])
    prompt = f"{SYSTEM_HI}<|im_start|>assistant\n{opening}"
    assert out.usage.input_tokens + out.usage.cache_read_input_tokens == len(library.encode(prompt).ids)


def test_messages_stream_is_anthropics_event_sequence_and_the_same_answer(server, claude):
    args = dict(model=MODEL, max_tokens=40, extra_body=GREEDY, messages=[{"role": "user", "content": QUESTION}])
    whole = claude.messages.create(**args)
    with claude.messages.stream(**args) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == texts(whole) == texts(final)
    assert (final.stop_reason, final.usage.output_tokens) == (whole.stop_reason, whole.usage.output_tokens)
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens == \
        whole.usage.input_tokens + whole.usage.cache_read_input_tokens
    raw_body = {"model": MODEL, "max_tokens": 40, "messages": args["messages"], "stream": True, **GREEDY}
    with httpx.stream("POST", server + "/v1/messages", json=raw_body, headers={"x-api-key": KEY}, timeout=120) as r:
        raw = r.read().decode()
    events = [dict(line.split(": ", 1) for line in e.split("\n")) for e in raw.strip().split("\n\n")]
    names = [e["event"] for e in events]
    assert names[:3] == ["message_start", "ping", "content_block_start"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert all(json.loads(e["data"])["type"] == e["event"] for e in events)


def test_prefix_cache_reads_count_as_cache_read_input_tokens(server, claude):
    """The same long prompt twice: the second reads most of it from the prefix cache, and says so."""
    long = "Tell me about the list " + " ".join(str(i % 10) for i in range(200))
    args = dict(model=MODEL, max_tokens=4, extra_body=GREEDY, messages=[{"role": "user", "content": long}])
    first, second = claude.messages.create(**args), claude.messages.create(**args)
    total = first.usage.input_tokens + first.usage.cache_read_input_tokens
    assert second.usage.input_tokens + second.usage.cache_read_input_tokens == total
    assert second.usage.cache_read_input_tokens > total // 2 and second.usage.input_tokens < total // 2


def test_stop_sequences_and_max_tokens_stop_reasons(server, claude):
    msg, _, _ = chat(server, [{"role": "user", "content": QUESTION}])
    full = msg["content"]
    stop = full.split()[2]  # a word from the middle of the answer
    out = claude.messages.create(model=MODEL, max_tokens=40, extra_body=GREEDY, stop_sequences=["@@never@@", stop],
                                 messages=[{"role": "user", "content": QUESTION}])
    assert (out.stop_reason, out.stop_sequence) == ("stop_sequence", stop)
    assert texts(out) == full[:full.index(stop)].strip()
    short = claude.messages.create(model=MODEL, max_tokens=3, extra_body=GREEDY,
                                   messages=[{"role": "user", "content": QUESTION}])
    assert (short.stop_reason, short.stop_sequence, short.usage.output_tokens) == ("max_tokens", None, 3)


def test_tool_history_and_tools_reach_the_chat_path(server, claude, oai):
    """tool_use / tool_result blocks and the tools become the OpenAI chat request written here by hand: the same
    prompt."""
    tools = [{"name": "sort", "description": "Sort numbers", "input_schema": {
        "type": "object", "properties": {"xs": {"type": "array", "items": {"type": "integer"}}}, "required": ["xs"]}}]
    history = [{"role": "user", "content": QUESTION},
               {"role": "assistant", "content": [{"type": "text", "text": "Sorting."},
                                                 {"type": "tool_use", "id": "t1", "name": "sort",
                                                  "input": {"xs": [3, 1, 2]}}]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "1 2 3"},
                                            {"type": "text", "text": "Thanks"}]}]
    openai_messages = [{"role": "user", "content": QUESTION},
                       {"role": "assistant", "content": "Sorting.", "tool_calls": [
                           {"id": "t1", "type": "function",
                            "function": {"name": "sort", "arguments": '{"xs": [3, 1, 2]}'}}]},
                       {"role": "tool", "tool_call_id": "t1", "content": "1 2 3"},
                       {"role": "user", "content": "Thanks"}]
    msg, _, use = chat(server, openai_messages, max_tokens=8, tools=[as_chat_tool(tools[0])])
    for choice in ({"type": "auto"}, {"type": "none"}):  # forcing a call opens the answer: see below
        out = claude.messages.create(model=MODEL, max_tokens=8, extra_body=GREEDY, tools=tools, tool_choice=choice,
                                     messages=history)
        assert out.usage.input_tokens + out.usage.cache_read_input_tokens == use["prompt_tokens"]
        assert texts(out) == msg["content"]
    with pytest.raises(anthropic.BadRequestError) as e:
        claude.messages.create(model=MODEL, max_tokens=8, tools=tools, tool_choice={"type": "tool", "name": "nope"},
                               messages=history)
    assert e.value.body["error"]["type"] == "invalid_request_error" and '"nope"' in e.value.body["error"]["message"]


SORT_TOOL = {"name": "sort_digits", "description": "Sorts the digits of a number",
             "input_schema": {"type": "object", "properties": {"digits": {"type": "string", "maxLength": 8}},
                              "required": ["digits"]}}  # bounded: a forced call is decoded under its grammar
REVERSE_TOOL = dict(SORT_TOOL, name="reverse_digits", description="Reverses the digits of a number")
SORT_ASK = [{"role": "user", "content": "Sort the digits of 3142."}]


def as_chat_tool(tool):
    return {"type": "function", "function": {"name": tool["name"], "description": tool["description"],
                                             "parameters": tool["input_schema"]}}


def without_ids(message):
    """A message's dump less what differs between two runs of one request: its id, its tool calls' ids (fresh
    per request) and the prefix cache's split of the prompt (their sum stays)."""
    body = message.model_dump()
    body.pop("id")
    for block in body["content"]:
        block.pop("id", None)
    use = body.pop("usage")
    return body, use["input_tokens"] + use["cache_read_input_tokens"], use["output_tokens"]


def tool_uses(message):
    return [(b.name, b.input) for b in message.content if b.type == "tool_use"]


@pytest.mark.parametrize("choice", [{"type": "tool", "name": "sort_digits"}, {"type": "any"}])
def test_a_forced_tool_answers_as_the_chat_path_streamed_or_not(server, claude, choice):
    """tool_choice `tool` (`any`) on the embedded default is the chat path's forced
    call (named, "required"): the same prompt, the same calls as `tool_use` blocks (`input` the arguments'
    object), the same text, the stop reason of its finish_reason (tool_calls -> tool_use, length -> max_tokens),
    no thinking (a forced call opens the turn); messages.stream accumulates the same message. Named, the
    answer opens with a `tool_use` block of that tool, whatever the weights write after its opening."""
    args = dict(model=MODEL, max_tokens=120, extra_body=GREEDY, tools=[SORT_TOOL, REVERSE_TOOL], tool_choice=choice,
                messages=SORT_ASK)
    out = claude.messages.create(**args)
    forced = {"type": "function", "function": {"name": "sort_digits"}} if choice["type"] == "tool" else "required"
    msg, finish, usage = chat(server, SORT_ASK, max_tokens=120, tools=[as_chat_tool(SORT_TOOL),
                                                                        as_chat_tool(REVERSE_TOOL)],
                              tool_choice=forced)
    calls = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in msg.get("tool_calls") or []]
    assert tool_uses(out) == calls and texts(out) == (msg["content"] or "")
    assert out.stop_reason == {"tool_calls": "tool_use", "length": "max_tokens", "stop": "end_turn"}[finish]
    assert out.usage.input_tokens + out.usage.cache_read_input_tokens == usage["prompt_tokens"]
    assert not [b for b in out.content if b.type == "thinking"]
    if choice["type"] == "tool":
        use = out.content[0]
        assert use.type == "tool_use" and use.name == "sort_digits" and isinstance(use.input, dict)
        assert use.id.startswith("call_")
    with claude.messages.stream(**args) as stream:
        final = stream.get_final_message()
    assert without_ids(final) == without_ids(out)


def test_the_default_uses_its_tool_through_the_messages_door(server, claude):
    """The tool task the embedded default was trained on (train/tasks.py), as an Anthropic agent runs it: a
    `tool_use` block of the prompt's tool with the prompt's list (stop_reason tool_use), then, after the
    `tool_result`, the result as text (end_turn). The prompt is held out."""
    ex = heldout("reverse", 6)
    specs = [tasks.tool_spec("sort")["function"], tasks.tool_spec("reverse")["function"]]
    tools = [{"name": f["name"], "description": f["description"], "input_schema": f["parameters"]} for f in specs]
    ask = [{"role": "user", "content": ex.prompt}]
    out = claude.messages.create(model=MODEL, max_tokens=160, extra_body=GREEDY, tools=tools, messages=ask,
                                 thinking={"type": "disabled"})
    (use,) = [b for b in out.content if b.type == "tool_use"]
    want = ("reverse_digits", tasks.tool_case(ex).arguments, "tool_use")
    assert (use.name, use.input, out.stop_reason) == want
    turn = [*ask, {"role": "assistant", "content": out.content},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": ex.answer}]}]
    again = claude.messages.create(model=MODEL, max_tokens=160, extra_body=GREEDY, tools=tools, messages=turn,
                                   thinking={"type": "disabled"})
    assert texts(again).strip() == ex.answer and again.stop_reason == "end_turn"


def test_a_forced_tool_with_thinking_on_is_refused(server, claude):
    with pytest.raises(anthropic.BadRequestError) as e:
        claude.messages.create(model=MODEL, max_tokens=8, tools=[SORT_TOOL], messages=SORT_ASK,
                               tool_choice={"type": "tool", "name": "sort_digits"},
                               thinking={"type": "enabled", "budget_tokens": 1024})
    assert e.value.body["error"]["type"] == "invalid_request_error"
    assert "'tool_choice'" in e.value.body["error"]["message"]


def test_count_tokens_is_the_prompt_of_the_same_messages_request(server, claude, library):
    """messages.count_tokens: the ChatML prompt written out by hand; with tools and a forced tool, the prompt
    /v1/messages feeds the model for the same request (its usage); Anthropic's errors, the key as x-api-key."""
    counted = claude.messages.count_tokens(model=MODEL, system=SYSTEM, messages=[{"role": "user", "content": "Hi"}],
                                           thinking={"type": "disabled"})
    assert counted.input_tokens == len(library.encode(f"{SYSTEM_HI}<|im_start|>assistant\n<think>\n\n</think>\n\n").ids)
    args = dict(model=MODEL, tools=[SORT_TOOL, REVERSE_TOOL], tool_choice={"type": "tool", "name": "reverse_digits"},
                messages=SORT_ASK)
    out = claude.messages.create(max_tokens=2, **args)
    assert claude.messages.count_tokens(**args).input_tokens == \
        out.usage.input_tokens + out.usage.cache_read_input_tokens
    r = post(server, "/v1/messages/count_tokens", {"model": MODEL, "messages": []}, {"x-api-key": KEY})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", r.text
    assert "'messages'" in r.json()["error"]["message"]
    r = post(server, "/v1/messages/count_tokens", {"model": MODEL, "messages": SORT_ASK}, {"x-api-key": "wrong"})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"


HOSTILE_MESSAGES = {
    "temperature-above-anthropic-range": ({"temperature": 1.5}, "temperature"),
    "no-max-tokens": ({"max_tokens": None}, "max_tokens"),
    "zero-max-tokens": ({"max_tokens": 0}, "max_tokens"),
    "empty-messages": ({"messages": []}, "messages"),
    "image-block": ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
                    "messages[0].content[0]"),
    "tool-use-from-the-user": ({"messages": [{"role": "user", "content": [
        {"type": "tool_use", "id": "x", "name": "f", "input": {}}]}]}, "messages[0].content"),
    "prefill": ({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}, "messages"),
    "unknown-field": ({"frequency_penalty": 1}, "frequency_penalty"),
    "string-for-int": ({"max_tokens": "40"}, "max_tokens"),
    "bad-decoding": ({"decoding": "magic"}, "decoding"),
    "server-tool": ({"tools": [{"type": "web_search_20250305", "name": "web_search", "input_schema": {}}]},
                    "tools[0].type"),
    "two-tools-of-one-name": ({"tools": [SORT_TOOL, SORT_TOOL]}, "tools[1].name"),
    "over-the-context": ({"max_tokens": 10 ** 6}, None),
    "schema-that-does-not-compile": ({"output_config": {"format": {"type": "json_schema", "schema": {
        "type": "string", "format": "nope"}}}}, "output_config.format.schema"),
}


@pytest.mark.parametrize("change,field", [(c, f"'{f}'" if f else "lower max_tokens")
                                          for c, f in HOSTILE_MESSAGES.values()], ids=HOSTILE_MESSAGES.keys())
def test_hostile_messages_bodies_are_anthropic_400s_and_the_next_request_is_answered(server, change, field):
    body = {"model": MODEL, "max_tokens": 8, "messages": [{"role": "user", "content": "Hi"}], **change}
    body = {k: v for k, v in body.items() if v is not None}
    r = post(server, "/v1/messages", body, {"x-api-key": KEY})
    assert r.status_code == 400, r.text
    assert r.json()["type"] == "error" and r.json()["error"]["type"] == "invalid_request_error"
    assert field in r.json()["error"]["message"], r.json()
    ok = post(server, "/v1/messages", HI)
    assert ok.status_code == 200 and ok.json()["type"] == "message"


def test_messages_errors_are_anthropics_and_the_key_is_one_credential(server, claude):
    with pytest.raises(anthropic.NotFoundError) as e:
        claude.messages.create(model="claude-x", max_tokens=8, messages=[{"role": "user", "content": "Hi"}])
    assert e.value.body["error"]["type"] == "not_found_error"
    wrong = anthropic.Anthropic(base_url=server, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as e:
        wrong.messages.create(model=MODEL, max_tokens=8, messages=[{"role": "user", "content": "Hi"}])
    assert e.value.body == {"type": "error", "error": {"type": "authentication_error",
                                                      "message": "incorrect API key provided"}}
    body = HI
    assert post(server, "/v1/messages", body, BEARER).status_code == 200  # the Bearer form works here too
    both = post(server, "/v1/messages", body, {**BEARER, "x-api-key": KEY})
    assert both.status_code == 401 and "more than one" in both.json()["error"]["message"]
    # x-api-key is Anthropic's header: the OpenAI endpoints still want Authorization
    r = post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}, {"x-api-key": KEY})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    broken = {**BEARER, "content-type": "application/json"}
    r = httpx.post(server + "/v1/messages", content=b'{"model": ', headers=broken, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"


def test_the_messages_writer_folds_pieces_into_blocks_the_sdk_reads():
    """Reasoning, text and tool-call pieces (a sequence the engine cannot yet produce) through the Writer: the
    anthropic SDK's own accumulator rebuilds from the events the same message as the whole body."""
    from anthropic.lib.streaming._messages import accumulate_event
    from anthropic.types import Message, RawMessageStreamEvent
    from pydantic import TypeAdapter

    from clover_export.runtime.output import Result

    pieces = [common.Piece(common.REASONING, "Let me "), common.Piece(common.REASONING, "think."),
              common.Piece(common.TEXT, "Calling."), common.Piece(common.TOOL_START, name="sort", id="toolu_1"),
              common.Piece(common.TOOL_ARGS, '{"xs": [3,'), common.Piece(common.TOOL_ARGS, " 1]}"),
              common.Piece(common.TEXT, "Done.")]
    res = Result(request_id=0, token_ids=[1] * 9, text="", finish_reason="stop", prompt_tokens=20,
                 response_tokens=9, denoise_steps=1, blocks=1, tokens_per_forward=1, forwards_per_block=1,
                 distinct_experts_per_block=1, wall_time_s=0, cached_tokens=5)
    call = common.Call(sub=type("Sub", (), {"id": "abc"})(), model=MODEL)
    writer = messages.Writer(call)
    events = writer.start(20) + [e for p in pieces for e in writer.feed(p)] + writer.finish(common.Outcome(res))
    body = Message.model_validate(writer.body(common.Outcome(res)))
    snapshot, bufs = None, {}
    for _, data in events:
        if data["type"] != "ping":
            snapshot = accumulate_event(event=TypeAdapter(RawMessageStreamEvent).validate_python(data),
                                        current_snapshot=snapshot, json_bufs=bufs)
    assert [b.type for b in body.content] == ["thinking", "text", "tool_use", "text"]
    assert body.content[0].thinking == "Let me think." and body.content[2].input == {"xs": [3, 1]}
    assert (body.stop_reason, body.usage.input_tokens, body.usage.cache_read_input_tokens) == ("tool_use", 15, 5)
    assert snapshot.model_dump() == body.model_dump()


# --- /v1/responses: the openai client ------------------------------------------------------------------------------
def test_responses_create_answers_as_chat_completions(server, oai, library):
    msg, finish, use = chat(server, [{"role": "user", "content": QUESTION}])  # its prompt now in the prefix cache
    out = oai.responses.create(model=MODEL, input=QUESTION, temperature=0, max_output_tokens=40)
    _, _, again = chat(server, [{"role": "user", "content": QUESTION}])  # as much read from the cache
    assert msg["content"] and out.output_text == msg["content"]
    assert out.status == {"stop": "completed", "length": "incomplete"}[finish]
    assert (out.usage.input_tokens, out.usage.output_tokens) == (use["prompt_tokens"], use["completion_tokens"])
    assert out.usage.input_tokens_details.cached_tokens == again["prompt_tokens_details"]["cached_tokens"] > 0
    assert out.model == MODEL and out.id.startswith("resp_")
    hand = SYSTEM_HI + "<|im_start|>assistant\n<think>\n"
    told = oai.responses.create(model=MODEL, instructions=SYSTEM, input="Hi", max_output_tokens=1)
    assert told.usage.input_tokens == len(library.encode(hand).ids)
    short = oai.responses.create(model=MODEL, input=QUESTION, temperature=0, max_output_tokens=3)
    assert (short.status, short.incomplete_details.reason, short.usage.output_tokens) == \
        ("incomplete", "max_output_tokens", 3)


def test_responses_stream_is_the_same_answer_in_order(server, oai):
    args = dict(model=MODEL, input=[{"role": "user", "content": QUESTION}], temperature=0, max_output_tokens=40)
    whole = oai.responses.create(**args)
    events = list(oai.responses.create(**args, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text == events[-1].response.output_text
    assert events[-1].response.usage.output_tokens == whole.usage.output_tokens


def test_function_call_items_round_trip_as_chat_tool_messages(server, oai):
    tools = [{"type": "function", "name": "sort", "description": "Sort numbers",
              "parameters": {"type": "object", "properties": {"xs": {"type": "array"}}}}]
    items = [{"role": "user", "content": QUESTION},
             {"type": "function_call", "call_id": "c1", "name": "sort", "arguments": '{"xs": [3, 1, 2]}'},
             {"type": "function_call_output", "call_id": "c1", "output": "1 2 3"}]
    openai_messages = [{"role": "user", "content": QUESTION},
                       {"role": "assistant", "content": "", "tool_calls": [
                           {"id": "c1", "type": "function",
                            "function": {"name": "sort", "arguments": '{"xs": [3, 1, 2]}'}}]},
                       {"role": "tool", "tool_call_id": "c1", "content": "1 2 3"}]
    chat_tools = [{"type": "function", "function": {k: v for k, v in tools[0].items() if k != "type"}}]
    msg, _, use = chat(server, openai_messages, max_tokens=8, tools=chat_tools)
    out = oai.responses.create(model=MODEL, input=items, tools=tools, tool_choice="auto", temperature=0,
                               max_output_tokens=8)
    assert out.usage.input_tokens == use["prompt_tokens"] and out.output_text == msg["content"]


FUNCTIONS = [{"type": "function", "name": t["name"], "description": t["description"], "parameters": t["input_schema"]}
             for t in (SORT_TOOL, REVERSE_TOOL)]


def test_a_named_function_is_a_function_call_item_and_its_output_round_trips(server, oai):
    """tool_choice naming a function: the output opens with a `function_call` item of it, streamed (the events'
    deltas and the completed response) as not, with the chat path's arguments for the same forced request; the
    call and its output sent back are the conversation /tokenize counts for the chat messages written by hand."""
    args = dict(model=MODEL, input=SORT_ASK[0]["content"], tools=FUNCTIONS, temperature=0, max_output_tokens=120,
                tool_choice={"type": "function", "name": "sort_digits"})
    out = oai.responses.create(**args)
    call = out.output[0]
    assert (call.type, call.name, call.status) == ("function_call", "sort_digits", "completed")
    assert isinstance(json.loads(call.arguments), dict) and call.call_id.startswith("call_")
    msg, _, _ = chat(server, SORT_ASK, max_tokens=120, tools=[as_chat_tool(t) for t in (SORT_TOOL, REVERSE_TOOL)],
                     tool_choice={"type": "function", "function": {"name": "sort_digits"}})
    assert call.arguments == msg["tool_calls"][0]["function"]["arguments"]
    events = list(oai.responses.create(**args, stream=True))
    streamed = events[-1].response.output[0]
    assert (streamed.type, streamed.name, streamed.arguments) == ("function_call", "sort_digits", call.arguments)
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    (done,) = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert deltas == done.arguments == call.arguments
    assert [e.sequence_number for e in events] == list(range(len(events)))
    sent_back = [{"role": "user", "content": SORT_ASK[0]["content"]},
                 {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
                 {"type": "function_call_output", "call_id": call.call_id, "output": "1234"}]
    answer = oai.responses.create(model=MODEL, input=sent_back, tools=FUNCTIONS, temperature=0, max_output_tokens=8)
    assert answer.status in ("completed", "incomplete")  # output may be empty: the weights answer as they will
    called = {"name": call.name, "arguments": call.arguments}
    by_hand = [SORT_ASK[0], {"role": "assistant", "content": "", "tool_calls": [
                   {"id": call.call_id, "type": "function", "function": called}]},
               {"role": "tool", "tool_call_id": call.call_id, "content": "1234"}]
    counted = post(server, "/tokenize", {"messages": by_hand, "tools": [as_chat_tool(t) for t in (SORT_TOOL,
                                                                                                 REVERSE_TOOL)]})
    assert answer.usage.input_tokens == counted.json()["count"]


@pytest.mark.parametrize("change,param,says", [
    ({"store": True}, "store", "keeps no responses"),
    ({"previous_response_id": "resp_1"}, "previous_response_id", "keeps no responses"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "string", "format": "nope"}}}},
     "text.format.schema", "'text.format.schema'"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type", "'tools[0].type'"),
    ({"tool_choice": {"type": "function", "name": "nope"}}, "tool_choice.name", '"nope"'),
    ({"tools": FUNCTIONS[:1] * 2}, "tools[1].name", "'tools[1].name' repeats"),
    ({"max_output_tokens": 10 ** 6}, "input", "lower max_output_tokens"),
    ({"input": []}, "input", "'input'"),
    ({"temperature": 3}, "temperature", "'temperature'"),
])
def test_hostile_responses_bodies_are_openai_400s(server, change, param, says):
    r = post(server, "/v1/responses", {"model": MODEL, "input": "Hi", "max_output_tokens": 4, **change})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and says in r.json()["error"]["message"], r.json()
    assert post(server, "/v1/responses", {"input": "Hi", "max_output_tokens": 2}).json()["object"] == "response"


# --- both doors on a scripted model (test_serve_tools: the engine answers Qwen3.6-format texts) ---------------------
SCRIPTED_CALLS = [("get_weather", {"city": "New York", "days": 3}), ("sort_digits", {"digits": "0312"})]
CUTS = [5, 22, 27, 49, 60, 95, 130, 150, 170]  # blocks cut inside the markers, a name, a value


@pytest.fixture(scope="module")
def scripted(tiny_dir):
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Engine, "deliver", scripted_deliver(Engine.deliver))
        with ThreadServer(build_app(ServeOptions(runtime=RuntimeConfig(max_slots=2), request_timeout_s=120))) as srv:
            srv.wait_healthy()
            yield srv.url


def ask_claude(url, text, stream, **kw):
    """The scripted answer to `text` through /v1/messages (thinking off), whole or accumulated by the SDK."""
    SCRIPT[:] = pieces(text, [c for c in CUTS if c < len(text)])
    client = anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0, timeout=120)
    tools = [{"name": t["function"]["name"], "description": t["function"]["description"],
              "input_schema": t["function"]["parameters"]} for t in TOOLS]
    args = dict(model=MODEL, max_tokens=2, tools=tools, thinking={"type": "disabled"},
                messages=[{"role": "user", "content": "Hi"}], **kw)
    if not stream:
        return client.messages.create(**args)
    with client.messages.stream(**args) as s:
        return s.get_final_message()


@pytest.mark.parametrize("stream", [False, True])
def test_messages_tool_use_blocks_after_text_and_two_calls(scripted, stream):
    out = ask_claude(scripted, WEATHER + SORT, stream)
    assert [b.type for b in out.content] == ["text", "tool_use", "tool_use"]
    assert texts(out) == "I will look it up." and tool_uses(out) == SCRIPTED_CALLS
    assert out.stop_reason == "tool_use" and len({b.id for b in out.content[1:]}) == 2


@pytest.mark.parametrize("stream", [False, True])
def test_messages_disable_parallel_tool_use_keeps_the_first_call(scripted, stream):
    out = ask_claude(scripted, WEATHER + SORT, stream, tool_choice={"type": "auto", "disable_parallel_tool_use": True})
    assert tool_uses(out) == SCRIPTED_CALLS[:1] and out.stop_reason == "tool_use"


@pytest.mark.parametrize("stream", [False, True])
def test_messages_tool_choice_none_leaves_a_call_as_text(scripted, stream):
    out = ask_claude(scripted, WEATHER, stream, tool_choice={"type": "none"})
    assert texts(out) == WEATHER and not tool_uses(out) and out.stop_reason == "end_turn"


def responses_output(events):
    """The output items rebuilt from a Responses stream's item and delta events alone: (type, text or
    (name, call_id, arguments)) per item."""
    items: dict[int, list] = {}
    for e in events:
        if e.type == "response.output_item.added":
            items[e.output_index] = [e.item.type, getattr(e.item, "name", None), getattr(e.item, "call_id", None), ""]
        elif e.type in ("response.output_text.delta", "response.function_call_arguments.delta"):
            items[e.output_index][3] += e.delta
    return [(kind, text) if kind == "message" else (kind, (name, call_id, text))
            for kind, name, call_id, text in (items[i] for i in sorted(items))]


def as_output(response):
    return [(o.type, o.content[0].text) if o.type == "message" else (o.type, (o.name, o.call_id, o.arguments))
            for o in response.output]


def test_responses_function_call_items_after_text_and_two_calls(scripted):
    SCRIPT[:] = pieces(WEATHER + SORT, CUTS)
    client = openai.OpenAI(base_url=scripted + "/v1", api_key="unused", max_retries=0, timeout=120)
    tools = [{"type": "function", **t["function"]} for t in TOOLS]
    args = dict(model=MODEL, input="Hi", tools=tools, max_output_tokens=2, reasoning={"effort": "none"})
    out = client.responses.create(**args)
    (kinds, first), *calls = as_output(out)
    assert (kinds, first) == ("message", "I will look it up.") and out.status == "completed"
    assert [(kind, name, json.loads(arguments)) for kind, (name, _, arguments) in calls] == \
        [("function_call", name, arguments) for name, arguments in SCRIPTED_CALLS]
    assert len({call_id for _, (_, call_id, _) in calls}) == 2
    events = list(client.responses.create(**args, stream=True))
    streamed = as_output(events[-1].response)
    assert responses_output(events) == streamed
    assert [(k, v if k == "message" else (v[0], v[2])) for k, v in streamed] == \
        [(k, v if k == "message" else (v[0], v[2])) for k, v in as_output(out)]


# --- /tokenize and /detokenize -------------------------------------------------------------------------------------
def test_tokenize_is_the_tokenizers_ids_and_detokenize_round_trips(server, library):
    text = "The answer is 42, isn't it?"
    r = post(server, "/tokenize", {"model": MODEL, "prompt": text, "return_token_strs": True})
    ids = library.encode(text, add_special_tokens=True).ids
    assert r.json() == {"count": len(ids), "max_model_len": r.json()["max_model_len"], "tokens": ids,
                        "token_strs": [library.id_to_token(i) for i in ids]}
    assert r.json()["max_model_len"] > 0
    assert post(server, "/detokenize", {"model": MODEL, "tokens": ids}).json() == {"prompt": library.decode(ids)}
    assert library.decode(ids) == text  # the round trip is exact for plain text
    # messages: the chat prompt written out by hand (the embedded ChatML template, thinking on by default)
    hand = SYSTEM_HI + "<|im_start|>assistant\n<think>\n"
    system_hi = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hi"}]
    r = post(server, "/tokenize", {"messages": system_hi})
    assert r.json()["tokens"] == library.encode(hand).ids and r.json()["token_strs"] is None
    _, _, use = chat(server, system_hi, max_tokens=1)
    assert r.json()["count"] == use["prompt_tokens"]


def test_tokenize_with_tools_is_the_chat_paths_prompt(server):
    """Tools (one with no parameters, one whose description holds a control-token string) and an assistant's
    call whose arguments are a JSON string: /tokenize counts the prompt /v1/chat/completions feeds the model."""
    tools = [{"type": "function", "function": {"name": "now", "description": "The time"}},
             {"type": "function", "function": {"name": "sort_digits", "description": "Sorts <|im_end|> digits",
                                               "parameters": SORT_TOOL["input_schema"]}}]
    history = [SORT_ASK[0], {"role": "assistant", "content": "", "tool_calls": [
                   {"id": "c1", "type": "function", "function": {"name": "sort_digits",
                                                                 "arguments": '{"digits": "3142"}'}}]},
               {"role": "tool", "tool_call_id": "c1", "content": "1234"}]
    _, _, use = chat(server, history, max_tokens=1, tools=tools)
    counted = post(server, "/tokenize", {"messages": history, "tools": tools})
    assert counted.status_code == 200 and counted.json()["count"] == use["prompt_tokens"], counted.text
    bare = post(server, "/tokenize", {"messages": history}).json()["count"]
    assert bare < use["prompt_tokens"] - 30  # the tools' section (a line a tool) is counted


@pytest.mark.parametrize("path,body,param", [
    ("/tokenize", {"messages": SORT_ASK, "tools": [{"type": "function", "function": {"description": "x"}}]},
     "tools[0].function.name"),
    ("/tokenize", {}, "prompt"),
    ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, "prompt"),
    ("/tokenize", {"prompt": 5}, "prompt"),
    ("/detokenize", {"tokens": [1, 10 ** 9]}, "tokens"),
    ("/detokenize", {"tokens": [-1]}, "tokens"),
    ("/detokenize", {"tokens": "12"}, "tokens"),
    ("/detokenize", {"tokens": [1], "model": "other"}, "model"),
])
def test_tokenizer_endpoints_refuse_bad_bodies_and_need_the_key(server, path, body, param):
    r = post(server, path, body)
    assert r.status_code in (400, 404) and r.json()["error"]["param"] == param, r.text
    assert post(server, path, {"prompt": "x", "tokens": [1]}, {}).status_code == 401


# --- vllm: metrics --------------------------------------------------------------------------------------------------
VLLM = ["vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:time_to_first_token_seconds",
        "vllm:inter_token_latency_seconds", "vllm:request_time_per_output_token_seconds",
        "vllm:e2e_request_latency_seconds", "vllm:prompt_tokens", "vllm:generation_tokens",
        "vllm:prefix_cache_queries", "vllm:prefix_cache_hits", "vllm:spec_decode_num_drafts",
        "vllm:spec_decode_num_draft_tokens", "vllm:spec_decode_num_accepted_tokens", "vllm:request_success"]


def scrape(server) -> dict[str, float]:
    """{sample name + sorted labels: value} of the model's vllm: series, read by Prometheus' own parser."""
    text = httpx.get(server + "/metrics", timeout=30).text
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.startswith("vllm:"):
                assert s.labels["model_name"] == MODEL
                labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "model_name")
                out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def test_vllm_metrics_are_there_and_move_with_a_request(server, oai):
    before = scrape(server)
    families = {name.split("{")[0].removesuffix("_total").removesuffix("_count") for name in before}
    assert set(VLLM) <= families, set(VLLM) - families
    out = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": QUESTION}], max_tokens=40,
                                      temperature=0, extra_body={"decoding": "self_spec"})
    after = scrape(server)
    moved = {k: after[k] - before.get(k, 0) for k in after}
    assert moved["vllm:prompt_tokens_total"] == out.usage.prompt_tokens
    assert moved["vllm:generation_tokens_total"] == out.usage.completion_tokens
    assert moved["vllm:prefix_cache_queries_total"] == out.usage.prompt_tokens
    assert moved["vllm:prefix_cache_hits_total"] == out.usage.prompt_tokens_details.cached_tokens
    assert moved["vllm:e2e_request_latency_seconds_count"] == moved["vllm:time_to_first_token_seconds_count"] == 1
    assert moved["vllm:inter_token_latency_seconds_count"] == out.usage.completion_tokens - 1
    assert moved["vllm:request_success_total{finished_reason=stop}"] == 1
    drafted = moved["vllm:spec_decode_num_draft_tokens_total"]
    accepted = moved["vllm:spec_decode_num_accepted_tokens_total"]
    assert moved["vllm:spec_decode_num_drafts_total"] >= 1 and drafted >= accepted >= 0
    ratio = out.model_extra["clover"]["accepted_per_forward"]
    assert accepted == pytest.approx(ratio * moved["vllm:spec_decode_num_drafts_total"])
    assert after["vllm:num_requests_running"] == 0 and after["vllm:num_requests_waiting"] == 0
