"""`POST /v1/messages`: the Anthropic Messages API on the chat path (docs/serving.md, Anthropic Messages).

The request becomes an OpenAI chat request: `system` the system message, text blocks the content, `tool_use`
blocks an assistant message's `tool_calls`, `tool_result` blocks `tool` messages, `thinking` blocks the
assistant's `reasoning_content`; `tools` and `tool_choice` their OpenAI forms (`any` is "required",
`disable_parallel_tool_use` is `parallel_tool_calls: false`). The answer is built from the
output pieces: reasoning a `thinking` block, text a `text` block, a tool call a `tool_use` block; streamed in
Anthropic's event sequence (message_start, ping, content_block_start/_delta/_stop, message_delta, message_stop).
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field

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
from clover_export.serve.protocol import MAX_MESSAGES, MAX_STOP, STRICT, ApiError, ranged, refuse

PATH = "/v1/messages"
COUNT_PATH = "/v1/messages/count_tokens"
X_API_KEY = True  # Anthropic's clients send the key as `x-api-key`
MAX_TOOLS = 128
# Anthropic's error types by HTTP status (https://docs.anthropic.com/en/api/errors)
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 408: "timeout_error", 413: "request_too_large", 415: "invalid_request_error",
               429: "rate_limit_error", 431: "request_too_large", 500: "api_error", 503: "overloaded_error"}
STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "stop_string": "stop_sequence"}
TOOL_CHOICES = {"auto": "auto", "any": "required", "none": "none"}  # "tool": a named function
BLOCK_TYPES = {REASONING: "thinking", TEXT: "text", TOOL_START: "tool_use"}


# --- the request -------------------------------------------------------------------------------------------------
class _Block(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    cache_control: dict[str, Any] | None = None  # accepted; the prefix cache needs no marks (docs/prefix_cache.md)


class TextBlock(_Block):
    type: Literal["text"]
    text: str
    citations: list[dict[str, Any]] | None = None


class ToolUseBlock(_Block):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class ToolResultBlock(_Block):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] | None = None
    is_error: bool | None = None


class ThinkingBlock(_Block):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(_Block):
    type: Literal["redacted_thinking"]
    data: str


Block = Annotated[Union[TextBlock, ToolUseBlock, ToolResultBlock, ThinkingBlock, RedactedThinkingBlock],
                  Field(discriminator="type")]


class Message(BaseModel):
    model_config = STRICT
    role: Literal["user", "assistant"]
    content: str | Annotated[list[Block], Field(max_length=MAX_MESSAGES)]


class Tool(BaseModel):
    model_config = STRICT
    name: Annotated[str, Field(min_length=1, max_length=128)]
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None  # Anthropic's server tools (web search, ...) are not run here
    cache_control: dict[str, Any] | None = None


class ToolChoice(BaseModel):
    model_config = STRICT
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class Thinking(BaseModel):
    model_config = STRICT
    type: Literal["enabled", "disabled", "adaptive", "between_tools"]  # all but "disabled": thinking on
    budget_tokens: Annotated[int, Field(ge=1)] | None = None  # accepted; max_tokens bounds thinking and answer
    display: Literal["summarized", "omitted"] | None = None  # accepted; the thinking is the model's own text


class OutputConfig(BaseModel):
    model_config = STRICT
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None  # accepted and ignored
    format: dict[str, Any] | None = None  # structured output: {"type": "json_schema", "schema": {...}}


class Metadata(BaseModel):
    model_config = STRICT
    user_id: Annotated[str, Field(max_length=256)] | None = None


class MessagesRequest(BaseModel):
    model_config = STRICT
    model: str
    messages: Annotated[list[Message], Field(min_length=1)]
    max_tokens: Annotated[int, Field(ge=1)]
    system: str | list[TextBlock] | None = None
    stop_sequences: Annotated[list[str], Field(max_length=MAX_STOP)] | None = None
    stream: bool | None = None
    temperature: Annotated[float, Field(ge=0, le=1)] | None = None  # Anthropic's range
    top_p: ranged("top_p") = None
    top_k: ranged("top_k") = None
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    metadata: Metadata | None = None
    output_config: OutputConfig | None = None
    # accepted and ignored: they change nothing here (docs/serving.md)
    service_tier: str | None = None
    cache_control: dict[str, Any] | None = None
    speed: Literal["standard", "fast"] | None = None
    inference_geo: str | None = None
    user_profile_id: str | None = None
    workspace_id: str | None = None
    decoding: ranged("decoding") = None  # Clover's decoding mode (docs/decoding.md)


def admit(data: dict[str, Any], default_thinking: bool, tool_parser=None) -> Call:
    """The validated body as the chat path's request (pydantic errors are the caller's: they name this body);
    `tool_parser`: the model's tool-call format (tool_calls.parser_for)."""
    req = MessagesRequest.model_validate(data)
    fmt = req.output_config.format if req.output_config is not None else None
    if req.messages[-1].role == "assistant":
        raise refuse("messages", "ends with an assistant message; continuing a prefilled answer is not supported")
    tools = _tools(req.tools)
    chat = {"model": req.model, "messages": _system(req.system) + _chat_messages(req.messages),
            "max_tokens": req.max_tokens, "stop": req.stop_sequences, "stream": req.stream,
            "temperature": req.temperature, "top_p": req.top_p, "top_k": req.top_k, "decoding": req.decoding,
            "tools": tools, "tool_choice": _tool_choice(req.tool_choice, tools),
            "response_format": json_format(fmt, "output_config.format") if fmt is not None else None}
    if req.tool_choice is not None and req.tool_choice.disable_parallel_tool_use:
        chat["parallel_tool_calls"] = False
    if req.thinking is not None:
        chat["chat_template_kwargs"] = {"enable_thinking": req.thinking.type != "disabled"}
    sub = flat_tools_submission(chat, default_thinking, tool_parser)
    return Call(sub, req.model, renames={"stop": "stop_sequences",
                                         "response_format.json_schema": "output_config.format",
                                         "response_format": "output_config.format"})


def admit_count(data: dict[str, Any], default_thinking: bool, tool_parser=None) -> Call:
    """`POST /v1/messages/count_tokens`: the body of /v1/messages, `max_tokens` not needed (the prompt alone is
    counted: the ids the same request to /v1/messages would feed the model)."""
    return admit({"max_tokens": 1, **data} if isinstance(data, dict) else data, default_thinking, tool_parser)


def _system(system: str | list[TextBlock] | None) -> list[dict[str, Any]]:
    text = system if isinstance(system, str) or system is None else "".join(b.text for b in system)
    return [{"role": "system", "content": text}] if text else []


def _chat_messages(messages: list[Message]) -> list[dict[str, Any]]:
    """Anthropic's turns as OpenAI chat messages: a user turn's tool results become `tool` messages (before its
    text, as they answer the turn before), an assistant turn's tool uses its `tool_calls`."""
    out: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        blocks = [TextBlock(type="text", text=m.content)] if isinstance(m.content, str) else m.content
        wrong, owner = (ToolUseBlock, "assistant") if m.role == "user" else (ToolResultBlock, "user")
        if any(isinstance(b, wrong) for b in blocks):
            raise refuse(f"messages[{i}].content", f"holds a {'tool_use' if owner == 'assistant' else 'tool_result'} "
                                                   f"block, which only {owner} turns may hold")
        text = "".join(b.text for b in blocks if isinstance(b, TextBlock))
        if m.role == "user":
            out += [{"role": "tool", "tool_call_id": b.tool_use_id, "content": _result_text(b)}
                    for b in blocks if isinstance(b, ToolResultBlock)]
            if text or not any(isinstance(b, ToolResultBlock) for b in blocks):
                out.append({"role": "user", "content": text})
            continue
        message: dict[str, Any] = {"role": "assistant", "content": text}
        reasoning = "".join(b.thinking for b in blocks if isinstance(b, ThinkingBlock))
        if reasoning:
            message["reasoning_content"] = reasoning
        calls = [tool_call(b.id, b.name, json.dumps(b.input, ensure_ascii=False))
                 for b in blocks if isinstance(b, ToolUseBlock)]
        if calls:
            message["tool_calls"] = calls
        out.append(message)
    return out


def _result_text(block: ToolResultBlock) -> str:
    if block.content is None or isinstance(block.content, str):
        return block.content or ""
    return "".join(b.text for b in block.content)


def _tools(tools: list[Tool] | None) -> list[dict[str, Any]] | None:
    if not tools:
        return None
    return [function_tool(t.name, t.description, t.input_schema) for t in tools]


def _tool_choice(choice: ToolChoice | None, tools: list[dict[str, Any]] | None) -> str | dict[str, Any] | None:
    if choice is None:
        return None
    if choice.type != "tool":
        if choice.type == "any" and not tools:
            raise refuse("tool_choice", "is \"any\", but no 'tools' are given")
        return TOOL_CHOICES[choice.type]
    if choice.name is None:
        raise refuse("tool_choice.name", "is required when 'tool_choice.type' is \"tool\"")
    check_named_tool(choice.name, tools, "tool_choice.name")
    return {"type": "function", "function": {"name": choice.name}}


# --- the answer ----------------------------------------------------------------------------------------------------
def error_body(err: ApiError) -> dict[str, Any]:
    kind = ERROR_TYPES.get(err.status, "invalid_request_error" if err.status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": err.message}}


def stop_reason(outcome: Outcome, blocks: list[dict[str, Any]]) -> str:
    """`tool_use` when the model called tools and was not cut by max_tokens (as the chat path's "tool_calls")."""
    reason = STOP_REASONS.get(outcome.result.finish_reason, "end_turn")
    return "tool_use" if reason != "max_tokens" and any(b["type"] == "tool_use" for b in blocks) else reason


def usage(res, output: bool = True) -> dict[str, Any]:
    """Anthropic's usage: `input_tokens` are the prompt tokens not read from the prefix cache, so that
    input_tokens + cache_read_input_tokens is the whole prompt (as Anthropic counts cached prompts)."""
    out = {"input_tokens": res.prompt_tokens - res.cached_tokens, "cache_creation_input_tokens": 0,
           "cache_read_input_tokens": res.cached_tokens}
    if output:
        out["output_tokens"] = res.response_tokens
    return out


class Writer:
    """The answer as content blocks, one per run of pieces of one kind (a new one per tool call)."""

    def __init__(self, call: Call):
        self.call = call
        self.blocks: list[dict[str, Any]] = []
        self.arguments: list[str] = []  # each tool_use block's JSON arguments so far (same order)
        self.open = False  # the last block still takes deltas

    def message(self, content: list[dict[str, Any]], stop: str | None, stop_sequence: str | None,
                use: dict[str, Any]) -> dict[str, Any]:
        return {"id": "msg_" + self.call.sub.id, "type": "message", "role": "assistant", "model": self.call.model,
                "content": content, "stop_reason": stop, "stop_sequence": stop_sequence, "usage": use}

    def start(self, prompt_tokens: int) -> list[tuple[str, dict[str, Any]]]:
        use = {"input_tokens": prompt_tokens, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0,
               "output_tokens": 0}
        return [("message_start", {"type": "message_start", "message": self.message([], None, None, use)}),
                ("ping", {"type": "ping"})]

    def feed(self, piece: Piece) -> list[tuple[str, dict[str, Any]]]:
        events = []
        kind = BLOCK_TYPES.get(piece.kind)
        if kind is not None and (piece.kind == TOOL_START or not self.open or self.blocks[-1]["type"] != kind):
            events += self._close() + self._begin(kind, piece)
        if piece.kind == TOOL_START:
            return events
        index, block = len(self.blocks) - 1, self.blocks[-1]
        if piece.kind == TOOL_ARGS:
            self.arguments[-1] += piece.text
            delta = {"type": "input_json_delta", "partial_json": piece.text}
        elif kind == "thinking":
            block["thinking"] += piece.text
            delta = {"type": "thinking_delta", "thinking": piece.text}
        else:
            block["text"] += piece.text
            delta = {"type": "text_delta", "text": piece.text}
        return events + [("content_block_delta", {"type": "content_block_delta", "index": index, "delta": delta})]

    def _begin(self, kind: str, piece: Piece) -> list[tuple[str, dict[str, Any]]]:
        block = {"thinking": {"type": "thinking", "thinking": "", "signature": ""},
                 "text": {"type": "text", "text": ""},
                 "tool_use": {"type": "tool_use", "id": piece.id, "name": piece.name, "input": {}}}[kind]
        if kind == "tool_use":
            self.arguments.append("")
        self.blocks.append(block)
        self.open = True
        start = {"type": "content_block_start", "index": len(self.blocks) - 1, "content_block": dict(block)}
        return [("content_block_start", start)]

    def _close(self) -> list[tuple[str, dict[str, Any]]]:
        if not self.open:
            return []
        self.open = False
        return [("content_block_stop", {"type": "content_block_stop", "index": len(self.blocks) - 1})]

    def finish(self, outcome: Outcome) -> list[tuple[str, dict[str, Any]]]:
        delta = {"stop_reason": stop_reason(outcome, self.blocks), "stop_sequence": outcome.stop_sequence}
        return self._close() + [
            ("message_delta", {"type": "message_delta", "delta": delta, "usage": usage(outcome.result)}),
            ("message_stop", {"type": "message_stop"})]

    def error(self, err: ApiError) -> list[tuple[str, dict[str, Any]]]:
        """A failure after the stream began: an `error` event (Anthropic's streamed error)."""
        return [("error", error_body(err))]

    def body(self, outcome: Outcome) -> dict[str, Any]:
        tool_inputs = iter(self.arguments)
        content = [dict(b, input=_arguments(next(tool_inputs))) if b["type"] == "tool_use" else b
                   for b in self.blocks]
        return self.message(content, stop_reason(outcome, self.blocks), outcome.stop_sequence,
                            usage(outcome.result))


def _arguments(text: str) -> dict[str, Any]:
    """A tool call's JSON arguments as its `input` object ({} when they are not one)."""
    try:
        value = json.loads(text or "{}")
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}
