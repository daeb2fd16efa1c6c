"""bench/e2e_gpu.py runs end to end: its dry run (tiny config, CPU, TRITON_INTERPRET=1) goes through every section.

The GPU run is the same code with the full config, bf16 and CUDA graphs; this is
what makes it likely to run the first time it meets a GPU.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_e2e_gpu_dry_run_covers_every_section(tmp_path):
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-u", str(ROOT / "bench/e2e_gpu.py"), "--dry-run", "--out", str(tmp_path)],
                          env=env, capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads((tmp_path / "e2e_gpu.json").read_text())
    assert set(res["sections"].values()) == {"ok"}, res["sections"]
    rows = res["rows"]
    kinds = {(r["experts"], r["router"], r["step"]) for r in rows}
    assert kinds == {(e, r, s) for e in ("bf16", "fp8") for r in ("random", "zipf")
                     for s in ("denoise", "commit+denoise", "ar", "self_spec k=4", "self_spec k=7")}, (
        res["sections"], proc.stdout[-2000:])  # the dry run's block of 8 caps the draft at k = 7
    from clover_export.core.config import config_from_dict
    from clover_export.model import perf_bound

    cfg = config_from_dict(res["config"])  # the dry run's config, as the script recorded it
    assert (cfg.num_hidden_layers, cfg.num_experts, cfg.num_experts_per_tok) == (2, 8, 2)
    for r in rows:
        assert 0 < r["experts_per_layer"] <= cfg.num_experts
        if r["step"] == "ar":  # one row per request, plain top-k: between k and B x k experts
            assert cfg.num_experts_per_tok <= r["experts_per_layer"] <= r["B"] * cfg.num_experts_per_tok
        rows_n = r["B"] * (r["causal"] + r["block"])
        want = perf_bound.step_bytes(cfg, rows=rows_n, past_len=[res["env"]["past"]] * r["B"],
                                     experts_per_layer=r["experts_per_layer"], fp8=r["experts"] == "fp8", dtype_bytes=4)
        assert r["bytes_GB"] == pytest.approx(want.total / 1e9, rel=1e-9)
        assert r["time_over_bound"] == pytest.approx(r["step_ms"] / r["bound_ms"])
    zipf = [r["experts_per_layer"] for r in rows if r["router"] == "zipf" and r["step"] == "denoise"]
    rand = [r["experts_per_layer"] for r in rows if r["router"] == "random" and r["step"] == "denoise"]
    assert max(zipf) < min(rand), (zipf, rand)  # the planted skew selects fewer experts
    assert {r["tokens_per_forward"] for r in res["tokens_per_s"]} == {1.0, 2.55, 3.19}
    for r in rows:
        if r["step"].startswith("self_spec"):  # 1 + k causal rows, the logits of all of them
            assert r["logit_rows"] == r["causal"] == 1 + int(r["step"].split("=")[1]) and r["block"] == cfg.block_size
    spec = res["self_spec_tokens_per_s"]
    assert {(r["draft"], r["tokens_per_forward"]) for r in spec} == {(4, 5.0), (7, 5.46), (7, 8.0)}
    assert len(spec) == 2 * 2 * 3 * len(res["env"]["batches"])
    for r in spec:
        ar_ms = next(x["step_ms"] for x in rows if (x["experts"], x["router"], x["B"], x["step"])
                     == (r["experts"], r["router"], r["B"], "ar"))
        assert r["self_spec_tokens_per_s"] == pytest.approx(1e3 * r["B"] * r["tokens_per_forward"] / r["step_ms"])
        assert r["self_spec_over_ar"] == pytest.approx(r["self_spec_tokens_per_s"] / (1e3 * r["B"] / ar_ms))
    assert res["eager"] and all(r["compiled_vs_eager"] > 0 for r in res["eager"])
    assert (tmp_path / "e2e_gpu.md").read_text().count("|") > 50
