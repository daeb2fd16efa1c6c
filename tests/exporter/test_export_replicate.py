"""Layer replication (exporter/replicate.py) for layer patterns other than Clover's.

The graph stamped out from a one-layer-per-kind prototype must compute what
the reference model computes, whichever kind comes first or last.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch

from clover_export.core import names
from clover_export.exporter import load_artifact
from clover_export.exporter.export import export
from clover_export.verify.runners import OrtRunner, TorchRunner
from clover_export.verify.scenario import NUM_SLOTS, initial_pools, make_feeds, play, pool_len, scenario

G, A = "linear_attention", "full_attention"


@pytest.mark.parametrize("layer_types", [(G, A, G), (A, G, G, A, G)], ids=["ends-with-gdn", "starts-with-attention"])
def test_stamped_graph_matches_the_reference(layer_types, tmp_path):
    from clover_export.tiny import generate_random_tiny

    src = generate_random_tiny(tmp_path / "model", seed=3, dtype=torch.float32,
                               num_hidden_layers=len(layer_types), layer_types=list(layer_types))
    export(src, tmp_path / "out", dtype="fp32", chunk=16, max_batch=2, slots=3)
    art = load_artifact(tmp_path / "out")
    proto = onnx.load(str(art.graph_path), load_external_data=False)
    assert [n.op_type for n in proto.graph.node if n.domain == "clover"] == [
        op for t in layer_types for op in (("BlockGDN" if t == G else "BlockAttention"), "CoresetMoE")]
    assert any(n.name.startswith(f"L{len(layer_types) - 1}/") for n in proto.graph.node)  # stamped, not traced
    plans = scenario(art.block_size, art.chunk)[:3]
    feeds = make_feeds(plans, art.config, art.block_size)
    pools = initial_pools(art, NUM_SLOTS, pool_len(plans, art.block_size))
    got = play(OrtRunner.load(art, "CPUExecutionProvider"), feeds, pools)
    ref = play(TorchRunner.load(art, torch.float32), feeds, pools)  # the reference model of `src`
    for step, (g, r) in enumerate(zip(got, ref)):
        for name in art.output_names:
            np.testing.assert_allclose(g[name], r[name], atol=1e-4, rtol=0, err_msg=f"step {step} {name}")
    assert got[0][names.CORESET_SIZE].shape == (2, len(layer_types))
