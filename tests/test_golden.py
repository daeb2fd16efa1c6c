"""Golden files: tools/make_golden.py on a tiny transformers Qwen3.5-MoE folder, round-tripped by `compare`."""

from __future__ import annotations

import importlib.util
import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from clover_export.cli import main
from clover_export.runtime.golden import read_golden, write_golden

transformers = pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[1]


def load_tool():
    spec = importlib.util.spec_from_file_location("make_golden", ROOT / "tools" / "make_golden.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory, tiny_dir):
    """A tiny random Qwen3_5MoeForCausalLM saved with save_pretrained, plus our tokenizer files."""
    cfg = transformers.Qwen3_5MoeTextConfig(
        vocab_size=512, hidden_size=64, num_hidden_layers=4,
        layer_types=["linear_attention"] * 3 + ["full_attention"], num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
        linear_value_head_dim=16, linear_conv_kernel_dim=4, num_experts=6, num_experts_per_tok=2,
        moe_intermediate_size=32, shared_expert_intermediate_size=32,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
        rms_norm_eps=1e-6, tie_word_embeddings=False, eos_token_id=2,
    )
    torch.manual_seed(0)
    model = transformers.Qwen3_5MoeForCausalLM(cfg).eval()
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in model.named_parameters():  # every tensor random and mattering
            if name.endswith("A_log"):
                p.copy_(torch.empty(p.shape).uniform_(1.0, 16.0, generator=gen).log())
            elif name.endswith(("dt_bias", "linear_attn.norm.weight")):
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=gen))
            elif p.dim() == 1:
                p.copy_(0.3 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[-1]))
    out = tmp_path_factory.mktemp("qwen") / "model"
    model.save_pretrained(out)
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(tiny_dir / f, out / f)
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
    params = {"max_new_tokens": 20, "threshold": 0.5, "eos_token_id": [1]}  # <|endoftext|> no end: 20 tokens
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
