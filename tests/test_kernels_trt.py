"""TensorRT plugin decisions without TensorRT (STEP_GRAPH.md 2, 4).

`plugins/trt` must import cleanly where TensorRT is absent; its plain
decisions (output descriptors, aliases, autotune dtype combinations, AOT
launch plans) are checked here. `register.py` (the only file that imports
`tensorrt.plugin`) is exercised only where TensorRT is installed: no
stand-in for TensorRT is used (a mock would prove nothing about TensorRT).
"""

from __future__ import annotations

import importlib

import pytest

from clover_export.plugins.contracts import BLOCK_ATTENTION, BLOCK_GDN, CONTRACTS, CORESET_MOE, CORESET_MOE_FP8
from clover_export.plugins.trt import plan

GDN_SHAPES = {"mixed_qkv": (2, 64, 8192), "a": (2, 64, 32), "b": (2, 64, 32), "conv_w": (8192, 4),
              "conv_w_right": (8192, 4), "A_log": (32,), "dt_bias": (32,), "block_scale": (32,), "block_gate": (32,),
              "conv_pool": (5, 8192, 3), "rec_pool": (5, 32, 128, 128), "slot_ids": (2,), "n_causal": (2,)}
GDN_ATTRS = {"num_k_heads": 16, "head_k_dim": 128, "head_v_dim": 128, "block_size": 32}
ATT_SHAPES = {"q": (2, 64, 16, 256), "k": (2, 64, 2, 256), "v": (2, 64, 2, 256), "key_pool": (5, 2, 4096, 256),
              "value_pool": (5, 2, 4096, 256), "slot_ids": (2,), "past_len": (2,), "n_causal": (2,)}
ATT_ATTRS = {"block_size": 32, "scale": 0.0625}


def test_package_imports_without_tensorrt():
    import clover_export.plugins.trt as trt_plugins

    if importlib.util.find_spec("tensorrt") is None:
        assert trt_plugins.AVAILABLE is False and trt_plugins.REGISTERED == ()


def test_output_decls_alias_the_pools():
    decls = plan.output_decls(BLOCK_GDN, GDN_SHAPES, GDN_ATTRS)
    assert [(d.name, d.alias_of) for d in decls] == [("o", None), ("conv_pool_out", "conv_pool"),
                                                     ("rec_pool_out", "rec_pool")]
    assert decls[0].shape == (2, 64, 32, 128) and decls[0].dtype_of == "mixed_qkv"
    moe = plan.output_decls(CORESET_MOE, {"x": (1, 64, 2048), "router_w": (256, 2048), "gate_up": (256, 1024, 2048),
                                          "down": (256, 2048, 512)}, {"top_k": 8, "top_p": 0.9, "coreset": 1,
                                                                      "block_size": 32})
    assert [(d.shape, d.dtype_of, d.dtype) for d in moe] == [((1, 64, 2048), "x", None), ((1,), None, "int32")]
    fp8 = plan.output_decls(CORESET_MOE_FP8, {"x": (1, 64, 2048), "router_w": (256, 2048),
                                              "gate_up_fp8": (256, 1024, 2048), "gate_up_scale": (256, 1024),
                                              "down_fp8": (256, 2048, 512), "down_scale": (256, 2048)},
                            {"top_k": 8, "top_p": 0.9, "coreset": 1, "block_size": 32})
    assert fp8 == moe
    with pytest.raises(ValueError, match="dim I2"):  # scales must match the weights' output channels
        plan.output_decls(CORESET_MOE_FP8, {"x": (1, 64, 2048), "router_w": (256, 2048),
                                            "gate_up_fp8": (256, 1024, 2048), "gate_up_scale": (256, 512),
                                            "down_fp8": (256, 2048, 512), "down_scale": (256, 2048)},
                          {"top_k": 8, "top_p": 0.9, "coreset": 1, "block_size": 32})


def test_autotune_combinations():
    for c in CONTRACTS.values():
        for s in plan.autotune_strings(c):
            assert len(s.split(", ")) == len(c.inputs) + len(c.outputs)
    gdn = plan.autotune_strings(BLOCK_GDN)
    names = [t.name for t in BLOCK_GDN.inputs] + [t.name for t in BLOCK_GDN.outputs]
    fp32_params = dict(zip(names, gdn[1].split(", ")))
    assert fp32_params["A_log"] == "FP32" and fp32_params["mixed_qkv"] == "BF16" and fp32_params["conv_pool"] == "BF16"
    assert fp32_params["rec_pool"] == fp32_params["rec_pool_out"] == "FP32" and fp32_params["slot_ids"] == "INT32"
    # FP8 expert weights come with per-channel scale inputs: FP8 appears exactly where those exist
    for c in CONTRACTS.values():
        has_scales = {"gate_up_scale", "down_scale"} <= {t.name for t in c.inputs}
        assert all(("FP8" in s) == has_scales for s in plan.autotune_strings(c)), c.name
    names = [t.name for t in CORESET_MOE_FP8.inputs] + [t.name for t in CORESET_MOE_FP8.outputs]
    fp8 = [dict(zip(names, s.split(", "))) for s in plan.autotune_strings(CORESET_MOE_FP8)]
    assert fp8[0] == {"x": "BF16", "router_w": "BF16", "gate_up_fp8": "FP8", "gate_up_scale": "FP32",
                      "down_fp8": "FP8", "down_scale": "FP32", "routed": "BF16", "coreset_size": "INT32"}
    assert [c["x"] for c in fp8] == ["BF16", "FP32"] and all(c["down_fp8"] == "FP8" for c in fp8)


def test_aot_plans():
    d = plan.io_dtypes(BLOCK_GDN, "bfloat16")
    p = plan.aot_plan("BlockGDN", GDN_SHAPES, GDN_ATTRS, d, 90)
    assert p.grid == (2, 16, 1) and p.scalars == (("mixed_qkv", 1),)
    assert p.variant.key == "BlockGDN.bf16.pbf16" and list(p.variant.signature)[:2] == ["mixed_qkv", "a"]
    p = plan.aot_plan("BlockAttention", ATT_SHAPES, ATT_ATTRS, plan.io_dtypes(BLOCK_ATTENTION, "bfloat16"), 90)
    assert p.grid == (64 * 8 // p.variant.constexprs["BLOCK_M"], 4, 1)
    assert p.scalars == (("q", 1), ("key_pool", 2)) and p.variant.constexprs["SCALE"] == 0.0625
    for op in plan.JIT_OPS:
        with pytest.raises(ValueError, match="JIT"):
            plan.aot_plan(op, {}, {}, {}, 90)
    assert set(plan.AOT_OPS) | set(plan.JIT_OPS) == set(CONTRACTS) and not set(plan.AOT_OPS) & set(plan.JIT_OPS)


def test_jit_ops_have_a_triton_path_taking_the_contract_arguments():
    import inspect

    from clover_export.plugins import cuda_ops

    for op in plan.JIT_OPS:
        c = CONTRACTS[op]
        params = list(inspect.signature(cuda_ops.kernel(op)).parameters)
        assert params == [t.name for t in c.inputs] + [a.name for a in c.attributes], op


# ---------------------------------------------------------------- register.py with the real TensorRT
@pytest.mark.tensorrt
def test_register_with_real_tensorrt():
    """Only where TensorRT is installed: the plugins register under the contracts' names.

    No stand-in for TensorRT is used anywhere: without it this test is skipped, and
    register.py is only imported, never exercised.
    """
    if importlib.util.find_spec("tensorrt") is None:
        pytest.skip("TensorRT is not installed on this machine")
    from clover_export.plugins.trt import register

    assert set(register.register_all()) == {c.qualname for c in CONTRACTS.values()}
