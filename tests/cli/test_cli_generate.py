"""`clover-export generate`'s decoding options: --decoding, --draft-threshold and the figures --json prints
(DECODING.md 5). User errors of the command as a subprocess are in test_cli_errors.py."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from clover_export.cli import main

PROMPT = "Reverse: 2 8 2 7 9 2 6"  # a held-out task: 18 tokens, most of them self_spec drafts the model accepts


def run_json(*args):
    r = CliRunner().invoke(main, ["generate", "--prompt", PROMPT, "--max-new-tokens", "40", "--json", *args])
    assert r.exit_code == 0, r.output
    return json.loads(r.output.strip().splitlines()[-1])


def test_help_says_what_each_mode_guarantees():
    r = CliRunner().invoke(main, ["generate", "--help"])
    assert r.exit_code == 0
    out = " ".join(r.output.split())  # click wraps the help text
    assert "--decoding [low_confidence|ar|self_spec]" in out
    assert "--draft-threshold FLOAT" in out
    for claim in ("low_confidence: block diffusion, the fastest", "its text differs from ar's",
                  "one token per forward: the reference", "self_spec: the same output as ar",
                  "greedy: token for token", "sampling: the same distribution", "several tokens per forward"):
        assert claim in out, claim


def test_json_reports_the_mode_and_its_forwards():
    """--decoding ar / self_spec: --json names the mode and counts forwards and accepted drafts, as the Python
    API does with those parameters; greedy self_spec prints ar's tokens in no more forwards, and with
    --draft-threshold 1 (no drafts) in ar's forwards; left out, the model's default mode is reported."""
    from clover_export.runtime import Generator

    gen = Generator.load(None, max_slots=1)
    exact, figures = ("decoding", "token_ids", "forwards"), ("tokens_per_forward", "accepted_per_forward")
    rows = {}
    for name, args, params in (("ar", ["--decoding", "ar"], {"decoding": "ar"}),
                               ("spec", ["--decoding", "self_spec"], {"decoding": "self_spec"}),
                               ("none", ["--decoding", "self_spec", "--draft-threshold", "1"],
                                {"decoding": "self_spec", "draft_threshold": 1.0})):
        row = rows[name] = run_json(*args)
        want = gen.generate(PROMPT, max_new_tokens=40, **params).to_dict()
        assert {k: row[k] for k in exact} == {k: want[k] for k in exact}, name
        assert [row[k] for k in figures] == pytest.approx([want[k] for k in figures]), name
        assert row["tokens_per_forward"] == pytest.approx(row["response_tokens"] / row["forwards"])
    ar, spec, none = rows["ar"], rows["spec"], rows["none"]
    assert ar["forwards"] >= ar["response_tokens"] - 1 and ar["accepted_per_forward"] == 0
    assert (spec["token_ids"], spec["text"]) == (ar["token_ids"], ar["text"]) == (none["token_ids"], none["text"])
    assert ar["response_tokens"] >= 8 and spec["accepted_per_forward"] > 0
    assert 0 < spec["forwards"] < ar["forwards"] == none["forwards"] and none["accepted_per_forward"] == 0
    default = run_json()
    assert default["decoding"] == "low_confidence" and default["accepted_per_forward"] == 0
    assert default["forwards"] == default["denoise_steps"]


def test_bad_decoding_values_are_one_line_usage_errors():
    r = CliRunner().invoke(main, ["generate", "--prompt", "hi", "--decoding", "bogus"])
    assert r.exit_code == 1 and "Traceback" not in r.output
    assert "error: [cli] Invalid value for '--decoding': 'bogus' is not one of" in r.output
    assert all(f"'{m}'" in r.output for m in ("low_confidence", "ar", "self_spec"))
    r = CliRunner().invoke(main, ["generate", "--prompt", "hi", "--draft-threshold", "1.5"])
    assert r.exit_code == 1 and "'draft_threshold' must be a finite number in [0, 1]" in r.output
