"""What a request may bring, and how it is refused (SERVING.md 1, 2, 5).

Everything here is a plain function of the request's bytes and headers, run
before anything reaches the engine:

- `check_content_type` and `parse_json`: only `application/json`, no
  NaN/Infinity, nesting bounded by a bracket count before any recursive
  parse, counts capped (`check_counts`) before anything walks the body,
  every string valid Unicode;
- the request models: strict types (no `true` as 1, no `"yes"` as true),
  unknown fields refused, `null` wherever OpenAI accepts it; the sampling
  and generation fields are made from the one table of request parameters
  (`generation.PARAMETERS`: OpenAI's ranges for OpenAI's fields, the
  runtime's for the rest), which with the server's own fields is `RANGES`,
  rendered into docs/serving.md by `ranges_markdown`;
- `validation_error`: a pydantic error as a 400 naming the public field
  (`messages[0].content`), whatever union member pydantic tried.
"""

from __future__ import annotations

import json
import math
import re
from typing import Annotated, Any, Literal

import numpy as np
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StringConstraints, ValidationError, create_model
from pydantic_core import PydanticCustomError

from clover_export.core import generation
from clover_export.core.errors import CloverError
from clover_export.core.generation import Choice, Range
from clover_export.runtime import decoding  # noqa: F401  (fills the table's decoding modes)

MAX_JSON_DEPTH = 32  # OpenAI bodies nest 5 deep (messages[i].content[j].text); 32 leaves room for metadata
MAX_STOP = 16  # stop strings a request may give (OpenAI: 4); the engine searches each one every block
MAX_MESSAGES = 2048  # OpenAI's limit on `messages`; here also on the text parts of all messages together
MAX_METADATA_KEYS, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512  # OpenAI's limits on `metadata`
MAX_TOOLS = 128  # OpenAI's limit on `tools`
MAX_TOOL_CHARS = 64 << 10  # one tool's definition as JSON text: it is written into every prompt
MAX_CHOICES = 8  # `n`: each choice is a row of the batch
MAX_COMPLETION_LOGPROBS = 5  # OpenAI's limit on completions' `logprobs`
TOOL_NAME = r"^[a-zA-Z0-9_-]{1,64}$"  # OpenAI's function names (so a name never holds markup)


class ApiError(Exception):
    """An HTTP error with an OpenAI error body {"error": {message, type, param, code}}."""

    TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
             413: "invalid_request_error", 415: "invalid_request_error", 503: "service_unavailable",
             500: "server_error"}

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        kind = self.TYPES.get(self.status, "invalid_request_error" if self.status < 500 else "server_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


def refuse(param: str, why: str, code: str | None = None) -> ApiError:
    """A 400 naming the public field."""
    return ApiError(400, f"'{param}' {why}", param=param, code=code)


def show(value: Any, limit: int = 60) -> str:
    """A client's value, short enough to echo in an error message."""
    text = json.dumps(value, ensure_ascii=True) if not isinstance(value, float) else repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


# --- the body: JSON only ----------------------------------------------------------------------------------
def check_content_type(header: str | None) -> None:
    """415 unless the body is declared `application/json` (UTF-8, the only charset JSON has: RFC 8259 8.1).

    Browsers send `text/plain` and form bodies cross-site without a CORS
    preflight; refusing them keeps a web page from driving a local server.
    """
    media, _, rest = (header or "").partition(";")
    params = dict(p.strip().lower().partition("=")[::2] for p in rest.split(";") if p.strip())
    charset = params.get("charset", "utf-8").strip('"')
    if media.strip().lower() != "application/json" or charset not in ("utf-8", "utf8"):
        raise ApiError(415, f"Content-Type must be application/json, got {show(header or '(none)')}",
                       code="unsupported_media_type")


_STEP = np.zeros(256, np.int8)  # nesting change of each byte outside strings
_STEP[list(b"[{")], _STEP[list(b"]}")] = 1, -1
_SURROGATE = re.compile("[\ud800-\udfff]")


def json_depth(body: bytes) -> int:
    """Deepest nesting of arrays and objects, counted outside strings without parsing (a few vectorised
    passes, however the bytes are arranged). Escaped backslashes, then escaped quotes, are dropped first
    (left to right, as JSON pairs them), so every quote left opens or closes a string."""
    b = np.frombuffer(body.replace(b"\\\\", b"").replace(b'\\"', b""), np.uint8)
    outside = (np.cumsum(b == ord('"'), dtype=np.int32) & 1) == 0
    return int(np.cumsum(np.where(outside, _STEP[b], 0), dtype=np.int32).max(initial=0))


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"number {text[:30]} is out of range")
    return value


def _no_constant(name: str):
    raise ValueError(f"{name} is not JSON")


def body_text(body: bytes) -> str:
    """The body decoded as UTF-8, the only encoding of JSON between systems (RFC 8259 8.1), a leading byte
    order mark ignored (8.1 allows it); a 400 `invalid_json` for bytes that are not UTF-8. A body in UTF-16
    or UTF-32 (a byte order mark, or the zero bytes of ASCII text in them, as `json.detect_encoding` finds
    them) is a 415, as a `charset` other than UTF-8 is, whatever the Content-Type says."""
    encoding = json.detect_encoding(body)
    if encoding not in ("utf-8", "utf-8-sig"):
        raise ApiError(415, f"the body must be UTF-8 JSON, got {encoding.upper()}", code="unsupported_media_type")
    try:
        return body.decode(encoding)
    except UnicodeDecodeError as e:
        raise ApiError(400, f"the body is not valid JSON: {e}", code="invalid_json") from None


def parse_json(body: bytes, max_context: int | None = None) -> dict[str, Any]:
    """The body as a JSON object: UTF-8 (`body_text`, else 415 or 400), else a 400 `invalid_json`: depth past
    MAX_JSON_DEPTH, NaN/Infinity, numbers that overflow a double; then, given the model's context, its counts
    (`check_counts`); then a 400 naming the field whose text is not Unicode."""
    text = body_text(body)
    if json_depth(body) > MAX_JSON_DEPTH:
        raise ApiError(400, f"the body nests deeper than {MAX_JSON_DEPTH} levels", code="invalid_json")
    try:
        data = json.loads(text, parse_constant=_no_constant, parse_float=_finite)
    except (ValueError, RecursionError) as e:
        raise ApiError(400, f"the body is not valid JSON: {e}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise ApiError(400, "the body must be a JSON object", code="invalid_json")
    if max_context is not None:
        check_counts(data, max_context)
    check_unicode(data)
    return data


def check_counts(data: dict[str, Any], max_context: int) -> None:
    """Caps on what a body counts, checked with len() before anything walks it: the Unicode check, the
    validation and the chat template take time linear in these counts, holding the GIL. `messages`: at most
    MAX_MESSAGES (OpenAI's) and no more than the context has tokens; text parts of all messages together:
    MAX_MESSAGES; a prompt's token ids: the context; `metadata`: MAX_METADATA_KEYS keys. A 400 naming the field."""
    messages = data.get("messages")
    if isinstance(messages, list):
        cap = min(MAX_MESSAGES, max_context)
        if len(messages) > cap:
            raise ApiError(400, f"'messages' holds {len(messages)} messages, more than {cap} (OpenAI's limit is "
                                f"{MAX_MESSAGES}; the model's context is {max_context} tokens)", param="messages",
                           code="array_above_max_length")
        parts = 0
        for i, message in enumerate(messages):
            content = message.get("content") if isinstance(message, dict) else None
            parts += len(content) if isinstance(content, list) else 0
            if parts > MAX_MESSAGES:
                raise ApiError(400, f"'messages[{i}].content' brings the content parts of all messages to {parts}, "
                                    f"more than {MAX_MESSAGES}", param=f"messages[{i}].content",
                               code="array_above_max_length")
    tools = data.get("tools")
    if isinstance(tools, list) and len(tools) > MAX_TOOLS:
        raise ApiError(400, f"'tools' holds {len(tools)} tools, more than {MAX_TOOLS} (OpenAI's limit)", param="tools",
                       code="array_above_max_length")
    prompt = data.get("prompt")
    if isinstance(prompt, list) and len(prompt) > max_context:
        raise ApiError(400, f"'prompt' holds {len(prompt)} items, more than the model's context of {max_context} "
                            f"tokens", param="prompt", code="context_length_exceeded")
    metadata = data.get("metadata")
    if isinstance(metadata, dict) and len(metadata) > MAX_METADATA_KEYS:
        raise refuse("metadata", f"holds {len(metadata)} keys, more than {MAX_METADATA_KEYS}")


def check_unicode(data: Any, path: str = "") -> None:
    """400 naming the field whose text holds a lone UTF-16 surrogate (`"\\ud800"` escapes decode to one)."""
    if isinstance(data, str):
        if _SURROGATE.search(data):
            raise refuse(path or "body", "is not valid Unicode text (it holds a lone surrogate)")
    elif isinstance(data, dict):
        for key, value in data.items():
            if _SURROGATE.search(key):
                raise refuse(path or "body", "has a field name that is not valid Unicode text")
            check_unicode(value, f"{path}.{key}" if path else key)
    elif isinstance(data, list):
        for i, value in enumerate(data):
            check_unicode(value, f"{path}[{i}]")


# --- the parameter table ------------------------------------------------------------------------------------
# The per-request parameters that are fields of the body, from the one table (generation.PARAMETERS); the nested
# chat_template_kwargs.enable_thinking is a field of ChatTemplateKwargs below.
BODY_PARAMETERS = tuple(p for p in generation.PARAMETERS if p.openai and "." not in p.openai)
# The server's own ranged fields: accepted values, default, note.
OWN_FIELDS: dict[str, tuple[Range, str, str]] = {
    "max_completion_tokens": (Range("int", 1), "max_tokens", "chat: the same as max_tokens, and wins over it"),
    "n": (Range("int", 1, MAX_CHOICES), "1", "choices, each its own row (the prompt computed once); seed + i "
                                               "for choice i when a seed is given"),
    "top_logprobs": (Range("int", 0, generation.MAX_TOP_LOGPROBS), "null",
                     "chat, with logprobs true: the likeliest alternatives per token"),
    "logprobs": (Range("int", 0, MAX_COMPLETION_LOGPROBS), "null",
                 "completions: each token's log-probability and this many alternatives (chat: true or false)"),
    "block_size": (Range("int", 1), "the engine's", "must equal the engine's"),
}
# Accepted values of each ranged field (SERVING.md 5): the table's, OpenAI's where narrower for OpenAI's fields.
RANGES: dict[str, Range | Choice] = {**{p.openai: p.openai_accepts or p.accepts for p in BODY_PARAMETERS},
                                     **{name: own[0] for name, own in OWN_FIELDS.items()}}
NOTES = {"temperature": "0, or anything below 1e-5, is greedy"}  # where the server differs from the table's help


def describe(rng: Range | Choice) -> str:
    """A range in words; a one-value range is its value."""
    if isinstance(rng, Choice):
        return rng.describe()
    one = rng.kind != "bool" and rng.low == rng.high and not rng.low_open
    return str(rng.low) if one else rng.describe()


def _in_range(name: str):
    rng = RANGES[name]

    def check(value):
        if value is not None:
            try:
                rng.check(name, value)
            except CloverError:
                raise PydanticCustomError("out_of_range", "must be {what}, got {got}",
                                          {"what": describe(rng), "got": show(value)}) from None
        return value
    return check


def ranged(name: str):
    """The field type of table entry `name`: its kind strictly, null, and its range."""
    kind = {"int": int, "real": float, "bool": bool, "str": str}[RANGES[name].kind]
    return Annotated[kind | None, AfterValidator(_in_range(name))]


def ranges_markdown() -> str:
    """RANGES as the markdown table of docs/serving.md (a test keeps the two equal)."""
    rows = ["| parameter | accepted values | default | note |", "|---|---|---|---|"]
    for p in BODY_PARAMETERS:
        rows.append(f"| `{p.openai}` | {describe(RANGES[p.openai])}, or null | {json.dumps(p.default)} | "
                    f"{NOTES.get(p.openai, p.help)} |")
    for name, (rng, default, note) in OWN_FIELDS.items():
        rows.append(f"| `{name}` | {describe(rng)}, or null | {default} | {note} |")
    return "\n".join(rows)


# --- the request models -------------------------------------------------------------------------------------
STRICT = ConfigDict(extra="forbid", strict=True)


class StreamOptions(BaseModel):
    model_config = STRICT
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None  # ignored (vLLM): usage comes once, at the end


class ChatTemplateKwargs(BaseModel):
    model_config = STRICT
    enable_thinking: bool | None = None


class Strict(BaseModel):
    model_config = STRICT


# One field per BODY_PARAMETERS entry: its kind strictly, null (the model's default) and its accepted values.
TableParams = create_model("TableParams", __base__=Strict, __module__=__name__,
                           **{p.openai: (ranged(p.openai), None) for p in BODY_PARAMETERS})


class CommonParams(TableParams):
    """Parameters of both endpoints: the table's (TableParams) and OpenAI's others; None (or null) means the
    model's generation_config.json default."""

    model: str | None = None
    stop: str | Annotated[list[str], Field(max_length=MAX_STOP)] | None = None
    n: ranged("n") = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, float] | None = None  # refused unless empty
    # accepted and ignored: they change nothing here (docs/serving.md)
    user: str | None = None
    store: bool | None = None
    service_tier: str | None = None
    metadata: dict[Annotated[str, StringConstraints(max_length=MAX_METADATA_KEY)],
                   Annotated[str, StringConstraints(max_length=MAX_METADATA_VALUE)]] | None = None  # keys: check_counts
    block_size: ranged("block_size") = None  # Clover's: fixed by the engine


class Message(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)  # name, tool_call_id, ... reach the chat template as given
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict[str, Any]] | None = None


class FunctionDefinition(BaseModel):
    model_config = STRICT
    name: Annotated[str, StringConstraints(pattern=TOOL_NAME)]
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of an object
    strict: bool | None = None  # accepted; arguments follow the schema only as well as the model writes them


class Tool(BaseModel):
    model_config = STRICT
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(BaseModel):
    model_config = STRICT
    name: str


class NamedToolChoice(BaseModel):
    model_config = STRICT
    type: Literal["function"]
    function: FunctionName


class ChatRequest(CommonParams):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: ranged("max_completion_tokens") = None
    logprobs: bool | None = None
    top_logprobs: ranged("top_logprobs") = None  # only with logprobs: true (the adapter)
    response_format: dict[str, Any] | None = None  # refused unless {"type": "text"}
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = None  # each one's size: the adapter
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: ChatTemplateKwargs | None = None


class CompletionRequest(CommonParams):
    prompt: Any  # a string, a list of one string, or token ids: checked by the adapter, which says which
    logprobs: ranged("logprobs") = None
    echo: bool | None = None  # the prompt before the completion (its tokens' logprobs with `logprobs`)
    best_of: int | None = None  # refused unless 1
    suffix: str | None = None  # refused unless null


IGNORED = ("user", "store", "service_tier", "metadata", "stream_options.continuous_usage_stats")


# --- pydantic errors, as the client wrote the body -----------------------------------------------------------
def public_path(loc: tuple, data: Any) -> str:
    """`messages[0].content` for pydantic's ('messages', 0, 'content', 'str'): the loc walked through the
    body itself, so union-member tags ('str', 'list[...]') and other schema names drop out."""
    out, node = "", data
    for part in loc:
        if isinstance(node, dict) and isinstance(part, str) and part in node:
            out, node = f"{out}.{part}" if out else part, node[part]
        elif isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node):
            out, node = f"{out}[{part}]", node[part]
    return out


def validation_error(e: ValidationError, data: Any) -> ApiError:
    """The first error as a 400 naming the public field as the body spells it; a union's alternatives at that
    field joined into one message ("must be a valid string or a valid list")."""
    errors = e.errors(include_url=False)
    first = errors[0]
    if first["type"] == "missing":  # the loc's last part is the absent field itself
        parent = public_path(first["loc"][:-1], data)
        path = f"{parent}.{first['loc'][-1]}" if parent else str(first["loc"][-1])
        return ApiError(400, f"'{path}' is required", param=path)
    field = public_path(first["loc"], data)
    if first["type"] == "extra_forbidden":
        return ApiError(400, f"unknown parameter '{field}'", param=field)
    # a union reports one error per alternative: the one that got furthest into the field's value names it
    located = [(path, err) for err in errors
               if (path := public_path(err["loc"], data)) == field or path.startswith((field + ".", field + "["))]
    path = max((p for p, _ in located), key=len)
    here = [err for p, err in located if p == path]
    reasons = list(dict.fromkeys(err["msg"] for err in here))
    if here[0]["type"] == "out_of_range":
        return ApiError(400, f"'{path}' {reasons[0]}", param=path)
    # a constraint of the alternative whose type matched ("at most 16 items") says more than the types
    specific = [r for r in reasons if not r.startswith("Input should be ")]
    if specific:
        return ApiError(400, f"'{path}': {specific[0]}", param=path)
    kinds = " or ".join(r.removeprefix("Input should be ") for r in reasons)
    return ApiError(400, f"'{path}' must be {kinds}, got {show(here[0]['input'])}", param=path)
