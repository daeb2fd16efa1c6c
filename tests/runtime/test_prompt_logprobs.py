"""Prompt logprobs (docs/runtime.md, Prompt logprobs): each prompt token's log-probability given the tokens
before it, against an independent reference (transformers' log-softmax of Qwen3_5MoeForCausalLM on the same
weights), in every decoding mode, over a prompt of several chunks; asking changes no response token, not even a
seeded sample's, and no other request of the step; such a request computes its whole prompt."""

from __future__ import annotations

import pytest
import torch

from clover_export.runtime import Generator

K = 3
# 80-odd tokens: three scoring chunks of at most a block (32) and the last row alone
PROMPT = "Sort: 5 3 7 1 9 2 8 4 6 0. Reverse: 1 2 3 4 5 6 7 8 9. Sort: 9 8 7 6 5 4 3 2 1 0 and then reverse it: "


@pytest.fixture(scope="module")
def gen(tiny_dir):
    return Generator.load(tiny_dir, "torch", dtype="fp32", max_slots=4)


@pytest.fixture(scope="module")
def want(reference, gen):
    """Per prompt position i >= 1: (the reference's log-probability of token i, its top K ids and values)."""
    hf, _, _ = reference
    ids = gen.prompt_ids(PROMPT, raw=True)
    with torch.no_grad():
        lsm = torch.log_softmax(hf(input_ids=torch.tensor([ids])).logits[0].double(), -1)
    top = lsm.topk(K, -1)
    return ids, [(float(lsm[i - 1, ids[i]]), top.indices[i - 1].tolist(), top.values[i - 1].tolist())
                 for i in range(1, len(ids))]


@pytest.mark.parametrize("decoding", ["ar", "self_spec", "low_confidence"])
def test_prompt_logprobs_are_transformers_log_softmax(gen, want, decoding):
    ids, ref = want
    assert len(ids) > 2 * gen.block_size  # several scoring chunks
    r = gen.generate(PROMPT, raw=True, decoding=decoding, prompt_logprobs=K, max_new_tokens=4)
    assert r.prompt_ids == ids and len(r.prompt_logprobs) == len(ids) and r.prompt_logprobs[0] is None
    assert r.cached_tokens == 0  # computed whole, though earlier requests left this prompt in the cache
    for i, (t, (lp, top_ids, top_lp)) in enumerate(zip(r.prompt_logprobs[1:], ref), 1):
        assert t.token == ids[i]
        assert t.logprob == pytest.approx(lp, rel=1e-4, abs=2e-4), i
        assert [v for _, v in t.top] == pytest.approx(top_lp, rel=1e-4, abs=2e-4), i  # fp32, chunked
        if top_lp[0] - top_lp[1] > 1e-3 and top_lp[1] - top_lp[2] > 1e-3:  # no near-tie: the same order
            assert [j for j, _ in t.top] == top_ids, i
    plain = gen.generate(PROMPT, raw=True, decoding=decoding, max_new_tokens=4)
    assert plain.token_ids == r.token_ids and plain.prompt_logprobs == []
    assert plain.cached_tokens > 0  # the scoring request left its prompt for others


def test_asking_changes_no_seeded_sample_and_no_other_request(gen):
    kw = dict(decoding="ar", do_sample=True, temperature=1.5, seed=7, max_new_tokens=12)
    alone = gen.generate(PROMPT, raw=True, **kw).token_ids
    other = dict(decoding="low_confidence", max_new_tokens=16)
    other_alone = gen.generate("What is 2 + 3?", **other).token_ids
    scored, beside = gen.submit(PROMPT, raw=True, prompt_logprobs=0, **kw), gen.submit("What is 2 + 3?", **other)
    scored, beside = scored.wait(), beside.wait()
    assert scored.token_ids == alone and beside.token_ids == other_alone
    assert len(scored.prompt_logprobs) == len(scored.prompt_ids) and all(not t.top for t in scored.prompt_logprobs[1:])


@pytest.mark.parametrize("decoding", ["self_spec", "low_confidence"])
def test_requests_asking_for_different_alternatives_share_a_step(gen, decoding):
    """The device reads back the most alternatives any row of the step asked for; each request gets its own
    first k, position by position (prompt and response)."""
    kw = dict(raw=True, decoding=decoding, max_new_tokens=12)
    few, many = gen.submit(PROMPT, prompt_logprobs=1, logprobs=1, **kw), gen.submit(PROMPT, prompt_logprobs=4,
                                                                                   logprobs=4, **kw)
    few, many = few.wait(), many.wait()
    assert few.token_ids == many.token_ids
    for a, b in [(few.prompt_logprobs[1:], many.prompt_logprobs[1:]), (few.logprobs, many.logprobs)]:
        assert len(a) == len(b) > 0
        assert [[i for i, _ in t.top] for t in a] == [[i for i, _ in t.top[:1]] for t in b]  # the same ids
        assert [t.top[0][1] for t in a] == pytest.approx([t.top[0][1] for t in b], abs=1e-5)  # rows of one batch
        assert all(len(t.top) == 4 for t in b)


def test_absolute_alignment_scores_under_ar_and_refuses_low_confidence(tiny_dir, tmp_path):
    """Absolute alignment puts the prompt's tail in the first block under low_confidence, so its rows are not
    prefilled: refused naming the parameter; ar's blocks follow the prompt, so it scores every token."""
    import json
    import shutil

    from clover_export.core.errors import CloverError

    folder = shutil.copytree(tiny_dir, tmp_path / "absolute")
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "block_alignment": "absolute"}))
    gen = Generator.load(folder, "torch", dtype="fp32", max_slots=1, prefix_cache=False)
    with pytest.raises(CloverError, match="prompt_logprobs"):
        gen.submit(PROMPT, raw=True, decoding="low_confidence", prompt_logprobs=0)
    r = gen.generate(PROMPT, raw=True, decoding="ar", prompt_logprobs=0, max_new_tokens=2)
    assert len(r.prompt_logprobs) == len(r.prompt_ids) and all(t is not None for t in r.prompt_logprobs[1:])
