"""The one table of request parameters (`generation.PARAMETERS`, docs/runtime.md: Request parameters) reaches
every door alike: each entry is a `GenerationSettings` field with its default, a `clover-export generate` option
whose help says its accepted values and default, and a field of the server's request bodies; a value outside
its range is refused at each door naming it there (the runtime: the parameter; the CLI: the option, one line,
exit 1, before any model loads; the server: a 400 whose `param` is the field), against a real server process.
"""

from __future__ import annotations

import httpx
import pytest
from click.testing import CliRunner

from clover_export.cli import main
from clover_export.cli.generate import generate
from clover_export.core import generation
from clover_export.core.errors import CloverError
from clover_export.core.generation import PARAMETERS, Choice, GenerationSettings
from clover_export.serve import protocol
from clover_export.testing.server import start_server, stop_server

# The defaults as the model card and DECODING.md 1.2 and 3 give them (copied by hand: the table must keep them).
DEFAULTS = {
    "max_new_tokens": 1024, "threshold": 0.95, "do_sample": False, "temperature": 1.0, "top_k": 0, "top_p": 1.0,
    "repetition_penalty": 1.05, "frequency_penalty": 0.0, "presence_penalty": 0.9, "dllm_length_penalty": 10.0,
    "dllm_length_penalty_start": 8192, "dllm_length_penalty_window": 8192, "dllm_think_end_bias": 10.0,
    "dllm_think_end_start": 4096, "dllm_think_end_window": 4096, "enable_thinking": True, "min_tokens": 0,
    "ignore_eos": False, "seed": None, "decoding": "low_confidence", "logprobs": None, "prompt_logprobs": None,
    "draft_threshold": 0.5,
}
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def outside(accepts) -> list:
    """Values just outside an entry's accepted values: each end of its interval crossed, a word no choice
    holds, a number where a boolean goes."""
    if isinstance(accepts, Choice):
        return ["bogus"]
    if accepts.kind == "bool":
        return [1]
    out = [] if accepts.low is None else [accepts.low if accepts.low_open else accepts.low - 1]
    out += [] if accepts.high is None else [accepts.high + 1]
    return [int(v) if accepts.kind == "int" else float(v) for v in out]


def nested(data: dict, path: str, value) -> dict:
    """`data` with the dotted field `path` set to `value` (chat_template_kwargs.enable_thinking)."""
    head, _, rest = path.partition(".")
    return {**data, head: nested(data.get(head, {}), rest, value) if rest else value}


def model_field(model, path: str):
    """The pydantic field at the dotted `path` of a request model."""
    head, _, rest = path.partition(".")
    field = model.model_fields[head]
    if not rest:
        return field
    inner = next(a for a in getattr(field.annotation, "__args__", (field.annotation,)) if hasattr(a, "model_fields"))
    return model_field(inner, rest)


def test_the_table_keeps_the_defaults_and_makes_generation_settings():
    assert {p.name: p.default for p in PARAMETERS} == DEFAULTS
    fields = {f.name: f.default for f in GenerationSettings.__dataclass_fields__.values()}
    assert fields == {**DEFAULTS, "eos_token_id": (), "stop": ()}
    assert GenerationSettings() == GenerationSettings(**DEFAULTS)
    assert all(p.cli for p in PARAMETERS)
    # the server's exceptions: it samples when temperature is above 0 (OpenAI's rule), so no do_sample field; its
    # logprobs fields have OpenAI's per-endpoint shapes (chat logprobs + top_logprobs, completions logprobs; the
    # prompt's with completions echo)
    assert [p.name for p in PARAMETERS if not p.openai] == ["do_sample", "logprobs", "prompt_logprobs"]


@pytest.mark.parametrize("p", PARAMETERS, ids=lambda p: p.name)
def test_each_entry_is_a_generate_option_saying_its_values_and_default(p):
    r = CliRunner().invoke(main, ["generate", "--help"])
    assert r.exit_code == 0 and p.cli in r.output.split()
    option = next(o for o in generate.params if p.cli in o.opts)
    help_text = " ".join(option.help.split())
    assert "generation_config.json" in help_text, help_text
    if p.default is not None and not isinstance(p.default, bool):
        assert f"else {DEFAULTS[p.name]})" in help_text, help_text
    if p.accepts.kind in ("int", "real"):
        assert p.accepts.describe() in help_text, help_text
    if isinstance(p.accepts, Choice):
        assert list(option.type.choices) == list(p.accepts.values)


@pytest.mark.parametrize("p", [p for p in PARAMETERS if p.openai], ids=lambda p: p.name)
def test_each_entry_is_a_request_field_of_the_server_with_its_range(p):
    models = [protocol.ChatRequest] + ([] if "." in p.openai else [protocol.CompletionRequest])
    for model in models:
        field = model_field(model, p.openai)
        assert field.default is None  # null or absent: the model's generation_config.json, then the table's
    if "." not in p.openai:
        assert protocol.RANGES[p.openai] == (p.openai_accepts or p.accepts)
        assert f"| `{p.openai}` |" in protocol.ranges_markdown()


@pytest.mark.parametrize("p", PARAMETERS, ids=lambda p: p.name)
def test_the_runtime_and_the_cli_refuse_a_value_outside_the_range_naming_it(p):
    ends = [] if p.accepts.kind not in ("int", "real") else [None if p.accepts.low_open else p.accepts.low,
                                                              p.accepts.high]
    for end in (v for v in ends if v is not None):  # the ends themselves are accepted
        assert getattr(GenerationSettings().override(**{p.name: end}), p.name) == end
    for bad in outside(p.accepts):
        with pytest.raises(CloverError, match=f"parameter '{p.name}' must be"):
            GenerationSettings().override(**{p.name: bad})
        if p.accepts.kind == "bool":
            continue  # a flag takes no value
        r = CliRunner().invoke(main, ["generate", "--prompt", "hi", p.cli, str(bad)])
        assert r.exit_code == 1 and "Traceback" not in r.output, r.output
        line = r.output.strip()
        assert line.startswith("error: [cli] Invalid value for") and f"'{p.cli}'" in line, line
        if not isinstance(p.accepts, Choice):
            assert f"parameter '{p.name}' must be {p.accepts.describe()}" in line, line


@pytest.fixture(scope="module")
def server(tiny_dir):
    proc, url = start_server("--max-batch", "1", "--log-level", "warning")
    try:
        yield url
    finally:
        log = stop_server(proc)
    assert proc.returncode == 0, log[-3000:]


def test_the_server_refuses_a_value_outside_the_range_with_a_400_naming_the_field(server):
    refused = []
    for p in (p for p in PARAMETERS if p.openai):
        accepts = p.openai_accepts or p.accepts
        for bad in outside(accepts):
            for path, body in (("/v1/chat/completions", CHAT),
                               ("/v1/completions", {"prompt": "hi", "max_tokens": 4})):
                if "." in p.openai and path == "/v1/completions":
                    continue  # chat_template_kwargs: chat only
                r = httpx.post(server + path, json=nested(body, p.openai, bad), timeout=60)
                err = r.json()["error"]
                assert r.status_code == 400 and err["param"] == p.openai, (p.name, bad, r.text)
                if accepts.kind in ("int", "real"):
                    assert f"'{p.openai}' must be {protocol.describe(accepts)}" in err["message"], err
                refused.append(p.name)
    assert set(refused) == {p.name for p in PARAMETERS if p.openai}
    # and the ends themselves are accepted: a request at each end of every interval runs
    for p in (p for p in PARAMETERS if p.openai and p.accepts.kind in ("int", "real")):
        accepts = p.openai_accepts or p.accepts
        ends = [v for v in (None if accepts.low_open else accepts.low, accepts.high) if v is not None]
        for value in ends:
            r = httpx.post(server + "/v1/chat/completions", json=nested(CHAT, p.openai, value), timeout=120)
            assert r.status_code == 200, (p.name, value, r.text)


def test_generation_ranges_are_the_tables():
    assert generation.RANGES == {p.name: p.accepts for p in PARAMETERS}
