"""The FP8 step graph (quantize/graph.py) and its `clover::CoresetMoEFP8` op (STEP_GRAPH.md 2, 4).

A random tiny model is exported in fp32, calibrated and rewritten; the
result must pass `check`, run in ONNX Runtime, carry exactly the e4m3 bytes
of `quantize_weight`, and agree with the fp32 graph. The op's function body
is checked alone against `moe_core_fp8`.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from clover_export.artifact.manifest import load_artifact
from clover_export.core import names
from clover_export.exporter.check import check_folder
from clover_export.exporter.export import export
from clover_export.exporter.session import ort_session
from clover_export.model.moe import moe_core_fp8
from clover_export.plugins.contracts import CORESET_MOE_FP8, NAMESPACE
from clover_export.plugins.onnx_ops import OPSET, function_proto, node_attributes
from clover_export.quantize import calibration
from clover_export.quantize import graph as fp8
from clover_export.quantize.scales import quantize_weight
from clover_export.verify import agreement as fp8_agreement

log = logging.getLogger(__name__)


def build_fp8(model_dir: Path, out: Path) -> tuple[Path, Path, fp8.Fp8Report]:
    """fp32 export, calibration on the built-in prompts, FP8 rewrite: (fp32 dir, fp8 dir, report)."""
    export(model_dir, out / "fp32", dtype="fp32")
    art = load_artifact(out / "fp32")
    steps = calibration.calibration_steps(model_dir, calibration.BUILTIN_PROMPTS, art.block_size)
    amax = calibration.calibrate(model_dir, steps, art.block_size)
    return out / "fp32", out / "fp8", fp8.quantize_graph(out / "fp32", out / "fp8", amax)


@pytest.fixture(scope="module")
def random_fp8(tmp_path_factory):
    from clover_export.tiny import generate_random_tiny

    root = tmp_path_factory.mktemp("fp8")
    model = generate_random_tiny(root / "model", seed=7, dtype=torch.float32)
    return (model, *build_fp8(model, root))


# --- the graph ------------------------------------------------------------------------
def test_fp8_graph_passes_check(random_fp8):
    model, _, fp8_dir, report = random_fp8
    rep = check_folder(fp8_dir)
    assert not rep.failures, rep.format(only_failures=True)
    cfg = load_artifact(fp8_dir).config
    assert report.expert_tensors == 2 * cfg.num_hidden_layers and report.gemms > 0
    proto = onnx.load(str(fp8_dir / "model.onnx"), load_external_data=False)
    custom = {n.op_type for n in proto.graph.node if n.domain == NAMESPACE}
    assert custom == {"BlockGDN", "BlockAttention", "CoresetMoEFP8"}  # every CoresetMoE rewritten
    assert {f.name for f in proto.functions} == custom  # CoresetMoE's function is no longer attached
    manifest = json.loads((fp8_dir / "manifest.json").read_text())
    assert set(manifest["ops"]) == {f"{NAMESPACE}::{n}" for n in custom}
    for node in proto.graph.node:
        if node.op_type == "CoresetMoEFP8":
            assert [i.rsplit(".", 1)[-1] for i in node.input[2:]] == ["fp8", "scale", "fp8", "scale"]


def test_onnxruntime_runs_the_fp8_graph(random_fp8):
    model, _, fp8_dir, _ = random_fp8
    art = load_artifact(fp8_dir)
    batch = calibration.prompt_batch(model, fp8_agreement.HELDOUT_PROMPTS[:2], art.block_size)
    feeds = batch.prefill_step()
    from clover_export.model.model import allocate_pools

    L = feeds[names.INPUT_IDS].shape[1] + art.block_size
    pools = {k: v.numpy() for k, v in allocate_pools(art.config, 2, L).items()}
    res = dict(zip(art.output_names, ort_session(art, ["CPUExecutionProvider"]).run(art.output_names,
                                                                                     {**feeds, **pools})))
    logits, sizes = res[names.LOGITS], res[names.CORESET_SIZE]
    assert logits.shape == (2, art.block_size, art.config.vocab_size) and np.isfinite(logits).all()
    causal = res[names.CAUSAL_LOGITS]  # the FP8 rewrite keeps the step's I/O: the prompts' last rows' logits
    assert causal.shape == (2, 1, art.config.vocab_size) and np.isfinite(causal).all()
    assert art.input_names == list(names.STEP_INPUTS) + art.pool_names and art.output_names[-1] == names.CAUSAL_LOGITS
    assert sizes.shape == (2, art.config.num_hidden_layers) and (sizes >= 1).all()
    assert (sizes <= art.config.num_experts).all()


def test_e4m3_bytes_are_quantize_weight_of_the_source(random_fp8):
    from clover_export.model.loading import load_model

    model, _, fp8_dir, _ = random_fp8
    source = load_model(model, torch.float32).state_dict()
    wmap = json.loads((fp8_dir / "weights.json").read_text())["tensors"]
    scales = {}  # fp32 scales live in the shared fp8.bin beside the e4m3 bytes (weights.json says where)
    for k, e in wmap.items():
        if k.endswith(".scale"):
            raw = np.fromfile(fp8_dir / e["file"], np.float32, count=e["length"] // 4, offset=e["offset"])
            scales[k] = raw.reshape(e["shape"])
    fp8_entries = {k: e for k, e in wmap.items() if e["dtype"] == "F8_E4M3"}
    assert any(".experts." in k for k in fp8_entries) and any(".self_attn." in k for k in fp8_entries)
    for name, e in fp8_entries.items():
        src = name.removesuffix(".fp8")
        q, s = quantize_weight(source[src])
        with open(fp8_dir / e["file"], "rb") as f:
            f.seek(e["offset"])
            raw = f.read(e["length"])
        assert e["shape"] == list(q.shape), name
        assert raw == q.view(torch.uint8).numpy().tobytes(), name
        np.testing.assert_array_equal(scales[f"{src}.scale"], s.numpy(), err_msg=src)
        assert src not in wmap, f"{src}: the fp32 weight should have left the FP8 graph"


def test_without_the_fp8_function_onnxruntime_and_check_fail(random_fp8):
    _, _, fp8_dir, _ = random_fp8
    proto = onnx.load(str(fp8_dir / "model.onnx"), load_external_data=False)
    kept = [f for f in proto.functions if f.name != "CoresetMoEFP8"]
    del proto.functions[:]
    proto.functions.extend(kept)
    rep = check_folder(fp8_dir, proto=proto)
    assert any("CoresetMoEFP8" in f.where and "no model-local function" in f.message for f in rep.failures)
    path = fp8_dir / "nofunc.onnx"  # in the folder: the external data paths are relative to it
    onnx.save_model(proto, str(path))
    try:
        with pytest.raises(Exception, match="CoresetMoEFP8"):
            ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    finally:
        path.unlink()


# --- agreement with the fp32 graph --------------------------------------------------------
# Thresholds on the trained embedded default, held-out prompts (384 denoise positions), set from the
# correct graph's figures measured here (ONNX Runtime CPU; the default of TINY_VERSION 6, trained for block and
# next-token decoding on lists of 1-8 digits and on the tool task): top-1 98.70%, logit error max 5.06, mean
# 0.088. Margins: agreement 97% (11 misses; the correct graph has 5), max 7.0 (1.4x), mean 0.123 (1.4x).
# Measured with every activation scale multiplied by f (`python bench/fp8_scale_sensitivity.py BUILD 0.1 ...`):
#   f = 0.1: 79.17%, max 24.95, mean 2.537   f = 0.3:  91.15%, max 12.62, mean 1.156
#   f = 3:   98.44%, max 3.21,  mean 0.120   f = 10:   98.44%, max 3.16,  mean 0.121
#   f = 100: 99.22%, max 4.66,  mean 0.112   f = 1000: 95.05%, max 15.09, mean 0.358
# (version 5's: 99.22%, max 2.00, mean 0.059; f = 0.3 97.92%, max 9.01, mean 0.671; f = 1000 97.92%, max 8.22.)
# e4m3 is floating point: a scale 3x or 10x too LARGE only moves the values 1.6 or 3.3 binades down its
# 17-binade range and costs little accuracy (no threshold on the outputs can reliably see it; the act-scale
# test below does); a scale 3x too SMALL saturates at 448 and fails all three thresholds.
TRAINED_MIN_AGREEMENT = 0.97
TRAINED_MAX_LOGIT_ERROR = 7.0
TRAINED_MEAN_LOGIT_ERROR = 0.123


def trained_thresholds_fail(a: fp8_agreement.Agreement) -> list[str]:
    return [what for what, bad in (("agreement", a.top1_agreement < TRAINED_MIN_AGREEMENT),
                                   ("max logit error", a.max_abs_logit_error > TRAINED_MAX_LOGIT_ERROR),
                                   ("mean logit error", a.mean_abs_logit_error > TRAINED_MEAN_LOGIT_ERROR)) if bad]


@pytest.fixture(scope="module")
def trained_fp8(tiny_dir, tmp_path_factory):
    """The trained embedded default: (fp32 dir, fp8 dir, amax)."""
    out = tmp_path_factory.mktemp("trained-fp8")
    export(tiny_dir, out / "fp32", dtype="fp32")
    block = load_artifact(out / "fp32").block_size
    steps = calibration.calibration_steps(tiny_dir, calibration.BUILTIN_PROMPTS, block)
    amax = calibration.calibrate(tiny_dir, steps, block)
    fp8.quantize_graph(out / "fp32", out / "fp8", amax)
    return out / "fp32", out / "fp8", amax


def test_agreement_with_the_fp32_graph(random_fp8, trained_fp8, tiny_dir):
    """Top-1 agreement and logit error over the held-out prompts' denoise positions.

    The gate is the trained embedded default (peaked logits, like a real model). A random
    model's logits are nearly flat (std ~0.2, median top-1/top-2 margin ~0.02 against an
    e4m3 logit error of ~0.015), so its agreement measures the seed more than FP8
    (0.74-0.97 over seeds 1, 2, 3, 7): logged, with its error bounded instead.
    """
    model, fp32_dir, fp8_dir, _ = random_fp8
    rnd = fp8_agreement.agreement(fp32_dir, fp8_dir, model, fp8_agreement.HELDOUT_PROMPTS)
    t32, t8, _ = trained_fp8
    trained = fp8_agreement.agreement(t32, t8, tiny_dir, fp8_agreement.HELDOUT_PROMPTS)
    for what, a in (("random tiny (seed 7)", rnd), ("trained tiny", trained)):
        log.warning("%s: %s", what, a.line())
        print(f"{what}: {a.line()}")
    assert trained.positions == 384 and not trained_thresholds_fail(trained), trained.line()
    assert rnd.positions > 0 and rnd.mean_abs_logit_error < 0.05 and rnd.top1_agreement > 0.5, rnd.line()


@pytest.mark.slow
@pytest.mark.parametrize("factor", [0.1, 0.3, 1000.0])
def test_wrong_activation_scales_fail_the_trained_thresholds(trained_fp8, tiny_dir, tmp_path, factor):
    """The thresholds above are not loose: activation scales 3x or 10x too small (saturation), or 1000x too
    large (subnormals), fail them. (3x or 10x too large is harmless in e4m3: see the comment above.)"""
    t32, _, amax = trained_fp8
    fp8.quantize_graph(t32, tmp_path / "bad", {k: v * factor for k, v in amax.items()})
    a = fp8_agreement.agreement(t32, tmp_path / "bad", tiny_dir, fp8_agreement.HELDOUT_PROMPTS)
    print(factor, a.line())
    assert trained_thresholds_fail(a), a.line()


# --- the op's function body ------------------------------------------------------------------
def fp8_case(Tc: int, coreset: bool, top_p: float, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    B, D, E, I, N = 2, 16, 8, 12, 5
    (gq, gs), (dq, ds) = (quantize_weight(torch.randn(*s, generator=g) * 0.3) for s in ((E, 2 * I, D), (E, D, I)))
    t = dict(x=torch.randn(B, Tc + N, D, generator=g), router_w=torch.randn(E, D, generator=g),
             gate_up_fp8=gq, gate_up_scale=gs, down_fp8=dq, down_scale=ds)
    return t, dict(top_k=2, top_p=top_p, coreset=coreset, block_size=N)


def one_node_model(tensors: dict, attrs: dict) -> onnx.ModelProto:
    """x is fed; the weights and scales are initializers (ONNX Runtime takes no float8 numpy feeds)."""
    c = CORESET_MOE_FP8
    node = helper.make_node(c.name, [t.name for t in c.inputs], [t.name for t in c.outputs], domain=c.namespace,
                            **node_attributes(c, attrs))
    inits = []
    for name, v in list(tensors.items())[1:]:
        if v.dtype == torch.float8_e4m3fn:
            inits.append(helper.make_tensor(name, TensorProto.FLOAT8E4M3FN, list(v.shape),
                                            v.view(torch.uint8).numpy().tobytes(), raw=True))
        else:
            inits.append(numpy_helper.from_array(v.numpy(), name))
    graph = helper.make_graph([node], "fp8", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None] * 3)],
                              [helper.make_tensor_value_info("routed", TensorProto.FLOAT, [None] * 3),
                               helper.make_tensor_value_info("coreset_size", TensorProto.INT32, [None])],
                              initializer=inits)
    return helper.make_model(graph, ir_version=9, functions=[function_proto(c)],
                             opset_imports=[helper.make_opsetid("", OPSET), helper.make_opsetid(c.namespace, 1)])


FP8_CASES = [fp8_case(3, True, 0.9), fp8_case(3, True, 0.5, seed=1), fp8_case(3, False, 0.9, seed=2),
             fp8_case(0, True, 1.0, seed=3)]


@pytest.mark.parametrize("case", range(len(FP8_CASES)))
def test_function_body_equals_moe_core_fp8(case):
    from onnx.reference import ReferenceEvaluator

    tensors, attrs = FP8_CASES[case]
    model = one_node_model(tensors, attrs)
    onnx.checker.check_model(model, full_check=True)
    want = [o.numpy() for o in moe_core_fp8(*tensors.values(), *attrs.values())]
    x = {"x": tensors["x"].numpy()}
    runs = {"onnxruntime": ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
            .run(None, x)}
    if case == 0:
        runs["onnx.reference"] = ReferenceEvaluator(model).run(None, x)
    for who, got in runs.items():
        np.testing.assert_allclose(got[0], want[0], atol=1e-5, rtol=0, err_msg=f"{who} routed")
        assert got[1].dtype == np.int32 and got[1].tolist() == want[1].tolist(), who


# --- the op's Triton path (CUDA implementation), interpreted on the CPU ------------------------
_CHILD = """
import torch
from clover_export.plugins import cuda_ops
from clover_export.model.moe import moe_core_fp8
from clover_export.quantize.scales import quantize_weight
from clover_export.verify import agreement as fp8_agreement
cuda_ops.register("cpu")
g = torch.Generator().manual_seed(4)
B, T, D, E, I, N = 2, 7, 32, 8, 16, 4
(gq, gs), (dq, ds) = (quantize_weight(torch.randn(*s, generator=g) / 5) for s in ((E, 2 * I, D), (E, D, I)))
args = (torch.randn(B, T, D, generator=g), torch.randn(E, D, generator=g) * 0.5, gq, gs, dq, ds, 2, 0.9, True, N)
got, want = torch.ops.clover.CoresetMoEFP8(*args), moe_core_fp8(*args)
print("ERR", float((got[0] - want[0]).abs().max()), got[1].tolist() == want[1].tolist())
"""


@pytest.mark.slow
def test_triton_kernel_of_the_fp8_op_equals_its_reference():
    env = dict(os.environ, TRITON_INTERPRET="1", TRITON_DEFAULT_FP_FUSION="1")
    proc = subprocess.run([sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True, timeout=300)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("ERR ")), None)
    assert line, proc.stderr[-3000:]
    err, same_sizes = line.split()[1:]
    assert float(err) < 1e-4 and same_sizes == "True", line


# --- the activation scales against calibration ---------------------------------------------
def test_activation_scales_are_amax_over_448_of_the_fp32_graphs_own_activations(random_fp8):
    """Every activation Q/DQ scale equals amax / 448 (STEP_GRAPH.md 4), amax measured independently of
    `fp8.calibrate` (torch hooks on the reference model): here the fp32 graph itself in ONNX Runtime,
    its GEMM inputs exposed as outputs, on the same calibration steps with the pools carried."""
    from clover_export.model.model import allocate_pools

    model, fp32_dir, fp8_dir, report = random_fp8
    proto8 = onnx.load(str(fp8_dir / "model.onnx"), load_external_data=False)
    inits = {t.name: t for t in proto8.graph.initializer}
    quant = [n for n in proto8.graph.node if n.op_type == "QuantizeLinear" and n.input[1].endswith(".act_scale")]
    acts = sorted({n.input[0] for n in quant})
    assert len(acts) >= 3 * load_artifact(fp8_dir).config.num_hidden_layers, acts  # every layer's GEMM inputs
    art = load_artifact(fp32_dir)
    proto = onnx.load(str(art.graph_path), load_external_data=False)
    proto.graph.output.extend(helper.make_tensor_value_info(x, TensorProto.FLOAT, None) for x in acts)
    path = fp32_dir / "with_activations.onnx"  # in the folder: external data paths are relative to it
    onnx.save_model(proto, str(path))
    try:
        sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        steps = calibration.calibration_steps(model, calibration.BUILTIN_PROMPTS, art.block_size)
        pool_len = calibration.step_pool_len(steps, art.block_size)
        pools = {k: v.numpy() for k, v in allocate_pools(art.config, len(calibration.BUILTIN_PROMPTS),
                                                          pool_len).items()}
        amax = dict.fromkeys(acts, 0.0)
        names_out = [o.name for o in proto.graph.output]
        for feeds in steps:
            res = dict(zip(names_out, sess.run(names_out, {**feeds, **pools})))
            pools = {p: res[names.present_name(p)] for p in art.pool_names}
            for x in acts:
                amax[x] = max(amax[x], float(np.abs(res[x].astype(np.float64)).max()))
    finally:
        path.unlink()
    for x in acts:
        got = float(numpy_helper.to_array(inits[f"{x}.act_scale"]))
        assert got == pytest.approx(amax[x] / 448.0, rel=1e-4), (x, got, amax[x] / 448.0)
        assert report.activations[x] == pytest.approx(got, rel=1e-6)


def test_lm_head_quantized_on_request(random_fp8, tmp_path):
    """include_lm_head: the lm_head becomes e4m3 + scales with its input's calibrated scale; `check` passes.
    (It was silently left out before: the lm_head's name does not end in "proj.weight".)"""
    model, fp32_dir, _, _ = random_fp8
    block = load_artifact(fp32_dir).block_size
    amax = calibration.calibrate(model, calibration.prompt_batch(model, calibration.BUILTIN_PROMPTS[:4], block), block,
                         include_lm_head=True)
    assert "lm_head.weight" in amax
    report = fp8.quantize_graph(fp32_dir, tmp_path / "fp8-head", amax, include_lm_head=True)
    proto = onnx.load(str(tmp_path / "fp8-head" / "model.onnx"), load_external_data=False)
    inits = {i.name: i for i in proto.graph.initializer}
    assert inits["lm_head.weight.fp8"].data_type == TensorProto.FLOAT8E4M3FN and "lm_head.weight.scale" in inits
    assert report.include_lm_head and not check_folder(tmp_path / "fp8-head").failures
