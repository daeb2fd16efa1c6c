"""Engine profiles and build settings, decided without TensorRT; the TensorRT path itself is marked."""

import json

import pytest

from clover_export.config import config_from_dict
from clover_export.engines.profiles import BuildSettings, profile_for, step_profiles
from clover_export.engines.tensorrt_build import tensorrt_version
from clover_export.errors import CloverError

FULL = config_from_dict(json.loads(open("clover_export/data/clover_35b_a3b_config.json").read()))

INPUTS = {"input_ids": ["batch", "step_len"], "n_causal": ["batch"],
          "past_key_values.3.key": ["slots", 2, "pool_len", 256],
          "past_key_values.0.recurrent_state": ["slots", 32, 128, 128]}


def test_profiles_cover_every_kind_of_step_full_size():
    ps = step_profiles(FULL.block_size, chunk=512, max_batch=8, max_context=131072)
    assert [p.name for p in ps] == ["decode", "prefill"]
    dec = ps[0].shape_ranges(INPUTS)
    assert dec["input_ids"] == ((1, 32), (8, 64), (8, 64))
    assert dec["past_key_values.3.key"] == ((8, 2, 131072, 256),) * 3
    pre = ps[1].shape_ranges(INPUTS)
    assert pre["input_ids"][2] == (8, 544)
    # the runtime's choice: block-only and folded-commit steps -> decode; prompt chunks -> prefill
    assert profile_for(ps, 1, 32) == 0 and profile_for(ps, 8, 64) == 0 and profile_for(ps, 3, 544) == 1
    with pytest.raises(CloverError, match="no engine profile"):
        profile_for(ps, 9, 64)


def test_unknown_dynamic_dim_is_reported():
    p = step_profiles(32, 64, 2, 1024)[0]
    with pytest.raises(CloverError, match="'X'"):
        p.shape_ranges({"weird": ["X", 3]})
    with pytest.raises(CloverError, match="max_context"):
        step_profiles(32, 512, 1, 100)


def test_flags_are_strongly_typed_only():
    s = BuildSettings("fp8", 1 << 30, strip_weights=True, timing_cache=None)
    for major in (10, 11):
        assert not {"FP16", "BF16", "FP8", "INT8"} & set(s.flags(major))
    assert s.flags(10) == ["STRIP_PLAN", "REFIT_IDENTICAL"]
    assert BuildSettings.network_flags(10) == ["STRONGLY_TYPED"] and BuildSettings.network_flags(11) == []


def test_without_tensorrt_the_builder_says_so():
    if tensorrt_version() is not None:
        pytest.skip("TensorRT is installed here")
    from clover_export.engines.tensorrt_build import import_tensorrt

    with pytest.raises(CloverError, match="TensorRT is not installed"):
        import_tensorrt()


@pytest.mark.tensorrt
def test_tensorrt_builds_the_tiny_engine(tmp_path):
    if tensorrt_version() is None:
        pytest.skip("TensorRT is not installed on this machine")
    pytest.skip("needs a GPU with TensorRT: run `clover-export build --require-engine` there")
