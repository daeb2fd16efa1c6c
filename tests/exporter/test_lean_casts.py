"""What ONNX Runtime runs of an fp32 graph of a bf16 checkpoint (exporter.lean_casts).

The reference is the graph as exported, run by ONNX Runtime straight from its file: the lean copy that
`ort_session` runs must give the same outputs, and must no longer cast the embedding table or the
expert tensors whole, nor transpose a cast weight.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from clover_export.backends.ort_backend import OrtBackend
from clover_export.exporter import load_artifact
from clover_export.exporter.export import export
from clover_export.exporter.lean_casts import lean_graph, weight_casts
from clover_export.exporter.session import ort_session
from clover_export.verify.runners import OrtRunner
from clover_export.verify.scenario import NUM_SLOTS, initial_pools, make_feeds, play, pool_len, scenario

LAYERS = ["linear_attention", "full_attention"]


@pytest.fixture(scope="module")
def bf16_per_expert(tmp_path_factory):
    """A random 2-layer tiny, bf16, experts stored per expert (the real checkpoint's layout)."""
    from clover_export.core.checkpoint import load_state_dict, save_checkpoint
    from clover_export.core.config import load_config
    from clover_export.tiny import generate_random_tiny

    root = tmp_path_factory.mktemp("lean")
    fused = generate_random_tiny(root / "fused", seed=5, dtype=torch.bfloat16, num_hidden_layers=2, layer_types=LAYERS)
    src = save_checkpoint(
        load_state_dict(fused, load_config(fused)),
        root / "model",
        per_expert=True,
        prefix="model.language_model.",
        extra_files={"config.json": (fused / "config.json").read_text()},
    )
    return src, root


@pytest.fixture(scope="module")
def fp32_export(bf16_per_expert):
    src, root = bf16_per_expert
    export(src, root / "fp32", dtype="fp32", weights="link", block_size=8, chunk=16, max_batch=2, max_len=64)
    return load_artifact(root / "fp32")


def test_lean_copy_computes_what_the_exported_graph_computes(fp32_export):
    art = fp32_export
    plans = scenario(art.block_size, art.chunk)
    feeds = make_feeds(plans, art.config, art.block_size, seed=0)
    pools = initial_pools(art, NUM_SLOTS, pool_len(plans, art.block_size), seed=1)

    def runner(session):
        return OrtRunner(OrtBackend(art, session), "ort")

    as_exported = ort.InferenceSession(str(art.graph_path), providers=["CPUExecutionProvider"])
    want = play(runner(as_exported), feeds, pools)
    got = play(runner(ort_session(art, ["CPUExecutionProvider"])), feeds, pools)
    for step_got, step_want in zip(got, want):
        for name in step_want:
            scale = max(1.0, float(np.abs(step_want[name]).max()))
            np.testing.assert_allclose(step_got[name], step_want[name], atol=2e-5 * scale, rtol=0, err_msg=name)


def test_lean_copy_casts_no_whole_embedding_or_expert_tensor(fp32_export):
    proto = onnx.load(str(fp32_export.graph_path), load_external_data=False)
    before = weight_casts(proto.graph)
    assert any("embed_tokens" in c for c in before) and any(".experts." in c for c in before)
    n_linear = sum(1 for n in proto.graph.node if n.op_type == "Transpose" and n.input[0] in before)
    assert n_linear > 0
    assert lean_graph(proto)
    left = weight_casts(proto.graph)
    assert not [c for c in left if "embed_tokens" in c or ".experts." in c], sorted(left)
    assert not [n for n in proto.graph.node if n.op_type == "Transpose" and n.input[0] in before]
    assert sum(1 for n in proto.graph.node if n.op_type == "Gemm") == n_linear
    moe = [n for n in proto.graph.node if n.op_type == "CoresetMoE"]
    assert moe and all(i.endswith("__bf16") for n in moe for i in n.input[2:4])


def test_graphs_without_fp32_weight_casts_are_left_alone(bf16_per_expert):
    src, root = bf16_per_expert
    export(src, root / "bf16", dtype="bf16", weights="link", block_size=8, chunk=16, max_batch=2, max_len=64)
    proto = onnx.load(str(root / "bf16" / "model.onnx"), load_external_data=False)
    nodes = [n.SerializeToString() for n in proto.graph.node]
    assert not lean_graph(proto)
    assert [n.SerializeToString() for n in proto.graph.node] == nodes


def test_slices_of_a_per_expert_checkpoint_feed_the_fused_experts_and_pass(bf16_per_expert, tmp_path):
    """Slice validation on the real checkpoint's layout: the lm_head (fp32) and each layer's fused
    bf16 experts are prepared once and fed to ONNX Runtime; the reference reuses them; both agree."""
    from clover_export.core.checkpoint import locate_tensors, plan_tensors
    from clover_export.core.config import load_config
    from clover_export.verify import slice as S

    src, _ = bf16_per_expert
    cfg = load_config(src)
    fed = S._fed_weights(S.slice_plans(plan_tensors(cfg, locate_tensors(src)), [0]))
    assert set(fed) == {"lm_head.weight", "model.layers.0.mlp.experts.gate_up_proj__bf16",
                        "model.layers.0.mlp.experts.down_proj__bf16"}
    assert fed["lm_head.weight"].value.dtype == torch.float32
    result = S.validate_slices(src, tmp_path / "work", block_size=8, chunk=16, max_batch=2)
    assert result.kinds == LAYERS and result.passed, result.report
