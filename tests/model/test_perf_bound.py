"""`perf_bound` against PERF.md 1's stated figures and reference table, and hand-computed tiny cases."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from clover_export.core.config import config_from_dict
from clover_export.model import perf_bound as pb

H200_COPY = 4.14e12  # bytes/s, the bandwidth PERF.md's table uses


@pytest.fixture(scope="module")
def full():
    path = Path(__file__).resolve().parents[2] / "clover_export/data/clover_35b_a3b_config.json"
    return config_from_dict(json.loads(path.read_text()))


def test_weight_groups_match_perf_md(full):
    w = pb.weight_bytes(full)
    assert len(full.gdn_layers) == 30 and len(full.attention_layers) == 10 and full.num_hidden_layers == 40
    assert w.gdn_layer == pytest.approx(67.7e6, rel=0.01)
    assert 30 * w.gdn_layer == pytest.approx(2.03e9, rel=0.01)
    assert w.attention_layer == pytest.approx(54.5e6, rel=0.01)
    assert w.router_shared == pytest.approx(7.3e6, rel=0.01)
    assert w.head == pytest.approx(1.02e9, rel=0.01)
    assert w.expert == pytest.approx(6.29e6, rel=0.001)
    assert pb.expert_bytes(full, fp8=True) - w.expert_params == 4 * (2 * 512 + 2048)  # e4m3 + fp32 scales
    assert w.expert_params == pytest.approx(3.15e6, rel=0.01)
    assert pb.active_params(full) == pytest.approx(3.46e9, rel=0.01)


# PERF.md 1 reference table: (batch, rows, experts/layer, fp8, bytes, bound ms at 4.14 TB/s, table counts K/V+states).
# Rows 1-2 of the table leave out K/V and GDN states (~0.2 GB; B = 8 rows include them): those are compared
# on the weights the step reads, the others on the total.
TABLE = [
    (1, 32, 30, False, 11.4e9, 2.8, False),
    (1, 1, 8, False, 5.9e9, 1.4, False),
    (8, 64, 256, False, 70e9, 16.9, True),
    (8, 64, 256, True, 37.9e9, 9.2, True),
]


@pytest.mark.parametrize("batch,rows,experts,fp8,nbytes,bound_ms,with_caches", TABLE)
def test_reference_table(full, batch, rows, experts, fp8, nbytes, bound_ms, with_caches):
    s = pb.step_bytes(full, rows=batch * rows, past_len=[4096] * batch, experts_per_layer=experts, fp8=fp8)
    counted = s.total if with_caches else s.dense + s.head + s.experts
    assert counted == pytest.approx(nbytes, rel=0.01)
    assert 1e3 * counted / H200_COPY == pytest.approx(bound_ms, abs=0.06)  # the table's ms are rounded
    assert s.kv + s.state < 0.25e9 * batch
    b = pb.bound_seconds(full, s.total, batch * rows, H200_COPY)
    assert b["bound_s"] == b["memory_s"] == s.total / H200_COPY


def test_union_of_experts_and_gathered_embedding_by_hand(full):
    """The rule's parts, hand-computed: experts = sum of per-layer unions x 6.29 MB; embedding = rows only."""
    L = full.num_hidden_layers
    per_layer = [8 + (i % 3) for i in range(L)]
    s = pb.step_bytes(full, rows=3, past_len=[10, 0], experts_per_layer=per_layer, logits=False)
    assert s.experts == sum(per_layer) * 3 * 512 * 2048 * 2
    assert s.embedding == 3 * 2048 * 2  # not the 1.02 GB table
    assert s.head == 0
    assert s.kv == (10 + 3) * 10 * 2 * 2 * 256 * 2
    assert s.state == 2 * 2 * 30 * (32 * 128 * 128 * 4 + 8192 * 3 * 2)
    with pytest.raises(ValueError, match="40 layers"):
        pb.step_bytes(full, rows=1, past_len=[0], experts_per_layer=[8] * 39)


def test_compute_bound_takes_over_at_many_rows(full):
    rows = 4096
    s = pb.step_bytes(full, rows=rows, past_len=[0] * 64, experts_per_layer=256)
    b = pb.bound_seconds(full, s.total, rows, H200_COPY, matmul_flops=7.0e14)
    assert b["compute_s"] == pytest.approx(2 * pb.active_params(full) * rows / 7.0e14)
    assert b["bound_s"] == max(b["memory_s"], b["compute_s"]) == b["compute_s"]
