"""Tool calls in the model's own format, parsed from its text, whole or as it streams (docs/serving.md, Tool calls).

Two formats, picked from the chat template (`parser_for`; `--tool-call-parser` overrides); `ToolUse` is a
request's tools and tool_choice as every API door reads them:

- `qwen3_coder` (Qwen3.6, Qwen3-Coder, and the embedded default's template): XML,
  `<tool_call>\\n<function=NAME>\\n<parameter=KEY>\\nVALUE\\n</parameter>\\n</function>\\n</tool_call>`;
  each value is text, converted by the type its tool's JSON schema gives the parameter.
- `hermes` (Qwen2.5, Qwen3): a JSON object `{"name": ..., "arguments": {...}}` inside `<tool_call>`.

A parser reads the response's content (after the reasoning) and gives events:
`TextDelta` (content outside the calls), `CallStart` (a call's index, id and
function name) and `ArgumentsDelta` (the next piece of the call's arguments,
a JSON object once all pieces are joined). `feed(delta)` gives the events that
text decides; text that might still start or continue a call is held back until
it is known, so every character comes out once, and any split of a text into
deltas gives the same events joined as one `feed` of the whole (`parse`).

A call the model writes badly is content: a `<tool_call>` that does not open
with a known function (or, hermes, whose JSON does not parse into a known
function and an arguments object) is text, and scanning resumes after its
marker. An XML call ended early (junk between its parameters, the output cut)
keeps the parameters it completed; what follows is content again.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any, Callable

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
FUNCTION_OPEN, FUNCTION_CLOSE = "<function=", "</function>"
PARAMETER_OPEN, PARAMETER_CLOSE = "<parameter=", "</parameter>"
MAX_NAME = 256  # characters of a function or parameter name before the parser calls the markup junk


@dataclass(frozen=True)
class TextDelta:
    text: str


@dataclass(frozen=True)
class CallStart:
    index: int
    id: str
    name: str


@dataclass(frozen=True)
class ArgumentsDelta:
    index: int
    fragment: str


Event = TextDelta | CallStart | ArgumentsDelta


@dataclass(frozen=True)
class ToolCall:
    """One finished call: its id, function name and arguments (a JSON object as text)."""

    id: str
    name: str
    arguments: str

    def openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def new_call_id(index: int) -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def schemas(tools: list[dict[str, Any]] | None) -> dict[str, dict[str, Any]]:
    """{function name: its parameters' JSON schema} of OpenAI tool objects."""
    out = {}
    for tool in tools or []:
        fn = tool.get("function", tool)
        out[fn["name"]] = fn.get("parameters") or {}
    return out


def _held(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker` (may begin it)."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


def _could_become(text: str, *markers: str) -> bool:
    """`text` is a proper prefix of one of the markers (more text may complete it)."""
    return any(m.startswith(text) and m != text for m in markers)


def _open_tag(text: str, prefix: str) -> tuple[str, int] | None | bool:
    """`<prefix NAME>` at the start of text: (NAME, length), False when text cannot be one, None while
    text is a proper prefix of one."""
    if len(text) < len(prefix):
        return None if prefix.startswith(text) else False
    if not text.startswith(prefix):
        return False
    end = text.find(">", len(prefix))
    name = text[len(prefix):end if end >= 0 else len(text)]
    if len(name) > MAX_NAME or any(c in name for c in "<\n") or (end >= 0 and not name):
        return False
    return (name, end + 1) if end >= 0 else None


class StreamParser:
    """The common scanner: text outside calls, held back only while it may be the start of `<tool_call>`.

    Subclasses read what follows a `<tool_call>` (`_call`)."""

    name = ""  # the --tool-call-parser name

    def __init__(self, tools: list[dict[str, Any]] | None, call_id: Callable[[int], str] = new_call_id):
        self.schemas = schemas(tools)
        self.call_id = call_id
        self.buf = ""  # text received and not yet decided
        self.calls = 0  # calls started so far (the next one's index)
        self.state = "text"
        self.final = False

    @classmethod
    def opening(cls, name: str | None) -> str:
        """The text that starts a call (of function `name`, or of any function when None)."""
        raise NotImplementedError

    @classmethod
    def parse(cls, text: str, tools: list[dict[str, Any]] | None,
              call_id: Callable[[int], str] = new_call_id) -> tuple[str, list[ToolCall]]:
        """The whole response at once: (content outside the calls, the calls)."""
        parser = cls(tools, call_id)
        return collect(parser.feed(text) + parser.finish())

    def feed(self, delta: str) -> list[Event]:
        self.buf += delta
        return self._drain()

    def finish(self) -> list[Event]:
        """The end of the text: everything held back is decided."""
        self.final = True
        return self._drain()

    def _drain(self) -> list[Event]:
        events: list[Event] = []
        while True:
            step = self._text() if self.state == "text" else self._call()
            if step is None:
                return events
            events += step

    def _text(self) -> list[Event] | None:
        at = self.buf.find(CALL_OPEN)
        if at >= 0:
            text, self.buf, self.state = self.buf[:at], self.buf[at + len(CALL_OPEN):], "open"
            return [TextDelta(text)] if text else []
        keep = 0 if self.final else _held(self.buf, CALL_OPEN)
        text, self.buf = self.buf[:len(self.buf) - keep], self.buf[len(self.buf) - keep:]
        return [TextDelta(text)] if text else None

    def _not_a_call(self) -> list[Event]:
        """The `<tool_call>` just read opens no call: it is content, and scanning resumes after it."""
        self.state = "text"
        return [TextDelta(CALL_OPEN)]

    def _start(self, name: str) -> list[Event]:
        index, self.calls = self.calls, self.calls + 1
        return [CallStart(index, self.call_id(index), name)]

    def _call(self) -> list[Event] | None:
        raise NotImplementedError


class XmlToolCalls(StreamParser):
    """Qwen3.6 / Qwen3-Coder XML calls; arguments stream one parameter at a time."""

    name = "qwen3_coder"

    @classmethod
    def opening(cls, name: str | None) -> str:
        return CALL_OPEN + "\n" + (f"{FUNCTION_OPEN}{name}>\n" if name else "")

    def _call(self) -> list[Event] | None:
        return {"open": self._function, "args": self._between, "param": self._parameter,
                "close": self._close}[self.state]()

    def _function(self) -> list[Event] | None:
        """After `<tool_call>`: whitespace, then `<function=NAME>` naming a known function, else not a call."""
        rest = self.buf.lstrip()
        tag = _open_tag(rest, FUNCTION_OPEN)
        if tag is None and not self.final:
            return None
        if not tag or tag[0] not in self.schemas:
            return self._not_a_call()
        name, length = tag
        self.buf = rest[length:]
        self.buf = self.buf[1:] if self.buf.startswith("\n") else self.buf
        self.function, self.params = name, 0
        self.state = "args"
        return self._start(name)

    def _between(self) -> list[Event] | None:
        """Between parameters: the next `<parameter=KEY>`, `</function>` (or `</tool_call>`), else the call
        ends here and the text goes on as content."""
        rest = self.buf.lstrip()
        tag = _open_tag(rest, PARAMETER_OPEN)
        if tag:
            self.key, self.buf, self.state = tag[0], rest[tag[1]:], "param"
            return []
        for marker, state in ((FUNCTION_CLOSE, "close"), (CALL_CLOSE, "text")):
            if rest.startswith(marker):
                self.buf, self.state = rest[len(marker):], state
                return self._end_arguments()
        if not self.final and (tag is None or _could_become(rest, FUNCTION_CLOSE, CALL_CLOSE) or not rest):
            return None
        self.state = "text"
        return self._end_arguments()

    def _parameter(self) -> list[Event] | None:
        """A parameter's value runs to `</parameter>` (to the end of the text when the output was cut)."""
        at = self.buf.find(PARAMETER_CLOSE)
        if at < 0 and not self.final:
            return None
        at = len(self.buf) if at < 0 else at
        value, self.buf = self.buf[:at], self.buf[at + len(PARAMETER_CLOSE):]
        value = value[1:] if value.startswith("\n") else value  # the template writes the value on its own lines
        value = value[:-1] if value.endswith("\n") else value
        schema = self.schemas[self.function].get("properties", {}).get(self.key, {})
        piece = json.dumps(self.key, ensure_ascii=False) + ": " + json.dumps(convert(value, schema),
                                                                             ensure_ascii=False)
        fragment, self.params, self.state = ("{" if self.params == 0 else ", ") + piece, self.params + 1, "args"
        return [ArgumentsDelta(self.calls - 1, fragment)]

    def _close(self) -> list[Event] | None:
        """After `</function>`: whitespace and `</tool_call>` belong to the call; anything else is content."""
        rest = self.buf.lstrip()
        if rest.startswith(CALL_CLOSE):
            self.buf = rest[len(CALL_CLOSE):]
        elif not self.final and (not rest or _could_become(rest, CALL_CLOSE)):
            return None
        self.state = "text"
        return []

    def _end_arguments(self) -> list[Event]:
        return [ArgumentsDelta(self.calls - 1, "}" if self.params else "{}")]

class JsonToolCalls(StreamParser):
    """Qwen2.5 / Qwen3 ("hermes") JSON calls; a call comes out whole once its `</tool_call>` arrives."""

    name = "hermes"

    @classmethod
    def opening(cls, name: str | None) -> str:
        return CALL_OPEN + "\n" + (f'{{"name": {json.dumps(name)}, "arguments": ' if name else "")

    def _call(self) -> list[Event] | None:
        at = self.buf.find(CALL_CLOSE)
        if at < 0 and not self.final:
            return None
        body = self.buf[:at] if at >= 0 else self.buf
        call = self._read(body)
        if call is None:
            return self._not_a_call()
        self.buf = self.buf[at + len(CALL_CLOSE):] if at >= 0 else ""
        self.state = "text"
        index = self.calls
        return self._start(call[0]) + [ArgumentsDelta(index, json.dumps(call[1], ensure_ascii=False))]

    def _read(self, body: str) -> tuple[str, dict[str, Any]] | None:
        """(name, arguments) of a call's JSON, None unless it names a known function with an object."""
        try:
            obj = json.loads(body)
        except ValueError:
            return None
        if not isinstance(obj, dict) or obj.get("name") not in self.schemas:
            return None
        args = obj.get("arguments", obj.get("parameters", {}))
        if isinstance(args, str):  # some models write the arguments as a JSON string
            try:
                args = json.loads(args)
            except ValueError:
                return None
        return (obj["name"], args) if isinstance(args, dict) else None


PARSERS: dict[str, type[StreamParser]] = {p.name: p for p in (XmlToolCalls, JsonToolCalls)}


@dataclass
class ToolUse:
    """A chat request's tools, as every door reads them: what the template shows, and how the answer is read
    (the response's content, after the reasoning, with `opening` before it, through `parser`).

    `parser` None: the response is all content (tool_choice "none"). `forced`: the call the assistant's
    turn opens with ("" for any function: tool_choice "required"; a name: that function), None when the
    model chooses. `parallel` False: only the first call is returned."""

    tools: list[dict[str, Any]]
    parser: type[StreamParser] | None
    forced: str | None = None
    parallel: bool = True
    constrained: bool = False  # the forced call comes from a grammar (`grammar_spec`), not a written opening

    @property
    def opening(self) -> str:
        """The server's text that starts the assistant's turn ("" unless a call is forced without a grammar)."""
        if self.forced is None or self.parser is None or self.constrained:
            return ""
        return self.parser.opening(self.forced or None)

    def grammar_spec(self) -> dict[str, Any]:
        """The constraints spec of a forced call (docs/structured_output.md, Tool calls)."""
        choice = {"type": "function", "function": {"name": self.forced}} if self.forced else "required"
        return {"type": "tool_calls", "tools": self.tools, "tool_choice": choice,
                "parallel_tool_calls": self.parallel}

    def keeps(self, event: Event) -> bool:
        """Whether the response shows this event (`parallel` False: calls after the first are dropped)."""
        return self.parallel or isinstance(event, TextDelta) or event.index == 0


def parser_for(chat_template: str | None, override: str | None = None) -> type[StreamParser] | None:
    """The tool-call format of a model: `override` (a name in PARSERS) if given, else the one its chat
    template writes calls in (`<function=` XML, else JSON in `<tool_call>`), else None (no tool support)."""
    if override and override != "auto":
        return PARSERS[override]
    template = chat_template or ""
    if CALL_OPEN not in template:
        return None
    return XmlToolCalls if FUNCTION_OPEN in template else JsonToolCalls


def collect(events: list[Event]) -> tuple[str, list[ToolCall]]:
    """Events joined: (the content, the calls with their arguments put together)."""
    text, starts, args = [], {}, {}
    for ev in events:
        if isinstance(ev, TextDelta):
            text.append(ev.text)
        elif isinstance(ev, CallStart):
            starts[ev.index], args[ev.index] = ev, []
        else:
            args[ev.index].append(ev.fragment)
    calls = [ToolCall(s.id, s.name, "".join(args[i])) for i, s in sorted(starts.items())]
    return "".join(text), calls


# --- parameter values by their JSON schema (the XML format writes every value as text) -----------------------
def _types(schema: dict[str, Any]) -> list[str]:
    kind = schema.get("type")
    if isinstance(kind, str):
        return [kind]
    if isinstance(kind, list):
        return [k for k in kind if isinstance(k, str)]
    if "enum" in schema:
        return ["enum"]
    return []


def convert(value: str, schema: dict[str, Any]) -> Any:
    """A parameter's text as the value its schema's type says (the template wrote `str()` of a scalar, JSON
    of an object or array): `string` stays text; `integer`, `number`, `boolean`, `null`, `object`, `array`
    are read when the text is one, tried in the schema's order; a type list with `string` keeps the text (null
    for `null`/`None` where it lists `null`); a schema without a type (`enum`, `anyOf`, a parameter it does
    not list) reads JSON when the text is JSON. Text that is none of them stays text."""
    kinds = _types(schema if isinstance(schema, dict) else {})
    if "string" in kinds:  # text, or null where the schema allows it
        return None if "null" in kinds and value.strip().lower() in ("null", "none") else value
    for kind in kinds or ["json"]:
        ok, out = _read_as(kind, value.strip())
        if ok:
            return out
    return value


def _read_as(kind: str, text: str) -> tuple[bool, Any]:
    if kind == "integer" and re.fullmatch(r"[-+]?\d+", text):
        return True, int(text)
    if kind == "number" and re.fullmatch(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?", text):
        number = float(text)
        return True, int(number) if number.is_integer() and re.fullmatch(r"[-+]?\d+", text) else number
    if kind == "boolean" and text.lower() in ("true", "false"):
        return True, text.lower() == "true"
    if kind == "null" and text.lower() in ("null", "none"):
        return True, None
    if kind in ("object", "array", "json", "enum"):
        try:
            out = json.loads(text)
        except ValueError:
            return False, None
        wanted = {"object": dict, "array": list}.get(kind, object)
        return isinstance(out, wanted), out
    return False, None
