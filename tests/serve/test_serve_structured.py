"""Structured output and forced tool calls through a real server process with the official `openai` client
(docs/serving.md, Structured output): whatever the weights, the grammar makes the answer parse and validate."""

from __future__ import annotations

import json
from typing import Annotated

import httpx
import jsonschema
import openai
import pydantic
import pytest

from clover_export.testing.server import start_server, stop_server

MESSAGES = [{"role": "user", "content": "sort: 5 3 9 1"}]


class Sorted(pydantic.BaseModel):  # bounded: a weak model's string or list could otherwise run to max_tokens
    digits: list[Annotated[int, pydantic.Field(ge=0, le=9)]] = pydantic.Field(max_length=6)
    reversed: bool
    note: str = pydantic.Field(max_length=16)


WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "minLength": 1, "maxLength": 20},
    "days": {"type": "integer", "minimum": 1, "maximum": 7},
    "units": {"enum": ["c", "f"]}}, "required": ["city", "days"],
    "additionalProperties": False}  # every string bounded: an answer ends within max_tokens whatever the weights
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "sort_digits", "parameters": {
             "type": "object", "properties": {"digits": {"type": "string", "maxLength": 12}}, "required": ["digits"]}}}]


@pytest.fixture(scope="module")
def client():
    proc, url = start_server("--log-level", "warning")
    yield openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)
    stop_server(proc)


def test_parse_with_a_pydantic_model_validates(client):
    done = client.chat.completions.parse(model="clover-tiny", messages=MESSAGES, response_format=Sorted, max_tokens=300,
                                         temperature=0)
    choice = done.choices[0]
    assert choice.finish_reason == "stop", choice.message.content
    assert isinstance(choice.message.parsed, Sorted)
    assert done.model_extra["clover"]["decoding"] == "self_spec"  # the default low_confidence runs as self_spec


@pytest.mark.parametrize("decoding", ["ar", "self_spec"])
def test_json_object_streamed_parses(client, decoding):
    stream = client.chat.completions.create(model="clover-tiny", messages=MESSAGES, max_tokens=300, stream=True,
                                            response_format={"type": "json_object"}, extra_body={"decoding": decoding})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    (finish,) = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    if finish == "length":  # json_object bounds no string: weights never trained on JSON may write one on and on
        assert text.startswith("{") and len(text) >= 300
    else:
        assert finish == "stop" and isinstance(json.loads(text), dict)


def test_cut_by_max_tokens_is_length(client):
    schema = {"type": "json_schema", "json_schema": {"name": "w", "schema": WEATHER}}
    done = client.chat.completions.create(model="clover-tiny", messages=MESSAGES, max_tokens=3, response_format=schema)
    assert done.choices[0].finish_reason == "length" and done.usage.completion_tokens == 3
    assert done.choices[0].message.content.startswith('{"')


def test_a_schema_that_does_not_compile_is_a_400_naming_the_field(client):
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"when": {"type": "string", "format": "no-such-format"}}}}}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="clover-tiny", messages=MESSAGES, response_format=bad)
    assert e.value.body["param"].startswith("response_format.json_schema.schema"), e.value.body


@pytest.mark.parametrize("choice", [{"type": "function", "function": {"name": "get_weather"}}, "required"])
def test_a_forced_call_has_arguments_valid_against_the_schema(client, choice):
    done = client.chat.completions.create(model="clover-tiny", messages=MESSAGES, max_tokens=300, tools=TOOLS,
                                          tool_choice=choice, parallel_tool_calls=False)
    c = done.choices[0]
    assert c.finish_reason == "tool_calls", c.message
    (call,) = c.message.tool_calls
    schema = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}[call.function.name]
    if isinstance(choice, dict):
        assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), schema)


def test_the_doors_structured_formats_take_the_same_path(client):
    """Responses' `text.format` and Anthropic's `output_config.format` (json_schema) give JSON valid against
    the schema."""
    fmt = {"type": "json_schema", "name": "w", "schema": WEATHER}
    answer = client.responses.create(model="clover-tiny", input="weather?", text={"format": fmt},
                                     max_output_tokens=300)
    jsonschema.validate(json.loads(answer.output_text), WEATHER)
    body = {"model": "clover-tiny", "max_tokens": 300, "messages": [{"role": "user", "content": "weather?"}],
            "output_config": {"format": {"type": "json_schema", "schema": WEATHER}}}
    r = httpx.post(str(client.base_url).removesuffix("/v1/") + "/v1/messages", json=body, timeout=300)
    assert r.status_code == 200, r.text
    jsonschema.validate(json.loads(r.json()["content"][0]["text"]), WEATHER)
