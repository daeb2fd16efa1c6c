"""Config normalisation and validation (MODEL.md 2)."""

import json

import pytest

from clover_export.core.config import config_from_dict, load_config
from clover_export.core.errors import CloverError
from clover_export.core.generation import GenerationSettings, load_generation_settings
from clover_export.model.loading import build_model
from clover_export.model.sizing import param_counts
from clover_export.tiny import tiny_config_dict

FULL = json.loads(open("clover_export/data/clover_35b_a3b_config.json").read())


def flat_text(**extra):
    d = dict(FULL["text_config"], **extra)
    return d


def test_three_layouts_normalise_to_the_same_config():
    nested = config_from_dict(FULL)
    wrapper = config_from_dict({"model_type": "qwen3_5_moe", "text_config": flat_text(), "tie_word_embeddings": False})
    flat = config_from_dict(flat_text())
    clover_flat = config_from_dict(dict(flat_text(), model_type="clover_moe", mask_token_id=248077))
    assert nested.model_type == clover_flat.model_type == "clover_moe"
    assert wrapper.model_type == "qwen3_5_moe" and flat.model_type == "qwen3_5_moe_text"
    for other in (wrapper, flat, clover_flat):
        for f in ("hidden_size", "layer_types", "rope_theta", "partial_rotary_factor", "head_dim", "eos_token_id"):
            assert getattr(other, f) == getattr(nested, f), f
    assert nested.layer_types[3] == "full_attention" and nested.layer_types[2] == "linear_attention"
    assert nested.attention_layers == [3, 7, 11, 15, 19, 23, 27, 31, 35, 39]
    assert nested.rotary_dim == 64 and nested.conv_dim == 8192
    assert nested.eos_token_id == (248044,)


def test_clover_defaults_and_rope_at_top_level():
    d = flat_text(model_type="clover_moe")
    del d["rope_parameters"]
    d.update(rope_theta=5e6, partial_rotary_factor=0.5)
    cfg = config_from_dict(d)
    assert (cfg.rope_theta, cfg.partial_rotary_factor) == (5e6, 0.5)
    assert (cfg.block_size, cfg.moe_block_coreset_enabled, cfg.moe_block_coreset_top_p, cfg.max_context) == (
        32,
        True,
        0.9,
        131072,
    )
    assert cfg.logits_shift is False and cfg.block_alignment == "prompt_end"
    assert cfg.mask_token_id is None
    with pytest.raises(CloverError, match="mask_token_id"):
        cfg.require_mask_token()


@pytest.mark.parametrize(
    "change, field",
    [
        ({"num_key_value_heads": 3}, "num_attention_heads"),
        ({"linear_num_key_heads": 5}, "linear_num_value_heads"),
        ({"layer_types": ["full_attention"] * 3}, "layer_types"),
        ({"layer_types": ["linear_attention"] * 39 + ["sliding"]}, "layer_types"),
        ({"hidden_size": 0}, "hidden_size"),
        ({"num_experts": -1}, "num_experts"),
        ({"head_dim": "256"}, "head_dim"),
        ({"num_experts_per_tok": 300}, "num_experts_per_tok"),
        ({"moe_block_coreset_top_p": 0.0}, "moe_block_coreset_top_p"),
        ({"block_alignment": "left"}, "block_alignment"),
        ({"mask_token_id": 10**9}, "mask_token_id"),
        ({"tie_word_embeddings": True}, "tie_word_embeddings"),
    ],
)
def test_bad_field_gives_one_clear_error(change, field):
    with pytest.raises(CloverError) as e:
        config_from_dict(flat_text(model_type="clover_moe", **change), source="x/config.json")
    assert f"'{field}'" in str(e.value) and "x/config.json" in str(e.value)


def test_unknown_model_type_and_bad_json(tmp_path):
    with pytest.raises(CloverError, match="model_type"):
        config_from_dict({"model_type": "llama"})
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(CloverError, match="not valid JSON"):
        load_config(tmp_path)
    with pytest.raises(CloverError, match="not found"):
        load_config(tmp_path / "nope")


def test_full_size_on_meta_matches_parameter_count():
    cfg = config_from_dict(FULL)
    model = build_model(cfg, device="meta")
    n = sum(p.numel() for p in model.parameters())
    counts = param_counts(cfg)
    assert n == counts.total
    assert abs(counts.total / 1e9 - 34.66) < 0.01 and abs(counts.active_per_token / 1e9 - 3.45) < 0.02


def test_generation_settings_defaults_override_and_validation(tmp_path):
    g = GenerationSettings()
    assert (g.threshold, g.repetition_penalty, g.presence_penalty, g.dllm_length_penalty, g.dllm_think_end_bias) == (
        0.95, 1.05, 0.9, 10.0, 10.0)
    (tmp_path / "generation_config.json").write_text(json.dumps({"threshold": 0.8, "eos_token_id": 7, "top_k": 20}))
    loaded = load_generation_settings(tmp_path)
    assert loaded.threshold == 0.8 and loaded.eos_token_id == (7,) and loaded.top_k == 20
    assert loaded.override(threshold=0.5).threshold == 0.5
    for bad in ({"threshold": 0.0}, {"threshold": 1.5}, {"max_new_tokens": 0}, {"presence_penalty": -2.5},
                {"top_p": 0.0}):
        with pytest.raises(CloverError, match=f"'{next(iter(bad))}'"):
            g.override(**bad)
    with pytest.raises(CloverError, match="unknown"):
        g.override(temprature=0.5)
    (tmp_path / "generation_config.json").write_text(json.dumps({"threshold": 2}))
    with pytest.raises(CloverError, match="generation_config.json"):
        load_generation_settings(tmp_path)


@pytest.mark.parametrize("temperature", [1e-6, 1e-39, 1e-320, 5e-324])
def test_a_temperature_below_1e_5_is_greedy(temperature):
    """vLLM's rule: float32 cannot divide logits by such a temperature (overflow, or zero), so it decodes
    greedily, however the settings are made."""
    assert GenerationSettings().override(do_sample=True, temperature=temperature).do_sample is False
    assert GenerationSettings(do_sample=True, temperature=temperature).do_sample is False
    kept = GenerationSettings().override(do_sample=True, temperature=1e-5)
    assert kept.do_sample is True and kept.temperature == 1e-5


def test_real_ranges_end_at_a_finite_maximum_float32_holds():
    """A real parameter past float32's range would be inf in the runner's parameter table (inf * 0 = NaN in
    the ramps); every real range has a finite maximum, and a value past it is refused naming the field."""
    import numpy as np

    from clover_export.core.generation import RANGES

    reals = {name: rng for name, rng in RANGES.items() if rng.kind == "real"}
    assert all(rng.high is not None and np.isfinite(np.float32(rng.high)) for rng in reals.values())
    for name, rng in reals.items():
        assert getattr(GenerationSettings().override(**{name: rng.high}), name) == rng.high
        for bad in (np.nextafter(rng.high, np.inf), 1e39, 1e308):
            with pytest.raises(CloverError, match=f"'{name}' must be a finite number in"):
                GenerationSettings().override(**{name: float(bad)})


def test_tiny_config_keeps_the_architecture_pattern():
    cfg = config_from_dict(tiny_config_dict())
    kinds = cfg.layer_types
    assert kinds[:4] == ("linear_attention",) * 3 + ("full_attention",)
    assert cfg.num_attention_heads > cfg.num_key_value_heads and cfg.partial_rotary_factor < 1
    assert cfg.mask_token_id is not None
