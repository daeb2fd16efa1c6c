"""Request specs -> grammar text for the engine (docs/structured_output.md, Specs).

Three kinds of spec, each a plain dict as the request gives it:

- `{"type": "json_object"}`: any JSON object.
- `{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}`: OpenAI's `response_format`.
- `{"type": "tool_calls", "tools": [...], "tool_choice": "required" | {"type": "function", "function":
  {"name": ...}}, "parallel_tool_calls": bool}`: one or more calls in the Qwen3.6 XML format.

JSON is compact (no whitespace between tokens, `,` and `:` alone), so a model cannot loop on spaces. Every
failure is a GrammarError naming the request field at fault.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from clover_export.constraints.vocab import engine
from clover_export.core.errors import CloverError

# the engine's JSON options: no whitespace at all; a schema's own "x-guidance" is dropped, never merged
COMPACT = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}
TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for a function name
PARAM_END = "\n</parameter>\n"  # the Qwen3.6 XML format (docs/structured_output.md, Tool calls)
REFS = ("$defs", "definitions")  # where a parameters schema keeps what its "$ref"s name


class GrammarError(CloverError):
    """A spec the engine cannot take: `field` is the request's field (`response_format.json_schema.schema`,
    `tools[0].function.parameters`, `tool_choice`), `why` what is wrong with it."""

    def __init__(self, field: str, why: str):
        self.field, self.why = field, why
        super().__init__("grammar", f"{field}: {why}")

    def __reduce__(self):
        return (type(self), (self.field, self.why))


@dataclass(frozen=True)
class Source:
    """Grammar text for the engine, the field it came from, and its parts (field, grammar text) to blame one
    by one when the whole does not compile."""

    grammar: str
    field: str
    parts: tuple[tuple[str, str], ...] = ()


def _object(value: Any, field: str) -> dict:
    if not isinstance(value, dict):
        raise GrammarError(field, f"must be an object, not {type(value).__name__}")
    return value


def json_grammar(schema: dict, field: str) -> str:
    """The engine's grammar for a JSON schema, compact."""
    schema = {k: v for k, v in schema.items() if k != "x-guidance"}
    try:
        return engine().LLMatcher.grammar_from_json_schema(schema, overrides=COMPACT)
    except ValueError as e:
        raise GrammarError(field, str(e).strip().splitlines()[0][:200]) from None


def _response_format_source(spec: dict) -> Source:
    if spec["type"] == "json_object":
        return Source(json_grammar({"type": "object"}, "response_format"), "response_format")
    body = _object(spec.get("json_schema"), "response_format.json_schema")
    field = "response_format.json_schema.schema"
    schema = _object(body.get("schema", {}), field)  # absent: any JSON value, as OpenAI
    return Source(json_grammar(schema, field), field)


def grammar_source(spec: Any) -> Source:
    """The grammar text of a spec (module docstring)."""
    kind = spec.get("type") if isinstance(spec, dict) else None
    if kind in ("json_object", "json_schema"):
        return _response_format_source(spec)
    if kind == "tool_calls":
        return tool_calls_source(spec)
    raise GrammarError("response_format.type", f"{json.dumps(kind)} is not one of json_object, json_schema")


def spec_field(spec: Any) -> str:
    """The request field a spec's size and time limits are charged to."""
    if isinstance(spec, dict) and spec.get("type") == "tool_calls":
        return "tools"
    if isinstance(spec, dict) and spec.get("type") == "json_schema":
        return "response_format.json_schema.schema"
    return "response_format"


# --- tool calls (Qwen3.6 XML) ------------------------------------------------------------------------------
def _literal(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def is_raw_text(schema: dict) -> bool:
    """A parameter written as raw text between its tags (a string); every other one is compact JSON."""
    if schema.get("type") == "string":
        return True
    values = schema["enum"] if isinstance(schema.get("enum"), list) else [schema["const"]] if "const" in schema else []
    return "type" not in schema and bool(values) and all(isinstance(v, str) for v in values)


def _anchored(pattern: str) -> str:
    """A JSON Schema pattern (a search anywhere in the string) as a whole-string regex for the engine."""
    body = engine().regex_to_lark(pattern, "dw")
    head = "" if body.startswith("^") else "(?s:.*)"
    body = body.removeprefix("^")
    tail = "" if body.endswith("$") and not body.endswith("\\$") else "(?s:.*)"
    body = body if tail else body[:-1]
    return f"{head}(?:{body}){tail}"


def _raw_terminal(schema: dict, field: str) -> str:
    """A raw-text value and its closing tag as one terminal: the closing tag appears once, at the end, so
    the value is what a parser reads up to the first closing tag."""
    if "format" in schema:
        raise GrammarError(f"{field}.format", "is not supported for a string parameter (written as raw text)")
    values = schema["enum"] if "enum" in schema else [schema["const"]] if "const" in schema else None
    if values is not None and not isinstance(values, list):
        raise GrammarError(f"{field}.enum", "must be a list")
    if values is not None:
        return " | ".join(_literal(str(v) + PARAM_END) for v in values)
    lo, hi = schema.get("minLength", 0), schema.get("maxLength", "")
    if not isinstance(lo, int) or not isinstance(hi, (int, str)) or (isinstance(hi, int) and not 0 <= lo <= hi):
        raise GrammarError(field, "minLength and maxLength must be integers, 0 <= minLength <= maxLength")
    value = f"/(?s:.){{{lo},{hi}}}/"
    if "pattern" in schema:
        if not isinstance(schema["pattern"], str):
            raise GrammarError(f"{field}.pattern", "must be a string")
        value += f" & /{_anchored(schema['pattern'])}/"
    return f'(({value}) "\\n</parameter>\\n") & ~/(?s:.*)\\n<\\/parameter>\\n(?s:.+)/'


def _json_value(schema: dict, defs: dict) -> str:
    return f"%json {json.dumps({**schema, **defs, 'x-guidance': COMPACT}, ensure_ascii=False)} {_literal(PARAM_END)}"


def _parameters(tool: int, params: dict, field: str) -> tuple[list[str], list[tuple[str, str]]]:
    """Lark lines of one function's parameters (in the schema's order, the required ones always there) and
    each parameter's value alone as a (field, grammar) part."""
    props = _object(params.get("properties", {}), f"{field}.properties")
    required = params.get("required", [])
    if not isinstance(required, list) or not all(isinstance(r, str) and r in props for r in required):
        raise GrammarError(f"{field}.required", "must list names of `properties`")
    defs = {k: params[k] for k in REFS if k in params}
    lines, parts, seq = [], [], []
    for j, (key, schema) in enumerate(props.items()):
        where = f"{field}.properties.{key}"
        if not key or re.search(r"[<>\n]", key):
            raise GrammarError(where, "a parameter name cannot be empty or hold '<', '>' or a newline")
        schema = _object(schema, where)
        name, tag = f"p_{tool}_{j}", _literal(f"<parameter={key}>" + "\n")
        if is_raw_text(schema):
            terminal = _raw_terminal(schema, where)
            lines += [f"{name}: {tag} RAW_{tool}_{j}", f"RAW_{tool}_{j}: {terminal}"]
            parts.append((where, f"start: RAW\nRAW: {terminal}"))
        else:
            lines.append(f"{name}: {tag} {_json_value(schema, defs)}")
            parts.append((where, f"start: {_json_value(schema, defs)}"))
        seq.append(name if key in required else f"{name}?")
    return [f"params_{tool}: {' '.join(seq)}" if seq else f"params_{tool}: \"\""] + lines, parts


def _function(tool: Any, i: int) -> tuple[str, dict]:
    field = f"tools[{i}]"
    tool = _object(tool, field)
    if tool.get("type", "function") != "function":
        raise GrammarError(f"{field}.type", "must be \"function\"")
    fn = _object(tool.get("function"), f"{field}.function")
    name = fn.get("name")
    if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
        raise GrammarError(f"{field}.function.name", "must be 1-64 letters, digits, '_' or '-'")
    params = _object(fn.get("parameters", {"type": "object"}), f"{field}.function.parameters")
    if params.get("type", "object") != "object":
        raise GrammarError(f"{field}.function.parameters.type", "must be \"object\"")
    return name, params


def _chosen(tool_choice: Any, names: list[str]) -> list[int]:
    """Indexes of the tools a call may name."""
    if tool_choice == "required":
        return list(range(len(names)))
    fn = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if isinstance(name, str) and name in names:
        return [names.index(name)]
    shown = json.dumps(tool_choice)
    shown = shown if len(shown) <= 60 else shown[:60] + "..."
    raise GrammarError("tool_choice", f"must be \"required\" or a function of `tools` (got {shown})")


def tool_calls_source(spec: dict) -> Source:
    tools = spec.get("tools")
    if not isinstance(tools, list) or not tools:
        raise GrammarError("tools", "must be a non-empty list")
    functions = [_function(t, i) for i, t in enumerate(tools)]
    names = [n for n, _ in functions]
    if len(set(names)) < len(names):
        raise GrammarError("tools", "function names must be unique")
    lines, parts = [], []
    chosen = _chosen(spec.get("tool_choice", "required"), names)
    for i in chosen:
        rules, json_parts = _parameters(i, functions[i][1], f"tools[{i}].function.parameters")
        head, tail = _literal(f"<tool_call>\n<function={names[i]}>\n"), _literal("</function>\n</tool_call>")
        lines += [f"call_{i}: {head} params_{i} {tail}", *rules]
        parts += json_parts
    call = " | ".join(f"call_{i}" for i in chosen)
    start = f"start: call (\"\\n\" call)*\ncall: {call}" if spec.get("parallel_tool_calls", True) else f"start: {call}"
    return Source("\n".join([start, *lines]), "tools", tuple(parts))
