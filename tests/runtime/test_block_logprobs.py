"""low_confidence logprobs when a block resolves early: an end token filled with every position before it
filled leaves the positions after it masked (early stop); the response's tokens each keep their logprob, the
positions after the end need none (docs/serving.md, Logprobs)."""

from __future__ import annotations

import pytest

from clover_export.runtime import Generator

SYSTEM = {"role": "system", "content": "You are a careful assistant. Answer with the result only."}
# with thinking on, the first block of the first one fills its end token (position 3) before position 5
CHATS = [[SYSTEM, {"role": "user", "content": "Sort: 5 3 7"}], [{"role": "user", "content": "Sort: 5 3 7"}],
         [SYSTEM, {"role": "user", "content": "Reverse: 2 8 2 7 9"}]]


@pytest.fixture(scope="module")
def gen(tiny_dir):
    return Generator.load(tiny_dir, "torch", dtype="fp32", max_slots=4)


def test_a_block_that_stops_early_keeps_a_logprob_per_token(gen):
    results = gen.generate_batch(CHATS, decoding="low_confidence", logprobs=2, max_new_tokens=8, do_sample=False)
    for r in results:
        assert len(r.logprobs) == len(r.token_ids) and all(t.logprob <= 0 for t in r.logprobs)
        assert [t.token for t in r.logprobs] == r.token_ids
    plain = gen.generate_batch(CHATS, decoding="low_confidence", max_new_tokens=8, do_sample=False)
    assert [r.token_ids for r in plain] == [r.token_ids for r in results]  # asking changes no token
