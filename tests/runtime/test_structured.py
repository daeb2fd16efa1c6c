"""Grammar-constrained decoding in the runtime (docs/structured_output.md, "How the runtime applies it"):
`ar` masks its logit rows and accepts each committed token; `self_spec` verifies row i under the state after
the draft's first i tokens, drafts only tokens the grammar allows, and equals `ar` under the same grammar
token for token (greedy); `low_confidence` requests with a grammar run as `self_spec`."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from clover_export.constraints import compile as compile_grammar
from clover_export.runtime import Generator

PROMPTS = ["sort: 5 3 9 1 7 2", "reverse: a b c d e f g", "hello", "sort: 9 8 7 1 1 4 4 2"]
CONTROLS = dict(repetition_penalty=1.3, frequency_penalty=0.2, presence_penalty=0.5)
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "n": {"type": "integer"}, "ok": {"type": "boolean"},
                                           "tags": {"type": "array", "items": {"enum": ["a", "bc"]},
                                                    "maxItems": 3}},
          "required": ["name", "n", "ok", "tags"], "additionalProperties": False}
SPEC = {"type": "json_schema", "json_schema": {"name": "t", "schema": SCHEMA}}


@pytest.fixture(scope="module")
def gen(random_tiny_dir):
    return Generator.load(random_tiny_dir, backend="torch", dtype="fp32", max_slots=4, prefix_cache=False)


def drafts_allowed(gen, grammar, handles) -> bool:
    """Every constrained request's current draft, replayed on a fresh matcher after its response: allowed."""
    for h in handles:
        req = h.request
        m = grammar.matcher()
        for t in req.response + req.state.draft:
            if m.is_terminated() or not m.allowed(t) or not m.accept(t):
                return False
    return True


def run(gen, modes, grammar, check_drafts=False, **params):
    handles = [gen.submit(p, decoding=m, grammar=grammar if c else None, **params)
               for p, (m, c) in zip(PROMPTS, modes)]
    drafted = 0
    while not all(h.done for h in handles):
        gen.step()
        drafted += sum(len(getattr(h.request.state, "draft", [])) for h in handles if not h.done)
        if check_drafts:
            assert drafts_allowed(gen, grammar, [h for h, (_, c) in zip(handles, modes) if c and not h.done])
    return [h.wait() for h in handles], drafted


def test_ar_under_a_schema_gives_valid_json_whatever_the_weights(gen):
    grammar = compile_grammar(SPEC, gen.grammar_vocab())
    results, _ = run(gen, [("ar", True)] * 4, grammar, max_new_tokens=120, **CONTROLS)
    for r in results:
        assert r.finish_reason == "stop", r.text
        jsonschema.validate(json.loads(r.text), SCHEMA)


@pytest.mark.parametrize("draft_threshold", [0.0, 0.3])
def test_self_spec_under_a_grammar_equals_ar_under_it(gen, draft_threshold):
    grammar = compile_grammar(SPEC, gen.grammar_vocab())
    params = dict(max_new_tokens=120, draft_threshold=draft_threshold, **CONTROLS)
    ar, _ = run(gen, [("ar", True)] * 4, grammar, **params)
    alone = [gen.generate(p, decoding="self_spec", grammar=grammar, **params) for p in PROMPTS]
    mixed, drafted = run(gen, [("self_spec", True), ("low_confidence", False), ("low_confidence", True),
                               ("ar", True)], grammar, check_drafts=True, **params)
    assert [r.token_ids for r in alone] == [r.token_ids for r in ar]
    assert [mixed[i].token_ids for i in (0, 2, 3)] == [ar[i].token_ids for i in (0, 2, 3)]
    assert mixed[2].decoding == "self_spec" and mixed[1].decoding == "low_confidence"
    assert drafted > 0 and sum(r.forwards for r in alone) < sum(len(r.token_ids) for r in alone)


def test_cut_by_max_tokens_is_length_and_a_valid_prefix(gen):
    grammar = compile_grammar(SPEC, gen.grammar_vocab())
    r = gen.generate(PROMPTS[0], decoding="self_spec", grammar=grammar, max_new_tokens=5)
    assert r.finish_reason == "length" and len(r.token_ids) == 5
    m = grammar.matcher()
    assert all(m.accept(t) for t in r.token_ids)


def test_a_grammar_of_another_vocabulary_or_ignore_eos_is_refused(gen, tiny_dir):
    from clover_export.constraints import tokenizer_info
    from clover_export.core.errors import CloverError

    other = compile_grammar({"type": "json_object"}, tokenizer_info(tiny_dir, gen.cfg.vocab_size, [0]))
    with pytest.raises(CloverError, match="grammar"):
        gen.submit("x", grammar=other)
    with pytest.raises(CloverError, match="ignore_eos"):
        gen.submit("x", grammar=compile_grammar({"type": "json_object"}, gen.grammar_vocab()), ignore_eos=True)


def test_a_draft_is_cut_after_the_end_token_and_the_state_kept(gen):
    """A block drafts on past the end of the grammar (end tokens again and again): the draft keeps nothing
    after the first end token, and the matcher is where it was (it cannot be rolled back past its stop)."""
    from clover_export.runtime.decoding.grammar import RequestGrammar, allowed_prefix, mask_block

    g = RequestGrammar.start(compile_grammar({"type": "json_object"}, gen.grammar_vocab()), gen.block_size)
    body = gen.tokenizer.encode('{"a":1}', add_special_tokens=False)
    end = min(gen.grammar_vocab().end_ids)
    assert allowed_prefix(g, body + [end, end, end]) in (body, body + [end])  # complete after "}": it may stop
    logits = torch.zeros(gen.block_size, gen.cfg.vocab_size)
    mask_block(g, body + [end], logits)
    assert g.matcher.allowed(body[0]) and not g.matcher.allowed(end)  # still at the start


@pytest.mark.parametrize("mode", ["ar", "self_spec"])
def test_sampled_requests_under_a_schema_give_valid_json(gen, mode):
    """Sampling draws from the masked distributions (self_spec: speculative sampling against them)."""
    grammar = compile_grammar(SPEC, gen.grammar_vocab())
    for seed in range(3):
        r = gen.generate(PROMPTS[seed], decoding=mode, grammar=grammar, max_new_tokens=160, temperature=1.0,
                         do_sample=True, seed=seed, draft_threshold=0.0)
        assert r.finish_reason == "stop", r.text
        jsonschema.validate(json.loads(r.text), SCHEMA)


def test_threads_preparing_requests_at_once_share_one_grammar_vocabulary(tiny_dir):
    """The server prepares requests on several threads; a grammar is checked against `grammar_vocab()` by
    identity, so every thread must get the same object (two had made two, and a request met a 400)."""
    from concurrent.futures import ThreadPoolExecutor

    fresh = Generator.load(tiny_dir, "torch", dtype="fp32", max_slots=1, prefix_cache=False)
    with ThreadPoolExecutor(8) as pool:
        vocabs = list(pool.map(lambda _: fresh.grammar_vocab(), range(8)))
    assert all(v is vocabs[0] for v in vocabs)
