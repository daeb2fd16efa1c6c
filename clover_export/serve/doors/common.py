"""What every door shares: output pieces, the Call a door makes of a request, the mapping onto the chat path."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from clover_export.serve import adapter, tool_calls
from clover_export.serve.protocol import ApiError, ChatRequest

# output pieces, in the order the model wrote them
REASONING, TEXT, TOOL_START, TOOL_ARGS = "reasoning", "text", "tool_start", "tool_args"


# a chat tool's field as the chat path names it (`tools[1].function.name`), for the doors' flat tools (`tools[1].name`)
FUNCTION_FIELD = re.compile(r"(\btools\[\d+\])\.function\.")


@dataclass(frozen=True)
class Piece:
    """One piece of an answer: a reasoning or text delta, a tool call's start (`name`, `id`) or an arguments delta."""

    kind: str
    text: str = ""  # the delta (TOOL_ARGS: JSON text of the arguments)
    name: str | None = None  # TOOL_START: the function's name
    id: str | None = None  # TOOL_START: the call's id


class Pieces:
    """The pieces of a growing response, read as the chat path reads it (adapter.Reply: the reasoning split off,
    the content through the request's tool-call parser, a forced call's opening first), so every door answers
    with the calls /v1/chat/completions would return."""

    def __init__(self, sub: adapter.Submission):
        self.reply = adapter.Reply(sub)

    def push(self, delta: str, final: bool) -> list[Piece]:
        out = []
        for reasoning, text, call in self.reply.push(delta, final):
            out += [Piece(kind, t) for kind, t in ((REASONING, reasoning), (TEXT, text)) if t]
            if call is not None:
                out.append(_call_piece(call))
        return out


def _call_piece(delta: dict[str, Any]) -> Piece:
    """An OpenAI streamed tool-call delta as a piece: the first (id and name) starts the call, the others
    carry arguments."""
    if "id" in delta:
        return Piece(TOOL_START, name=delta["function"]["name"], id=delta["id"])
    return Piece(TOOL_ARGS, delta["function"]["arguments"])


@dataclass
class Call:
    """One door request mapped onto the chat path: its Submission (tools included), plus what the door echoes
    in its answer."""

    sub: adapter.Submission
    model: str
    echo: dict[str, Any] = field(default_factory=dict)  # request fields the answer repeats (door-specific)
    renames: dict[str, str] = field(default_factory=dict)  # chat-path parameter name -> the door's name


@dataclass(frozen=True)
class Outcome:
    """A finished request as the doors report it."""

    result: Any  # the runtime's Result
    stop_sequence: str | None = None  # the stop string that ended it (finish_reason "stop_string")
    reasoning_tokens: int = 0  # response tokens up to and including `</think>` (thinking on)


def chat_submission(chat: dict[str, Any], default_thinking: bool,
                    tool_parser: type[tool_calls.StreamParser] | None = None) -> adapter.Submission:
    """An OpenAI chat request body built by a door, through the chat path's own validation and mapping
    (`tool_parser`: the model's tool-call format, tool_calls.parser_for)."""
    body = {k: v for k, v in chat.items() if v is not None}
    try:
        req = ChatRequest.model_validate(body)
    except ValidationError as e:  # a door built a body the chat path refuses: say where, in the chat's names
        raise ApiError(400, f"the request maps to an invalid chat request: {e.errors(include_url=False)[0]['msg']}")
    return adapter.chat_submission(req, default_thinking, tool_parser)


def flat_tools_submission(chat: dict[str, Any], default_thinking: bool,
                          tool_parser: type[tool_calls.StreamParser] | None) -> adapter.Submission:
    """`chat_submission` for a door whose tools are flat (`{"name", ...}`, in the chat request's order): a
    refusal names a tool's field as the door's body spells it (`tools[1].name`)."""
    try:
        return chat_submission(chat, default_thinking, tool_parser)
    except ApiError as e:
        flat = lambda text: FUNCTION_FIELD.sub(r"\1.", text)  # noqa: E731
        raise ApiError(e.status, flat(e.message), param=e.param and flat(e.param), code=e.code,
                       headers=e.headers) from None


def json_format(fmt: dict[str, Any], where: str) -> dict[str, Any]:
    """A door's flat JSON output format (`{"type": "json_schema", "schema": ..., "name"?, "strict"?}` or
    `{"type": "json_object"}`) as the chat path's `response_format` (docs/serving.md, Structured output)."""
    kind = fmt.get("type")
    if kind == "json_object":
        return {"type": "json_object"}
    if kind != "json_schema":
        raise ApiError(400, f"'{where}.type' must be \"json_schema\" or \"json_object\"", param=f"{where}.type")
    inner = {"name": fmt.get("name", "output"), "schema": fmt.get("schema")}
    return {"type": "json_schema", "json_schema": inner}


def tool_call(call_id: str, name: str, arguments: str) -> dict[str, Any]:
    """An assistant message's OpenAI-style tool call."""
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def function_tool(name: str, description: str | None, parameters: dict[str, Any] | None) -> dict[str, Any]:
    """An OpenAI-style function tool, as the chat template reads `tools`."""
    function: dict[str, Any] = {"name": name, "parameters": parameters or {"type": "object", "properties": {}}}
    if description is not None:
        function["description"] = description
    return {"type": "function", "function": function}


def check_named_tool(name: str, tools: list[dict[str, Any]] | None, param: str) -> None:
    """A 400 unless `name` is one of the tools' names."""
    names = [t["function"]["name"] for t in tools or []]
    if name not in names:
        raise ApiError(400, f"'{param}' names the tool {json.dumps(name)}, which is not in 'tools' "
                            f"({', '.join(map(json.dumps, names)) or 'none given'})", param=param)


def matched_stop(stops: list[str], text: str, full_text: str) -> str | None:
    """The stop string that ended a response: the one written right after its kept `text` in `full_text` (the
    decoded response before the cut), else the first given."""
    found = [s for s in stops if full_text.startswith(s, len(text))]
    return (found or stops or [None])[0]


def renamed(err: ApiError, renames: dict[str, str]) -> ApiError:
    """`err` with the chat path's parameter names written as the door's (param and quoted names in the message)."""
    message, param = err.message, err.param
    for inner, public in renames.items():
        message = re.sub(rf"\b{inner}\b", public, message)
        param = public + param[len(inner):] if param and (param == inner or param.startswith(inner + ".")) else param
    return ApiError(err.status, message, param=param, code=err.code, headers=err.headers)


def sse(name: str, data: dict[str, Any]) -> str:
    """One named server-sent event."""
    return f"event: {name}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"
