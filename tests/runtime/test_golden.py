"""Golden files: tools/make_golden.py on a tiny transformers Qwen3.5-MoE folder, round-tripped by `compare`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from clover_export.cli import main
from clover_export.runtime.golden import read_golden, write_golden
from clover_export.testing.scripts import load_script

transformers = pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[2]


def load_tool():
    return load_script(ROOT / "tools" / "make_golden.py")


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory, tiny_dir):
    """A tiny random Qwen3_5MoeForCausalLM saved with save_pretrained, plus our tokenizer files."""
    from tiny_qwen import save_random_qwen

    out = tmp_path_factory.mktemp("qwen") / "model"
    save_random_qwen(out, tiny_dir, seed=3)
    return out


@pytest.mark.parametrize("npy", [False, True], ids=["inline", "npy"])
def test_golden_logits_round_trip_through_compare(qwen_dir, tmp_path, npy):
    golden = tmp_path / "golden.json"
    argv = [str(qwen_dir), "--prompt", "What is 2 + 3?", "--chat", "--out", str(golden)] + (["--npy"] if npy else [])
    assert load_tool().main(argv) == 0
    g = read_golden(golden)
    assert g.expected_logits.shape == (len(g.prompt_ids), 512) and g.expected_token_ids is None
    assert (golden.parent / "golden.logits.npy").exists() == npy
    assert g.prompt_ids[:1] == [1]  # templated: starts with <|im_start|>

    r = CliRunner().invoke(main, ["compare", str(golden), str(qwen_dir), "--allow-qwen"])
    assert r.exit_code == 0, r.output
    err = float(r.output.split("max |error| ")[1].split()[0])
    assert err < 1e-4 and "argmax agrees at 100.0%" in r.output and "ok" in r.output

    # a perturbed reference is caught
    d = json.loads(golden.read_text())
    logits = g.expected_logits.clone()
    logits[3, 7] += 0.05
    write_golden(golden, d["prompt_ids"], d["params"], None, logits.numpy(), npy=npy)
    r = CliRunner().invoke(main, ["compare", str(golden), str(qwen_dir), "--allow-qwen"])
    assert r.exit_code == 1 and "MISMATCH" in r.output


def test_compare_reports_first_diverging_token(tiny_dir, tmp_path):
    from clover_export.runtime import Generator

    gen = Generator.load(tiny_dir, dtype="fp32", max_slots=1)
    params = {"max_new_tokens": 20, "threshold": 0.5, "ignore_eos": True}  # past the answer: 20 tokens
    res = gen.generate("What is 123 + 456?", **params)
    golden = tmp_path / "g.json"
    write_golden(golden, res.prompt_ids, params, res.token_ids, source="our own torch backend")
    r = CliRunner().invoke(main, ["compare", str(golden), str(tiny_dir)])
    assert r.exit_code == 0, r.output
    assert "all 20 identical" in r.output
    wrong = list(res.token_ids)
    wrong[13] = (wrong[13] + 1) % 512
    write_golden(golden, res.prompt_ids, params, wrong)
    r = CliRunner().invoke(main, ["compare", str(golden), str(tiny_dir)])
    assert r.exit_code == 1 and "first divergence at response index 13" in r.output


def test_bad_golden_files_are_rejected(tmp_path):
    p = tmp_path / "bad.json"
    p.write_text(json.dumps({"format": "something else"}))
    r = CliRunner().invoke(main, ["compare", str(p)])
    assert r.exit_code == 1 and "not a golden file" in r.output and "Traceback" not in r.output
    p.write_text(json.dumps({"format": "clover-export/golden", "version": 1, "prompt_ids": [1, 2],
                             "expected_logits": [[0.0, 1.0]]}))
    r = CliRunner().invoke(main, ["compare", str(p)])
    assert r.exit_code == 1 and "expected [prompt_len=2, vocab]" in r.output
