"""Structured output's grammar layer (clover_export/constraints, docs/structured_output.md) on the embedded
default's real tokenizer: random walks through the token mask give text that the `json` module parses and
`jsonschema` validates, tool calls that a hand-written parser of the Qwen3.6 XML format reads back, and the
mask, rollback, cache and limits behave as documented."""

from __future__ import annotations

import json
import random
import re
import threading
import time

import jsonschema
import pytest
import torch

from clover_export.constraints import (
    CompileLimits,
    GrammarCompiler,
    GrammarError,
    allocate_bitmask,
    apply_masks_,
    compile,
    tokenizer_info,
    unpack_bitmask,
)
from clover_export.core.errors import CloverError
from clover_export.tiny import TRAINED_DIR
from clover_export.tiny.tokenizer_assets import END_TOKENS, VOCAB_SIZE, special_token_ids

PADDED = VOCAB_SIZE + 8  # a model whose embedding has 8 rows past the tokenizer's ids
END_IDS = [special_token_ids()[t] for t in END_TOKENS]
SPECIAL_IDS = set(special_token_ids().values())
STRUCTURE = set('"{}[],:') | {"\n</"}


@pytest.fixture(scope="module")
def vocab():
    return tokenizer_info(TRAINED_DIR, PADDED, END_IDS)


@pytest.fixture(scope="module")
def compiler(vocab):
    c = GrammarCompiler(vocab)
    yield c
    c.close()


def json_schema(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "out", "schema": schema}}


def allowed_ids(matcher, row) -> list[int]:
    matcher.fill_mask(row)
    return unpack_bitmask(row[None], PADDED)[0].nonzero().flatten().tolist()


def closes_something(vocab, token: int) -> bool:
    text = vocab.tokenizer.decode_str([token])
    return token in END_IDS or any(s in text for s in STRUCTURE)


def walk(grammar, rng: random.Random, max_tokens: int = 600) -> str:
    """Random allowed tokens until the grammar is complete (half the time one that closes a value, so walks
    end); every mask refuses padding ids and special tokens other than the end tokens, and once complete it
    allows the end tokens alone. The text without its end token."""
    vocab, matcher, row = grammar.vocab, grammar.matcher(), allocate_bitmask(1, grammar.vocab)[0]
    out = []
    while not matcher.is_terminated():
        assert len(out) < max_tokens, f"no end after {max_tokens} tokens: {vocab.tokenizer.decode_str(out)!r}"
        allowed = allowed_ids(matcher, row)
        assert allowed and max(allowed) < VOCAB_SIZE, "a padding id (past the tokenizer) allowed"
        assert not (set(allowed) & SPECIAL_IDS) - set(END_IDS), "a special token allowed as text"
        closing = [t for t in allowed if closes_something(vocab, t)]
        token = rng.choice(closing if closing and rng.random() < 0.5 else allowed)
        out.append(token)
        assert matcher.accept(token), matcher.error
    assert set(allowed_ids(matcher, row)) == set(END_IDS) and matcher.accept(END_IDS[0])
    return vocab.tokenizer.decode_str([t for t in out if t not in END_IDS])


def assert_compact(text: str) -> None:
    """No whitespace outside JSON strings."""
    outside = re.sub(r'"(?:[^"\\]|\\.)*"', '""', text)
    assert not re.search(r"\s", outside), f"whitespace in {text!r}"


class Address:
    SCHEMA = {"type": "object", "properties": {"street": {"type": "string", "maxLength": 12},
                                                "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
              "required": ["street", "zip"], "additionalProperties": False}


SCHEMAS = {
    "nested": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 10},
        "home": Address.SCHEMA,
        "work": {"type": "object", "properties": {"address": Address.SCHEMA, "floor": {"type": "integer"}},
                 "required": ["address"], "additionalProperties": False}},
        "required": ["name", "home"], "additionalProperties": False},
    "enums": {"type": "object", "properties": {
        "color": {"enum": ["red", "green", "blue"]}, "size": {"enum": [1, 2, 3, None]},
        "kind": {"const": "fixed"}},
        "required": ["color", "size", "kind"], "additionalProperties": False},
    "bounded_arrays": {"type": "object", "properties": {
        "digits": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
                   "minItems": 2, "maxItems": 4},
        "words": {"type": "array", "items": {"type": "string", "maxLength": 5}, "maxItems": 3},
        "pairs": {"type": "array", "items": {"type": "array", "items": {"type": "boolean"},
                                             "minItems": 2, "maxItems": 2}, "minItems": 1, "maxItems": 2}},
        "required": ["digits", "words", "pairs"], "additionalProperties": False},
    "numbers": {"type": "object", "properties": {
        "count": {"type": "integer", "minimum": -5, "maximum": 500},
        "ratio": {"type": "number", "minimum": 0, "maximum": 1},
        "price": {"type": "number", "exclusiveMinimum": 10},
        "any": {"type": "number"}},
        "required": ["count", "ratio", "price", "any"], "additionalProperties": False},
    "refs_and_unions": {"$defs": {"leaf": {"type": "object", "properties": {"v": {"type": "integer"}},
                                           "required": ["v"], "additionalProperties": False}},
                        "type": "object", "properties": {
        "a": {"$ref": "#/$defs/leaf"}, "b": {"anyOf": [{"$ref": "#/$defs/leaf"}, {"type": "null"}]},
        "c": {"type": ["string", "integer"], "maxLength": 4}},
        "required": ["a", "b", "c"], "additionalProperties": False},
    "top_level_array": {"type": "array", "items": {"enum": ["x", "y"]}, "minItems": 1, "maxItems": 5},
}


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_random_walks_through_the_mask_give_json_that_validates(compiler, name):
    schema = SCHEMAS[name]
    grammar = compiler.compile(json_schema(schema))
    for seed in range(6):
        text = walk(grammar, random.Random(seed))
        jsonschema.validate(json.loads(text), schema)
        assert_compact(text)


def test_json_object_walks_give_compact_json_objects(compiler):
    grammar = compiler.compile({"type": "json_object"})
    for seed in range(6):
        text = walk(grammar, random.Random(seed))
        assert isinstance(json.loads(text), dict)
        assert_compact(text)


def test_a_schema_cannot_turn_whitespace_back_on(compiler, vocab):
    schema = {"x-guidance": {"whitespace_flexible": True, "whitespace_pattern": "[ \\n]{0,50}"},
              "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    m = compiler.compile(json_schema(schema)).matcher()
    assert m.accept(vocab.tokenizer.tokenize_str("{")[0])
    spaces = [t for t in range(VOCAB_SIZE) if vocab.tokenizer.decode_str([t]).isspace()]
    assert spaces and not any(m.allowed(t) for t in spaces)


def test_a_pydantic_model_schema_as_the_openai_client_sends_it(compiler):
    pydantic = pytest.importorskip("pydantic")
    from typing import Literal, Optional

    class Step(pydantic.BaseModel):
        explanation: str = pydantic.Field(max_length=8)
        output: int

    class Solution(pydantic.BaseModel):
        steps: list[Step] = pydantic.Field(min_length=1, max_length=2)
        verdict: Literal["yes", "no"]
        note: Optional[str] = pydantic.Field(default=None, max_length=4)

    schema = Solution.model_json_schema()
    grammar = compiler.compile(json_schema(schema))
    for seed in range(4):
        Solution.model_validate_json(walk(grammar, random.Random(seed)))


# --- tool calls ---------------------------------------------------------------------------------------------
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {
            "city": {"type": "string", "minLength": 2, "maxLength": 12},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
        "required": ["city", "days"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "sort-digits", "parameters": {
        "type": "object", "properties": {
            "digits": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "maxItems": 5},
            "options": {"type": "object", "properties": {"reverse": {"type": "boolean"}},
                        "required": ["reverse"], "additionalProperties": False},
            "code": {"type": "string", "pattern": "^[A-Z]{2}[0-9]$"},
            "memo": {"type": "string", "maxLength": 30}},
        "required": ["digits", "code"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "now"}},
]
CALL = re.compile(r"<tool_call>\n<function=([^>\n]+)>\n(.*?)</function>\n</tool_call>", re.S)
PARAM = re.compile(r"<parameter=([^>\n]+)>\n(.*?)\n</parameter>\n", re.S)


def parse_calls(text: str) -> list[tuple[str, dict]]:
    """The Qwen3.6 XML calls of `text` (nothing else in it): a string parameter's value is its raw text, any
    other parameter's is JSON."""
    calls = list(CALL.finditer(text))
    assert "\n".join(c.group(0) for c in calls) == text, f"not only tool calls: {text!r}"
    out = []
    for c in calls:
        tool = next(t["function"] for t in TOOLS if t["function"]["name"] == c.group(1))
        props = tool.get("parameters", {}).get("properties", {})
        params = list(PARAM.finditer(c.group(2)))
        assert "".join(p.group(0) for p in params) == c.group(2), f"bad parameters: {c.group(2)!r}"
        args = {p.group(1): p.group(2) if props[p.group(1)].get("type") == "string" else json.loads(p.group(2))
                for p in params}
        out.append((c.group(1), args))
    return out


def validate_calls(calls: list[tuple[str, dict]]) -> None:
    for name, args in calls:
        tool = next(t["function"] for t in TOOLS if t["function"]["name"] == name)
        jsonschema.validate(args, tool.get("parameters", {"type": "object", "maxProperties": 0}))


def test_tool_choice_required_walks_give_calls_that_validate(compiler):
    grammar = compiler.compile({"type": "tool_calls", "tools": TOOLS, "tool_choice": "required"})
    names = set()
    for seed in range(12):
        calls = parse_calls(walk(grammar, random.Random(seed), max_tokens=1500))
        assert calls
        validate_calls(calls)
        names |= {n for n, _ in calls}
    assert names == {"get_weather", "sort-digits", "now"}


def test_a_named_function_and_no_parallel_calls_give_exactly_one_call_to_it(compiler):
    spec = {"type": "tool_calls", "tools": TOOLS, "parallel_tool_calls": False,
            "tool_choice": {"type": "function", "function": {"name": "sort-digits"}}}
    grammar = compiler.compile(spec)
    for seed in range(8):
        calls = parse_calls(walk(grammar, random.Random(seed), max_tokens=1500))
        assert [n for n, _ in calls] == ["sort-digits"]
        validate_calls(calls)


def test_a_raw_string_value_ends_at_the_first_closing_tag(compiler, vocab):
    """A value cannot hold its own closing tag (a parser would cut it there)."""
    tools = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"s": {"type": "string"}}, "required": ["s"]}}}]
    m = compiler.compile({"type": "tool_calls", "tools": tools}).matcher()
    prefix = "<tool_call>\n<function=f>\n<parameter=s>\nab\n</parameter>\n"
    for t in vocab.tokenizer.tokenize_str(prefix):
        assert m.accept(t)
    assert not m.allowed(vocab.tokenizer.tokenize_str("x")[0])  # only </function> may follow
    assert m.allowed(vocab.tokenizer.tokenize_str("</")[0])


# --- the mask: padding, width, rollback, drafts, logits -----------------------------------------------------
def test_padding_ids_and_the_mask_width(vocab, compiler):
    m = compiler.compile(json_schema({"type": "string"})).matcher()
    row = allocate_bitmask(1, vocab)[0]
    assert row.numel() == (PADDED + 31) // 32
    for t in vocab.tokenizer.tokenize_str('"ab'):  # inside a string almost every token is allowed
        assert m.accept(t)
    allowed = allowed_ids(m, row)
    assert len(allowed) > 300 and max(allowed) < VOCAB_SIZE
    assert not any(m.allowed(t) for t in range(VOCAB_SIZE, PADDED)) and not m.accept(VOCAB_SIZE)
    with pytest.raises(CloverError, match="vocab_size 500 is smaller than the tokenizer's 512"):
        tokenizer_info(TRAINED_DIR, 500, END_IDS)
    with pytest.raises(CloverError, match="mask row"):
        m.fill_mask(torch.zeros(row.numel() - 1, dtype=torch.int32))


def test_rollback_restores_the_exact_mask(compiler, vocab):
    grammar = compiler.compile(json_schema(SCHEMAS["bounded_arrays"]))
    row = allocate_bitmask(1, vocab)[0]
    for seed in range(5):
        rng = random.Random(seed)
        m = grammar.matcher()
        for step in range(rng.randint(1, 12)):
            assert m.accept(rng.choice(allowed_ids(m, row)))
        before = allowed_ids(m, row)
        n = 0
        for _ in range(rng.randint(1, 6)):
            if m.is_terminated():
                break
            assert m.accept(rng.choice(allowed_ids(m, row)))
            n += 1
        m.rollback(n)
        assert allowed_ids(m, row) == before


def test_draft_masks_are_the_masks_after_each_draft_prefix(compiler, vocab):
    grammar = compiler.compile(json_schema(SCHEMAS["enums"]))
    m = grammar.matcher()
    draft = vocab.tokenizer.tokenize_str('{"color":"green","size":2')
    rows = allocate_bitmask(len(draft) + 2, vocab)
    bad = vocab.tokenizer.tokenize_str("x")[0]
    assert m.fill_draft_masks([*draft, bad], rows) == len(draft)  # the refused last token is not taken
    for i in range(len(draft) + 1):
        fresh = grammar.matcher()
        for t in draft[:i]:
            assert fresh.accept(t)
        expected = [t for t in range(PADDED) if fresh.allowed(t)]
        assert unpack_bitmask(rows[i:i + 1], PADDED)[0].nonzero().flatten().tolist() == expected
    assert allowed_ids(m, rows[0].clone()) == [t for t in range(PADDED) if grammar.matcher().allowed(t)]


def test_apply_masks_sets_refused_logits_to_minus_inf_on_the_rows_with_a_matcher(compiler, vocab):
    a = compiler.compile(json_schema(SCHEMAS["numbers"])).matcher()
    b = compiler.compile({"type": "json_object"}).matcher()
    for t in vocab.tokenizer.tokenize_str('{"a":'):
        assert b.accept(t)
    logits = torch.randn(3, PADDED)
    before = logits.clone()
    apply_masks_(logits, [a, None, b])
    assert torch.equal(logits[1], before[1])
    for row, m in ((0, a), (2, b)):
        # the engine's byte-per-token mask (200 = allowed): a reference independent of the bit layout
        allowed = torch.frombuffer(bytearray(m._m.compute_logit_bias()), dtype=torch.uint8)[:PADDED] == 200
        assert 0 < allowed.sum() < PADDED
        assert torch.equal(logits[row][allowed], before[row][allowed])
        assert torch.isneginf(logits[row][~allowed]).all()
    with pytest.raises(CloverError, match="do not match"):
        apply_masks_(torch.zeros(3, VOCAB_SIZE), [a, None, b])


# --- the compiler: cache, limits, errors --------------------------------------------------------------------
def test_compile_keeps_one_compiler_and_cache_per_vocabulary(vocab):
    spec = json_schema(SCHEMAS["top_level_array"])
    assert compile(spec, vocab) is compile(json.loads(json.dumps(spec)), vocab)
    assert compile(spec, tokenizer_info(TRAINED_DIR, PADDED, END_IDS)) is not compile(spec, vocab)


def test_a_refused_spec_is_refused_again_from_the_cache(compiler):
    spec = json_schema({"type": "string", "format": "no-such-format"})
    first = pytest.raises(GrammarError, compiler.compile, spec).value
    hits = compiler.hits
    again = pytest.raises(GrammarError, compiler.compile, spec).value
    assert compiler.hits == hits + 1 and again is not first and again.why == first.why


def test_the_same_spec_gives_the_same_compiled_grammar_and_the_cache_is_bounded(vocab):
    c = GrammarCompiler(vocab, cache_size=2)
    try:
        first = c.compile(json_schema(SCHEMAS["enums"]))
        assert c.compile(json.loads(json.dumps(json_schema(SCHEMAS["enums"])))) is first  # an equal copy
        assert (c.hits, c.misses) == (1, 1)
        other = c.compile(json_schema(SCHEMAS["numbers"]))
        assert other is not first
        c.compile({"type": "json_object"})  # a third spec pushes the least recently used out
        again = c.compile(json_schema(SCHEMAS["enums"]))
        assert again is not first and (c.hits, c.misses) == (1, 4)
        assert c.compile(json_schema(SCHEMAS["enums"])) is again
    finally:
        c.close()


# 4096 branches that the engine multiplies out: 0.7-2 s of compile (idle to loaded machine) for 2.7 KB of schema
PATHOLOGICAL = {"allOf": [{"anyOf": [{"type": "object", "properties": {f"k{i}{j}": {"type": "integer"}},
                                      "required": [f"k{i}{j}"]} for j in range(8)]} for i in range(4)]}


def test_a_pathological_schema_times_out_naming_the_field_while_another_compile_proceeds(vocab):
    c = GrammarCompiler(vocab, CompileLimits(seconds=0.1))
    errors, done = [], {}
    slow = threading.Thread(target=lambda: (_capture(errors, c, PATHOLOGICAL), done.setdefault("slow", time.time())))
    try:
        slow.start()
        time.sleep(0.05)
        grammar = c.compile(json_schema(SCHEMAS["enums"]))
        done["fast"] = time.time()
        slow.join(30)
        assert grammar.matcher().allowed(vocab.tokenizer.tokenize_str("{")[0])
        assert done["fast"] < done["slow"]
        assert len(errors) == 1 and errors[0].field == "response_format.json_schema.schema"
        assert "did not compile within 0.1 s" in str(errors[0])
    finally:
        c.close()


def _capture(errors: list, compiler: GrammarCompiler, schema: dict) -> None:
    try:
        compiler.compile(json_schema(schema))
    except GrammarError as e:
        errors.append(e)


BAD_SPECS = [
    ({"type": "xml"}, "response_format.type", "is not one of"),
    ({"type": "json_schema", "json_schema": {"schema": []}}, "response_format.json_schema.schema", "object"),
    (json_schema({"type": "string", "format": "no-such-format"}), "response_format.json_schema.schema",
     "format"),
    (json_schema({"type": "object", "properties": {f"p{i}": {"type": "string", "description": "x" * 100}
                                                   for i in range(700)}}),
     "response_format.json_schema.schema", "more than the limit of 65536"),
    ({"type": "tool_calls", "tools": []}, "tools", "non-empty"),
    ({"type": "tool_calls", "tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice", "must be \"required\" or a function of `tools`"),
    ({"type": "tool_calls", "tools": [{"type": "function", "function": {"name": "bad name"}}]},
     "tools[0].function.name", "letters, digits"),
    ({"type": "tool_calls", "tools": [TOOLS[2], TOOLS[2]]}, "tools", "unique"),
    ({"type": "tool_calls", "tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["b"]}}}]},
     "tools[0].function.parameters.required", "must list names"),
    ({"type": "tool_calls", "tools": [TOOLS[2], {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": ["string", "null"],
                                                                         "format": "bogus"}}}}}]},
     "tools[1].function.parameters.properties.b", "format"),
    ({"type": "tool_calls", "tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"when": {"type": "string", "format": "date-time"}}}}}]},
     "tools[0].function.parameters.properties.when.format", "raw text"),
    ({"type": "tool_calls", "tools": [TOOLS[2], {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string", "pattern": "(a"}}}}}]},
     "tools[1].function.parameters.properties.b", "regex"),
    ({"type": "tool_calls", "tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"s": {"type": "string", "minLength": 5, "maxLength": 2}}}}}]},
     "tools[0].function.parameters.properties.s", "0 <= minLength <= maxLength"),
    ({"type": "tool_calls", "tools": TOOLS, "tool_choice": {"function": "get_weather"}}, "tool_choice", "required"),
    ({"type": "tool_calls", "tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "properties": {"s": {"type": "string", "pattern": 5}}}}}]},
     "tools[0].function.parameters.properties.s.pattern", "must be a string"),
    ({"type": "tool_calls", "tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "properties": {"s": {"type": "string", "enum": "abc"}}}}}]},
     "tools[0].function.parameters.properties.s.enum", "must be a list"),
    ({"type": "tool_calls", "tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "properties": {"s": {"type": "integer"}}, "required": [{"s": 1}]}}}]},
     "tools[0].function.parameters.required", "must list names"),
    ({"type": "tool_calls", "tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "properties": ["s"]}}}]}, "tools[0].function.parameters.properties", "must be an object"),
    ({"type": "json_object", "extra": {1, 2}}, "response_format", "is not JSON"),
    ({"type": "tool_calls", "tools": [{"type": "function", "function": {"name": f"f{i}"}} for i in range(129)]},
     "tools", "129 functions, more than the limit of 128"),
]


@pytest.mark.parametrize("spec,field,why", BAD_SPECS, ids=[f"{i}-{b[1]}" for i, b in enumerate(BAD_SPECS)])
def test_a_spec_the_engine_cannot_take_is_one_error_naming_the_field(compiler, spec, field, why):
    with pytest.raises(GrammarError) as e:
        compiler.compile(spec)
    assert e.value.field == field
    assert why in e.value.why
    assert "\n" not in e.value.why and len(e.value.why) < 300
