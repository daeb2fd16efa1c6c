"""bench/soak.py at test size: a real `clover-export serve` process under a minute of mixed traffic (every
decoding mode, streamed and not, cancelled streams, shared system prompts, multi-turn chats, hostile bodies)
passes the soak's own criteria: RSS flat after warm-up, slots and the queue back to zero when the traffic
stops, prefix-cache snapshots within the budget, no error but the deliberate ones, p99 latency not drifting."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from clover_export.testing.scripts import load_script

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_a_minute_of_mixed_traffic_passes_the_soak_criteria(tmp_path):
    soak = load_script(ROOT / "bench" / "soak.py")
    minutes = float(os.environ.get("CLOVER_SOAK_TEST_MINUTES", "1"))
    rep = soak.run(soak.Options(minutes=minutes, sample_s=3, clients=3, max_tokens=32, warmup_frac=0.15, grace_s=30,
                                out=str(tmp_path / "soak"), plot=False))
    assert set(rep.criteria) == {"rss", "drained", "cache_budget", "errors", "p99"}
    ran = {name for name, n in rep.counts.items() if n["n"]}
    assert ran >= {"completion", "chat_stream", "multi_turn", "json_schema", "tool_call", "logprobs_n"}, rep.counts
    assert sum(n["n"] for n in rep.counts.values()) >= 30, rep.counts  # traffic enough to mean something
    failed = {name: detail for name, (ok, detail) in rep.criteria.items() if not ok}
    assert not failed, failed
    assert (tmp_path / "soak.md").exists() and (tmp_path / "soak.json").exists()
