"""Engine build settings, decided without TensorRT; the TensorRT path itself is marked."""

import pytest

from clover_export.core.errors import CloverError
from clover_export.engines.builder import tensorrt_version
from clover_export.engines.profiles import BuildSettings
from clover_export.exporter.export import profile_shapes, profiles


def test_manifest_profiles_cover_every_kind_of_step_full_size():
    decode, prefill = profiles(block_size=32, chunk=512, max_batch=8, slots=8, max_len=131072)
    io = [{"name": "input_ids", "shape": ["batch", "step_len"]},
          {"name": "past_key_values.3.key", "shape": ["slots", 2, "pool_len", 256]}]
    d = profile_shapes(io, decode)
    # block-only steps (T = N) and commits folded into the next block (T = 2N)
    assert d["input_ids"] == {"min": [1, 32], "opt": [8, 64], "max": [8, 64]}
    assert d["past_key_values.3.key"]["min"] == d["past_key_values.3.key"]["max"] == [8, 2, 131072, 256]
    assert profile_shapes(io, prefill)["input_ids"]["max"] == [8, 544]


def test_profiles_set_the_logit_rows_of_the_step_graph():
    """`logit_rows` [batch, R]: R from 1 (opt 1: one committed row) to block_size (a row and its drafts) in every
    profile; the io_specs of the traced graph name that dim on the input and on `causal_logits`."""
    import torch

    from clover_export.core import names
    from clover_export.exporter.trace import LOGIT_ROWS, io_specs
    from clover_export.tiny import tiny_config

    cfg = tiny_config()
    ins, outs = io_specs(cfg, 32, torch.float32)
    assert [s["name"] for s in ins[:len(names.STEP_INPUTS)]] == list(names.STEP_INPUTS)
    assert ins[len(names.STEP_SCALARS)]["shape"] == ["batch", LOGIT_ROWS]
    assert outs[-1] == {"name": names.CAUSAL_LOGITS, "shape": ["batch", LOGIT_ROWS, cfg.vocab_size],
                        "dtype": "float32"}
    for p in profiles(block_size=32, chunk=512, max_batch=8, slots=8, max_len=131072):
        assert p["dims"][LOGIT_ROWS] == [1, 1, 32]
        assert profile_shapes(ins, p)[names.LOGIT_ROWS] == {"min": [1, 1], "opt": [p["dims"]["batch"][1], 1],
                                                            "max": [8, 32]}


def test_flags_are_strongly_typed_only():
    s = BuildSettings("fp8", 1 << 30, strip_weights=True, timing_cache=None)
    for major in (10, 11):
        assert not {"FP16", "BF16", "FP8", "INT8"} & set(s.flags(major))
    assert s.flags(10) == ["STRIP_PLAN", "REFIT_IDENTICAL"]
    assert BuildSettings.network_flags(10) == ["STRONGLY_TYPED"] and BuildSettings.network_flags(11) == []
    assert "ALIASED_PLUGIN_IO_10_03" in BuildSettings.preview_features()


def test_without_tensorrt_the_builder_says_so():
    if tensorrt_version() is not None:
        pytest.skip("TensorRT is installed here")
    from clover_export.engines.builder import import_tensorrt, load_engine

    with pytest.raises(CloverError, match="TensorRT is not installed"):
        import_tensorrt()
    with pytest.raises(CloverError, match="TensorRT is not installed"):
        load_engine("engine.plan")
