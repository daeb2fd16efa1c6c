"""bench/step_bound.py: its bytes rule (`perf_bound`) equals PERF.md 1's table, and its CPU dry run writes every
figure, each step's bytes by that rule."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from clover_export.core.config import config_from_dict
from clover_export.model import perf_bound
from clover_export.testing.fullsize import full_size_config

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("B,C,N,experts,fp8,gb,ms", [
    (1, 0, 32, 30, False, 11.4, 2.8),  # PERF.md 1 reference table (H200 at 4.14 TB/s)
    (1, 1, 0, 8, False, 5.9, 1.4),
    (8, 32, 32, 256, False, 70.0, 16.9),
    (8, 32, 32, 256, True, 37.9, 9.2),
])
def test_step_bytes_match_the_perf_table(B, C, N, experts, fp8, gb, ms):
    cfg = full_size_config()
    by = perf_bound.step_bytes(cfg, rows=B * (C + N), past_len=[4096] * B,
                               experts_per_layer=[experts] * cfg.num_hidden_layers, fp8=fp8, dtype_bytes=2)
    assert by.total / 1e9 == pytest.approx(gb, rel=0.05)  # the table's figures are rounded ("~")
    assert 1e3 * by.total / 4.14e12 == pytest.approx(ms, rel=0.06)
    assert by.embedding == B * (C + N) * cfg.hidden_size * 2  # rows, not the 1 GB table


@pytest.mark.slow
def test_dry_run_writes_every_scenario(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, str(ROOT / "bench/step_bound.py"), "--dry-run", "--routers", "zipf",
                           "--out", str(tmp_path)], env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads((tmp_path / "step_bound_dryrun.json").read_text())
    assert res["errors"] == []
    steps = {s["name"]: s for s in res["steps"]}
    assert set(steps) == {"b1_denoise", "b1_ar_decode", "b8_commit_denoise", "b8_commit_denoise_fp8"}
    for s in steps.values():
        assert s["ms"] > 0 and s["bound_ms"] == max(s["memory_bound_ms"], s["compute_bound_ms"]) > 0
    k = 4  # the dry config's top-k: one causal row selects exactly k distinct experts in every layer
    assert steps["b1_ar_decode"]["experts_per_layer"] == dict(mean=k, min=k, max=k)
    assert steps["b8_commit_denoise_fp8"]["bytes_gb"]["experts"] < steps["b8_commit_denoise"]["bytes_gb"]["experts"]
    cfg = config_from_dict(res["config"])  # the dry run's config, as the script recorded it
    assert (cfg.num_hidden_layers, cfg.num_experts, cfg.num_experts_per_tok) == (2, 16, k)
    for s in steps.values():  # the bytes reported are PERF.md 1's for the experts the step selected (fp32 here)
        want = perf_bound.step_bytes(cfg, rows=s["B"] * (s["causal_rows"] + s["block_rows"]),
                                     past_len=[res["past"]] * s["B"], experts_per_layer=s["experts_per_layer"]["mean"],
                                     fp8=s["fp8_experts"], dtype_bytes=4)
        assert s["bytes_gb"]["total"] == pytest.approx(want.total / 1e9, rel=1e-9), s["name"]
        assert s["bytes_gb"]["embedding_rows"] == pytest.approx(want.embedding / 1e9, rel=1e-9)
    moe = res["moe"]["zipf"]
    assert moe["fp8_over_bf16"] > 0 and 0 < moe["experts_selected"] <= 16
    assert moe["bf16_rel_err_vs_core"] < 1e-5 and moe["fp8_rel_err_vs_dequantized_core"] < 1e-5  # fp32 dry run
    assert 1e-4 < moe["fp8_w8a8_rel_err_vs_dequantized_core"] < 0.1  # activations quantized too: close, not equal
    # the kernel changes side by side: every variant of every chosen step timed (the dry run plays two steps)
    variants = {v["name"]: v for v in res["variants"]}
    assert set(variants) == {"b1_denoise", "b8_commit_denoise_fp8"}
    for name, v in variants.items():
        want = {"product", "product_w8a8"} if name.endswith("fp8") else {"baseline", "product"}
        assert set(v["ms"]) == want and all(ms > 0 for ms in v["ms"].values()), v
    assert res["moe_copy_fraction"]["zipf"] > 0
    assert "b8_commit_denoise router=zipf" in (tmp_path / "step_bound_dryrun_profile.txt").read_text()
