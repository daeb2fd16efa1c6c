"""Memory plans for the full-size and tiny configs, checked against hand arithmetic."""

import json

import pytest

from clover_export.core.config import config_from_dict
from clover_export.core.errors import CloverError
from clover_export.engines.memory_plan import plan_memory, require_fit
from clover_export.model.sizing import GiB
from clover_export.tiny import tiny_config

FULL = config_from_dict(json.loads(open("clover_export/data/clover_35b_a3b_config.json").read()))
H200 = int(139.8 * GiB)


def test_full_size_cache_arithmetic_by_hand():
    plan = plan_memory(FULL, "bf16", max_batch=2, max_context=131072, chunk=512)
    # 10 attention layers x (K + V) x 2 kv heads x 256 dims x 2 bytes, per token and row
    assert plan.attention_kv_pool == 2 * 131072 * 10 * 2 * 2 * 256 * 2
    # 30 GDN layers x (conv 8192 x 3 x 2 bytes + state 32 x 128 x 128 x 4 bytes), per row
    assert plan.gdn_state_pool == 2 * 30 * (8192 * 3 * 2 + 32 * 128 * 128 * 4)
    assert 64 * GiB < plan.weights < 65 * GiB


def test_activations_hold_the_split_attention_partials():
    """TensorRT's BlockAttentionSplit partials: fp32 acc + (m, l) per query row and head at
    launch.attention_partial_rows (2 x 192 SMs x BLOCK_M 64 / 16 heads = 1536 rows at least), by hand."""
    from clover_export.engines.memory_plan import activation_bytes, attention_partial_bytes, logits_bytes

    assert attention_partial_bytes(FULL, 8, 544) == 8 * 1536 * 16 * (256 + 2) * 4  # 544 rows < the floor
    assert attention_partial_bytes(FULL, 8, 4096) == 8 * 4096 * 16 * (256 + 2) * 4
    base = 6 * 8 * 544 * (8192 + 4096) * 2  # GDN conv + value channels
    rest = activation_bytes(FULL, 8, 544, 32) - attention_partial_bytes(FULL, 8, 544) - logits_bytes(FULL, 8, 32)
    assert rest == base


def test_activations_hold_the_logits_and_causal_logits_at_the_profile_max():
    """fp32 logits [B, block, V], causal_logits [B, R, V] at R = block (the logit_rows dim's max) and the
    logit_rows input [B, R] int32, by hand; the plan's activations count them."""
    from clover_export.engines.memory_plan import activation_bytes, logits_bytes

    V = FULL.vocab_size
    assert logits_bytes(FULL, 8, 32) == 8 * 32 * V * 4 + 8 * 32 * V * 4 + 8 * 32 * 4
    plan = plan_memory(FULL, "bf16", max_batch=8, max_context=4096, chunk=512)
    assert plan.activations == activation_bytes(FULL, 8, 512 + 32, 32) >= logits_bytes(FULL, 8, 32)


def test_bf16_fits_h200_at_small_batch_not_at_large():
    ok = plan_memory(FULL, "bf16", 4, 131072, 512, gpu_bytes=H200)
    assert ok.fits
    require_fit(ok)
    big = plan_memory(FULL, "bf16", 64, 131072, 512, gpu_bytes=H200)
    assert big.fits is False
    with pytest.raises(CloverError) as e:
        require_fit(big)
    msg = str(e.value)
    assert "does not fit" in msg and "--max-batch" in msg and "--precision fp8" in msg
    # the suggested batch really fits
    nb = big.max_batch_that_fits()
    assert plan_memory(FULL, "bf16", nb, 131072, 512, gpu_bytes=H200).fits
    assert not plan_memory(FULL, "bf16", nb + 1, 131072, 512, gpu_bytes=H200).fits


def test_fp8_halves_the_gemm_weights_and_fits_more():
    bf16 = plan_memory(FULL, "bf16", 8, 65536, 512, gpu_bytes=H200)
    fp8 = plan_memory(FULL, "fp8", 8, 65536, 512, gpu_bytes=H200)
    assert 0.5 < fp8.weights / bf16.weights < 0.56
    assert fp8.max_batch_that_fits() > bf16.max_batch_that_fits()


def test_weights_alone_too_big():
    with pytest.raises(CloverError, match="weights alone|--precision fp8"):
        require_fit(plan_memory(FULL, "bf16", 1, 1024, 64, gpu_bytes=40 * GiB))


def test_bad_arguments():
    cfg = tiny_config()
    with pytest.raises(CloverError, match="max_context"):
        plan_memory(cfg, "bf16", 1, cfg.max_context + 1, 64)
    with pytest.raises(CloverError, match="--max-batch"):
        plan_memory(cfg, "bf16", 0, 64, 64)
    with pytest.raises(CloverError, match="precision"):
        plan_memory(cfg, "int4", 1, 64, 64)


def test_info_and_doctor_print_the_same_plan(tmp_path):
    import shutil
    import subprocess
    import sys

    from clover_export.cli.build import gpu_plans
    from clover_export.pipeline.doctor import Facts

    shutil.copy("clover_export/data/clover_35b_a3b_config.json", tmp_path / "config.json")
    out = subprocess.run([sys.executable, "-m", "clover_export.cli", "info", str(tmp_path), "--gpu-memory", "139.8",
                          "--max-batch", "4"], capture_output=True, text=True, check=True).stdout
    expected = plan_memory(FULL, "bf16", 4, 131072, 256, gpu_bytes=H200)
    assert "\n".join(expected.lines()) in out
    plans = gpu_plans(Facts(gpus=[{"name": "H200", "sm": (9, 0), "memory": H200}]))
    assert plans["bf16"] == plan_memory(FULL, "bf16", 1, 131072, 256, gpu_bytes=H200).max_batch_that_fits()
    assert plans["fp8"] > plans["bf16"] >= 4
    assert gpu_plans(Facts()) == {}
