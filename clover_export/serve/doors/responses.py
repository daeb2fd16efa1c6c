"""`POST /v1/responses`: the OpenAI Responses API, stateless, on the chat path (docs/serving.md, OpenAI Responses).

`instructions` become the system message, `input` (a string, or items: messages, `function_call`,
`function_call_output`, `reasoning`) the chat messages, function `tools` and `tool_choice` their chat forms. The
answer is built from the output pieces: reasoning a `reasoning` item, text a `message` item with one
`output_text` part, a tool call a `function_call` item; streamed as Responses events (response.created, ...,
response.completed), each with its `sequence_number`. Nothing is stored: `store: true` and
`previous_response_id` are refused.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag

from clover_export.serve.doors.common import (
    REASONING,
    TEXT,
    TOOL_ARGS,
    TOOL_START,
    Call,
    Outcome,
    Piece,
    check_named_tool,
    flat_tools_submission,
    function_tool,
    json_format,
    tool_call,
)
from clover_export.serve.protocol import MAX_MESSAGES, STRICT, ApiError, ranged, refuse

PATH = "/v1/responses"
MAX_TOOLS = 128
ITEM_TYPES = {REASONING: "reasoning", TEXT: "message", TOOL_START: "function_call"}
ITEM_IDS = {"reasoning": "rs", "message": "msg", "function_call": "fc"}  # OpenAI's id prefixes


# --- the request -------------------------------------------------------------------------------------------------
class ContentPart(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["input_text", "output_text", "text"]
    text: str
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


class MessageItem(BaseModel):
    model_config = STRICT
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | Annotated[list[ContentPart], Field(max_length=MAX_MESSAGES)]
    id: str | None = None
    status: str | None = None


class FunctionCallItem(BaseModel):
    model_config = STRICT
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(BaseModel):
    model_config = STRICT
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[ContentPart]
    id: str | None = None
    status: str | None = None


class ReasoningItem(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)  # summary, content, encrypted_content: not rendered
    type: Literal["reasoning"]


def _item_type(item: Any) -> Any:
    """An input item's `type`; a bare {role, content} is a message (the Responses API's easy input message)."""
    return item.get("type", "message") if isinstance(item, dict) else getattr(item, "type", None)


Item = Annotated[Union[Annotated[MessageItem, Tag("message")], Annotated[FunctionCallItem, Tag("function_call")],
                       Annotated[FunctionCallOutputItem, Tag("function_call_output")],
                       Annotated[ReasoningItem, Tag("reasoning")]], Discriminator(_item_type)]


class FunctionTool(BaseModel):
    model_config = STRICT
    type: Literal["function"]  # hosted tools (web search, file search, ...) are not run here
    name: Annotated[str, Field(min_length=1, max_length=128)]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunction(BaseModel):
    model_config = STRICT
    type: Literal["function"]
    name: str


class TextFormat(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    type: Literal["text", "json_schema", "json_object"]


class TextOptions(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)  # verbosity: accepted and ignored
    format: TextFormat | None = None


class Reasoning(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)  # summary: accepted and ignored
    effort: str | None = None


class ResponsesRequest(BaseModel):
    model_config = STRICT
    model: str | None = None
    input: str | Annotated[list[Item], Field(min_length=1, max_length=MAX_MESSAGES)]
    instructions: str | None = None
    max_output_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: ranged("temperature") = None
    top_p: ranged("top_p") = None
    tools: Annotated[list[FunctionTool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["auto", "none", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool | None = None
    text: TextOptions | None = None
    reasoning: Reasoning | None = None
    stream: bool | None = None
    store: bool | None = None
    previous_response_id: str | None = None
    background: bool | None = None
    metadata: dict[str, str] | None = None  # accepted and ignored, as on the chat path
    user: str | None = None
    truncation: Literal["disabled"] | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    decoding: ranged("decoding") = None  # Clover's decoding mode (docs/decoding.md)


def admit(data: dict[str, Any], default_thinking: bool, tool_parser=None) -> Call:
    """The validated body as the chat path's request (pydantic errors are the caller's: they name this body);
    `tool_parser`: the model's tool-call format (tool_calls.parser_for)."""
    req = ResponsesRequest.model_validate(data)
    _refuse_state(req)
    fmt = req.text.format if req.text and req.text.format and req.text.format.type != "text" else None
    tools = [function_tool(t.name, t.description, t.parameters) for t in req.tools or []] or None
    system = [{"role": "system", "content": req.instructions}] if req.instructions else []
    chat = {"model": req.model, "messages": system + _chat_messages(req.input), "max_tokens": req.max_output_tokens,
            "temperature": req.temperature, "top_p": req.top_p, "stream": req.stream, "decoding": req.decoding,
            "tools": tools, "tool_choice": _tool_choice(req.tool_choice, tools),
            "parallel_tool_calls": req.parallel_tool_calls,
            "response_format": json_format(fmt.model_dump(), "text.format") if fmt is not None else None}
    if req.reasoning is not None and req.reasoning.effort is not None:
        chat["chat_template_kwargs"] = {"enable_thinking": req.reasoning.effort != "none"}
    sub = flat_tools_submission(chat, default_thinking, tool_parser)
    echo = {"instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "temperature": req.temperature, "top_p": req.top_p, "metadata": req.metadata or {},
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "tools": [t.model_dump() for t in req.tools or []],
            "tool_choice": req.tool_choice.model_dump() if isinstance(req.tool_choice, NamedFunction)
            else req.tool_choice or "auto"}
    return Call(sub, req.model, echo=echo, renames={"max_tokens": "max_output_tokens", "messages": "input",
                                                    "response_format.json_schema": "text.format",
                                                    "response_format": "text.format"})


def _refuse_state(req: ResponsesRequest) -> None:
    """This server keeps no responses: nothing to store, continue from or poll."""
    if req.store:
        raise refuse("store", "must be false or absent: this server keeps no responses (send the whole "
                              "conversation in 'input')")
    if req.previous_response_id is not None:
        raise refuse("previous_response_id", "is not supported: this server keeps no responses (send the whole "
                                             "conversation in 'input')")
    if req.background:
        raise refuse("background", "is not supported: this server keeps no responses")


def _chat_messages(given: str | list) -> list[dict[str, Any]]:
    """Input items as OpenAI chat messages: consecutive function calls one assistant message's `tool_calls`
    (joined to the assistant message just before them), their outputs `tool` messages; reasoning items dropped."""
    if isinstance(given, str):
        return [{"role": "user", "content": given}]
    out: list[dict[str, Any]] = []
    for item in given:
        if isinstance(item, MessageItem):
            out.append({"role": item.role, "content": _text(item.content)})
        elif isinstance(item, FunctionCallItem):
            if not (out and out[-1]["role"] == "assistant"):
                out.append({"role": "assistant", "content": ""})
            out[-1].setdefault("tool_calls", []).append(tool_call(item.call_id, item.name, item.arguments))
        elif isinstance(item, FunctionCallOutputItem):
            out.append({"role": "tool", "tool_call_id": item.call_id, "content": _text(item.output)})
    if not out:
        raise refuse("input", "holds no message or function call")
    return out


def _text(content: str | list[ContentPart]) -> str:
    return content if isinstance(content, str) else "".join(p.text for p in content)


def _tool_choice(choice, tools: list[dict[str, Any]] | None) -> str | dict[str, Any] | None:
    if isinstance(choice, NamedFunction):
        check_named_tool(choice.name, tools, "tool_choice.name")
        return {"type": "function", "function": {"name": choice.name}}
    if choice == "required" and not tools:
        raise refuse("tool_choice", "is \"required\", but no 'tools' are given")
    return choice


# --- the answer ----------------------------------------------------------------------------------------------------
def error_body(err: ApiError) -> dict[str, Any]:
    return err.body()  # OpenAI's error shape


def usage(outcome: Outcome) -> dict[str, Any]:
    res = outcome.result
    return {"input_tokens": res.prompt_tokens, "input_tokens_details": {"cached_tokens": res.cached_tokens},
            "output_tokens": res.response_tokens,
            "output_tokens_details": {"reasoning_tokens": outcome.reasoning_tokens},
            "total_tokens": res.prompt_tokens + res.response_tokens}


class Writer:
    """The answer as output items, one per run of pieces of one kind (a new one per function call)."""

    def __init__(self, call: Call):
        self.call = call
        self.items: list[dict[str, Any]] = []
        self.open = False  # the last item still takes deltas
        self.sequence = 0
        self.created = int(time.time())

    def response(self, status: str, outcome: Outcome | None = None) -> dict[str, Any]:
        incomplete = status == "incomplete"
        return {"id": "resp_" + self.call.sub.id, "object": "response", "created_at": self.created,
                "model": self.call.model, "status": status, "output": self.items if outcome else [],
                "error": None, "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
                "text": {"format": {"type": "text"}}, "store": False, "background": False,
                "previous_response_id": None, "reasoning": None, "truncation": "disabled",
                "usage": usage(outcome) if outcome else None, **self.call.echo}

    def event(self, kind: str, **fields: Any) -> tuple[str, dict[str, Any]]:
        self.sequence += 1
        return kind, {"type": kind, "sequence_number": self.sequence - 1, **fields}

    def start(self, prompt_tokens: int) -> list[tuple[str, dict[str, Any]]]:
        return [self.event("response.created", response=self.response("in_progress")),
                self.event("response.in_progress", response=self.response("in_progress"))]

    def feed(self, piece: Piece) -> list[tuple[str, dict[str, Any]]]:
        events = []
        kind = ITEM_TYPES.get(piece.kind)
        if kind is not None and (piece.kind == TOOL_START or not self.open or self.items[-1]["type"] != kind):
            events += self._close() + self._begin(kind, piece)
        if piece.kind == TOOL_START:
            return events
        index, item = len(self.items) - 1, self.items[-1]
        where = {"item_id": item["id"], "output_index": index}
        if piece.kind == TOOL_ARGS:
            item["arguments"] += piece.text
            return events + [self.event("response.function_call_arguments.delta", delta=piece.text, **where)]
        item["content"][0]["text"] += piece.text
        kind = "response.reasoning_text.delta" if piece.kind == REASONING else "response.output_text.delta"
        extra = {"logprobs": []} if piece.kind == TEXT else {}
        return events + [self.event(kind, content_index=0, delta=piece.text, **where, **extra)]

    def _begin(self, kind: str, piece: Piece) -> list[tuple[str, dict[str, Any]]]:
        n = len(self.items)
        item_id = f"{ITEM_IDS[kind]}_{self.call.sub.id}_{n}"
        if kind == "function_call":
            item = {"type": kind, "id": item_id, "call_id": piece.id, "name": piece.name, "arguments": "",
                    "status": "in_progress"}
        elif kind == "reasoning":
            item = {"type": kind, "id": item_id, "summary": [], "content": [{"type": "reasoning_text", "text": ""}],
                    "status": "in_progress"}
        else:
            item = {"type": kind, "id": item_id, "role": "assistant", "status": "in_progress",
                    "content": [{"type": "output_text", "text": "", "annotations": [], "logprobs": []}]}
        self.items.append(item)
        self.open = True
        events = [self.event("response.output_item.added", output_index=n, item=_shell(item))]
        if kind != "function_call":
            part = dict(item["content"][0], text="")
            events.append(self.event("response.content_part.added", item_id=item_id, output_index=n, content_index=0,
                                     part=part))
        return events

    def _close(self) -> list[tuple[str, dict[str, Any]]]:
        if not self.open:
            return []
        self.open = False
        n, item = len(self.items) - 1, self.items[-1]
        item["status"] = "completed"
        where = {"item_id": item["id"], "output_index": n}
        if item["type"] == "function_call":
            events = [self.event("response.function_call_arguments.done", arguments=item["arguments"], **where)]
        else:
            part = item["content"][0]
            done = "response.reasoning_text.done" if item["type"] == "reasoning" else "response.output_text.done"
            extra = {"logprobs": []} if item["type"] == "message" else {}
            events = [self.event(done, content_index=0, text=part["text"], **where, **extra),
                      self.event("response.content_part.done", content_index=0, part=part, **where)]
        return events + [self.event("response.output_item.done", output_index=n, item=item)]

    def finish(self, outcome: Outcome) -> list[tuple[str, dict[str, Any]]]:
        events = self._close()
        body = self.body(outcome)
        kind = "response.completed" if body["status"] == "completed" else "response.incomplete"
        return events + [self.event(kind, response=body)]

    def error(self, err: ApiError) -> list[tuple[str, dict[str, Any]]]:
        """A failure after the stream began: an `error` event (OpenAI's streamed error)."""
        return [self.event("error", code=err.code, message=err.message, param=err.param)]

    def body(self, outcome: Outcome) -> dict[str, Any]:
        self.open = False
        for item in self.items:
            item["status"] = "completed"
        return self.response("incomplete" if outcome.result.finish_reason == "length" else "completed", outcome)


def _shell(item: dict[str, Any]) -> dict[str, Any]:
    """An item as `output_item.added` shows it: no text yet."""
    if item["type"] == "function_call":
        return dict(item)
    return dict(item, content=[])

