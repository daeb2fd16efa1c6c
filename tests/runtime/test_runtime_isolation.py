"""Requests isolated from each other: seeded sampling independent of the batch, every
parameter checked up front, a failing step fails only the requests it concerns (DECODING.md 1.2, 4)."""

from __future__ import annotations

import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from clover_export.backends.torch_backend import TorchBackend
from clover_export.core.errors import CloverError
from clover_export.runtime.generator import Generator

PROMPT = "What is 123 + 456?"
LONG_PROMPT = "Please sort the list 3 1 2 4 9 in ascending order, then reverse the word robot. " * 2
# <|endoftext|> is no end token here: responses run over several blocks (see test_runtime.py)
SAMPLED = dict(eos_token_id=[1], threshold=0.5, max_new_tokens=40, do_sample=True, temperature=2.0, top_p=0.95)


def make(model, tiny_dir, **kw) -> Generator:
    kw.setdefault("max_slots", 3)
    return Generator(TorchBackend(model, tiny_dir), tiny_dir, **kw)


# --- seeded sampling independent of the batch ---------------------------------------------------
def staggered(gen: Generator, first: dict, second: dict, delay: int):
    """Submit `first`, step `delay` times, then submit `second` (it joins while `first` is mid-way)."""
    a = gen.submit(first.pop("prompt"), **first)
    for _ in range(delay):
        gen.step()
    b = gen.submit(second.pop("prompt"), **second)
    return gen.wait([a, b])


def test_seeded_request_prefilling_next_to_a_denoising_row(model, tiny_dir):
    """The seeded request prefills its long prompt in chunks while the other row denoises (and samples):
    its generator must be consumed by its own denoise steps only."""
    mine = dict(SAMPLED, prompt=LONG_PROMPT, seed=7)
    alone = make(model, tiny_dir, prefill_chunk=16).generate(**dict(mine))
    gen = make(model, tiny_dir, prefill_chunk=16)
    other = dict(SAMPLED, prompt=PROMPT, seed=3, max_new_tokens=64)
    _, r = staggered(gen, other, dict(mine), delay=2)
    assert r.token_ids == alone.token_ids
    # the other way round: the seeded request denoises while the newcomer prefills next to it
    gen = make(model, tiny_dir, prefill_chunk=16)
    r, _ = staggered(gen, dict(mine), dict(SAMPLED, prompt=LONG_PROMPT, seed=3), delay=9)
    assert r.token_ids == alone.token_ids


@pytest.mark.slow
@settings(max_examples=4, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(delay=st.integers(0, 12), chunk=st.sampled_from([8, 16, 256]), seeded_first=st.booleans(),
       other_samples=st.booleans())
def test_seeded_tokens_do_not_depend_on_the_batch(model, tiny_dir, delay, chunk, seeded_first, other_samples):
    mine = dict(SAMPLED, prompt=LONG_PROMPT, seed=21)
    alone = make(model, tiny_dir, prefill_chunk=chunk).generate(**dict(mine))
    other = dict(SAMPLED, prompt=PROMPT, seed=5, max_new_tokens=48, do_sample=other_samples)
    gen = make(model, tiny_dir, prefill_chunk=chunk)
    if seeded_first:
        r, _ = staggered(gen, dict(mine), other, delay)
    else:
        _, r = staggered(gen, other, dict(mine), delay)
    assert r.token_ids == alone.token_ids


# --- every parameter checked up front ------------------------------------------------------------
BAD_PARAMS = [  # (parameters, the name the error must carry); vocabulary size of the tiny model: 512
    (dict(eos_token_id=[100000]), "eos_token_id"), (dict(eos_token_id=[-1]), "eos_token_id"),
    (dict(eos_token_id=[2.5]), "eos_token_id"), (dict(eos_token_id="<|im_end|>"), "eos_token_id"),
    (dict(temperature=math.nan), "temperature"), (dict(temperature=-1.0), "temperature"),
    (dict(temperature=math.inf), "temperature"), (dict(temperature="hot"), "temperature"),
    (dict(temperature=0.0), "temperature"),  # greedy is do_sample=False; the selector divides by it
    (dict(top_k=2.5), "top_k"), (dict(top_k=-1), "top_k"), (dict(top_k=True), "top_k"),
    (dict(top_p=1.01), "top_p"), (dict(top_p=math.nan), "top_p"), (dict(top_p=-0.1), "top_p"),
    (dict(threshold=math.nan), "threshold"), (dict(threshold="0.5"), "threshold"), (dict(threshold=0.0), "threshold"),
    (dict(threshold=1.5), "threshold"),
    (dict(dllm_length_penalty_start=-1), "dllm_length_penalty_start"),
    (dict(dllm_think_end_start=-5), "dllm_think_end_start"),
    (dict(dllm_length_penalty_window=0), "dllm_length_penalty_window"),
    (dict(dllm_think_end_window=-1), "dllm_think_end_window"),
    (dict(dllm_length_penalty=-1.0), "dllm_length_penalty"),
    (dict(dllm_think_end_bias=math.inf), "dllm_think_end_bias"),
    (dict(dllm_think_end_bias=-1.0), "dllm_think_end_bias"),
    (dict(repetition_penalty=0.0), "repetition_penalty"), (dict(presence_penalty=math.nan), "presence_penalty"),
    (dict(frequency_penalty=-2.1), "frequency_penalty"),
    (dict(max_new_tokens=2.0), "max_new_tokens"), (dict(max_new_tokens=-3), "max_new_tokens"),
    (dict(block_size=16), "block_size"), (dict(block_size="32"), "block_size"),
    (dict(seed=-1), "seed"), (dict(seed=1.5), "seed"), (dict(seed="7"), "seed"), (dict(seed=2**64), "seed"),
    (dict(do_sample="yes"), "do_sample"), (dict(enable_thinking=1), "enable_thinking"),
    (dict(stop=[3]), "stop"),
    (dict(prompt_ids=[1, 2.7]), "prompt_ids"), (dict(prompt_ids=[1, 600]), "vocabulary"),
]


@pytest.fixture(scope="module")
def shared(model, tiny_dir):
    """One Generator for the rejection cases, counting backend calls."""
    gen = make(model, tiny_dir)
    gen.calls = []
    step = gen.backend.step
    gen.backend.step = lambda *a: gen.calls.append(1) or step(*a)
    return gen


@pytest.mark.parametrize("params, name", BAD_PARAMS, ids=[f"{n}-{i}" for i, (_, n) in enumerate(BAD_PARAMS)])
def test_bad_parameter_is_rejected_at_submit_naming_it(shared, params, name):
    prompt = {} if "prompt_ids" in params else {"prompt": PROMPT}
    with pytest.raises(CloverError, match=name):
        shared.submit(**prompt, **params)
    assert not shared.loop.has_work() and not shared.handles and shared.calls == []


def test_generator_serves_after_rejections(model, tiny_dir):
    """Every rejection above, then a request: it gets the very tokens a fresh generator gives."""
    gen = make(model, tiny_dir)
    for params, _ in BAD_PARAMS:
        with pytest.raises(CloverError):
            gen.submit(**({} if "prompt_ids" in params else {"prompt": PROMPT}), **params)
    kw = dict(eos_token_id=[1], threshold=0.5, max_new_tokens=8)  # no end token early: runs to the limit
    got, fresh = gen.generate(PROMPT, **kw), make(model, tiny_dir).generate(PROMPT, **kw)
    assert (got.response_tokens, got.finish_reason) == (8, "length")
    assert got.token_ids == fresh.token_ids and got.text == fresh.text


def test_edges_of_the_ranges_are_accepted(model, tiny_dir):
    gen = make(model, tiny_dir)
    ok = dict(threshold=1, top_p=1.0, top_k=0, temperature=1e-3, seed=2**64 - 1, do_sample=True,
              presence_penalty=0, frequency_penalty=0.0, dllm_length_penalty_start=0, dllm_think_end_start=0,
              eos_token_id=[0, model.cfg.vocab_size - 1], block_size=model.block_size, max_new_tokens=1)
    assert gen.generate(PROMPT, **ok).response_tokens == 1


# --- a failing step fails only the requests it concerns --------------------------------------------
POISON = 400  # a token id no chat-template prompt here holds


class PoisonedBackend(TorchBackend):
    """Runs the step (caches updated in place), then raises when a causal row holds POISON, or when the
    batch has `fail_at_batch` rows or more: a fault only the loop can attribute."""

    fail_at_batch = 99

    def step(self, inputs, pools):
        out = super().step(inputs, pools)
        ids, n_causal = inputs["input_ids"], inputs["n_causal"]
        if any(POISON in ids[r, :int(n_causal[r])].tolist() for r in range(ids.shape[0])):
            raise RuntimeError("poisoned row")
        if ids.shape[0] >= self.fail_at_batch:
            raise RuntimeError("out of memory at this batch size")
        return out


GOOD = [dict(prompt=PROMPT, eos_token_id=[1], threshold=0.5, max_new_tokens=40),
        dict(SAMPLED, prompt=LONG_PROMPT, seed=4)]


def alone_results(model, tiny_dir):
    gen = make(model, tiny_dir, prefill_chunk=16)
    return [gen.generate(**dict(p)) for p in GOOD]


def test_poisoned_rows_fail_alone_and_the_others_finish_as_if_alone(model, tiny_dir):
    alone = alone_results(model, tiny_dir)
    gen = Generator(PoisonedBackend(model, tiny_dir), tiny_dir, max_slots=3, prefill_chunk=16)
    good = [gen.submit(**dict(GOOD[1]))]  # seeded sampling: its generator draws in the failing steps
    for _ in range(5):
        gen.step()  # its prompt is cached and its first block mid-way when the others join
    bad_ids = gen.tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}])
    bad = gen.submit(prompt_ids=bad_ids[:3] + [POISON] + bad_ids[3:], max_new_tokens=8)
    good.append(gen.submit(**dict(GOOD[0])))  # prefills next to the denoising row and the poisoned one
    with pytest.raises(CloverError, match=f"request {bad.request_id} failed: RuntimeError: poisoned row"):
        gen.wait([bad, *good])
    assert [(h.result.token_ids, h.result.finish_reason) for h in good] == [(r.token_ids, r.finish_reason)
                                                                            for r in alone[::-1]]
    assert bad.result.finish_reason == "error" and "poisoned row" in bad.result.error
    with pytest.raises(CloverError, match="poisoned row"):
        list(bad)
    assert sorted(gen.loop.scheduler.free_slots) == [0, 1, 2] and not gen.loop.has_work()
    # later requests still work, next to another poisoned one
    again = gen.submit(**dict(GOOD[0]))
    bad = gen.submit(prompt_ids=[POISON] * 5, max_new_tokens=8)
    results = gen.wait([again, bad], raise_errors=False)
    assert results[0].token_ids == alone[0].token_ids and results[1].finish_reason == "error"


def test_request_past_the_checks_fails_at_admission_only(model, tiny_dir):
    alone = alone_results(model, tiny_dir)
    gen = make(model, tiny_dir, prefill_chunk=16)
    a = gen.submit(**dict(GOOD[0]))
    gen.step()
    bad = gen.submit(PROMPT, max_new_tokens=8)
    bad.request.end_ids = frozenset({10**6})  # as if built without Generator.submit's checks
    bad2 = gen.submit(PROMPT, max_new_tokens=8)
    bad2.request.prefill_ids[2] = -7
    bad3 = gen.submit(PROMPT, max_new_tokens=8)
    object.__setattr__(bad3.request.params, "temperature", math.nan)
    b = gen.submit(**dict(GOOD[1]))
    results = gen.wait([a, bad, bad2, bad3, b], raise_errors=False)
    assert [r.finish_reason for r in results] == [alone[0].finish_reason, "error", "error", "error",
                                                  alone[1].finish_reason]
    assert "end token ids" in bad.result.error and "prompt token ids" in bad2.result.error
    assert "'temperature'" in bad3.result.error
    assert [a.result.token_ids, b.result.token_ids] == [r.token_ids for r in alone]


def test_a_step_that_fails_for_no_single_row_fails_its_rows_and_the_loop_goes_on(model, tiny_dir):
    backend = PoisonedBackend(model, tiny_dir)
    backend.fail_at_batch = 2
    gen = Generator(backend, tiny_dir, max_slots=2)
    handles = [gen.submit(PROMPT, max_new_tokens=8) for _ in range(2)]
    results = gen.wait(handles, raise_errors=False)
    assert [r.finish_reason for r in results] == ["error", "error"]
    assert all("out of memory" in r.error for r in results)
    assert gen.generate(PROMPT, max_new_tokens=8).finish_reason in ("stop", "length")


# --- stop strings: not returned, in the text nor in the ids (DECODING.md 1.5) ---------------------------
from clover_export.runtime.output import TextTracker  # noqa: E402

PIECES = ["ab", "cd", "ef", "g", "h", "xyz", "é", " "]  # token id i decodes to PIECES[i]; 8 is an end token


def decode_pieces(ids):
    return "".join(PIECES[i] for i in ids if i < len(PIECES))


def test_stop_string_starting_mid_token_drops_that_token_from_the_ids():
    t = TextTracker(decode_pieces, frozenset({8}), ("de",))
    assert t.push([0, 1, 2], final=False) == ("abc", [0])
    assert t.stopped and t.text == "abc" and t.token_ids == [0]  # "cd" reaches into "de": dropped
    t = TextTracker(decode_pieces, frozenset({8}), ("cd",))  # on a token boundary
    assert t.push([0, 1, 2], final=False) == ("ab", [0]) and t.token_ids == [0]


def test_stop_string_across_blocks_holds_back_text_and_ids():
    t = TextTracker(decode_pieces, frozenset({8}), ("def",))
    assert t.push([0, 1], final=False) == ("ab", [0])  # "cd" could still start "def": held back
    assert t.push([2, 3], final=False) == ("c", [])
    assert t.stopped and t.text == "abc" and t.token_ids == [0]


@settings(max_examples=300, deadline=None)
@given(ids=st.lists(st.integers(0, len(PIECES)), min_size=1, max_size=24),
       cuts=st.lists(st.integers(1, 6), min_size=8, max_size=8),
       stops=st.lists(st.text(alphabet="abcdefghxyzé ", min_size=1, max_size=4), max_size=2))
def test_stop_string_cut_properties(ids, cuts, stops):
    end = len(PIECES)
    if end in ids:  # the loop ends a response at its first end token
        ids = ids[:ids.index(end) + 1]
    t = TextTracker(decode_pieces, frozenset({end}), tuple(stops))
    blocks, i = [], 0
    for c in cuts + [len(ids)]:
        if i < len(ids):
            blocks.append(ids[i:i + c])
            i += c
    texts, chunk_ids = [], []
    for k, b in enumerate(blocks):
        delta, got = t.push(b, final=k == len(blocks) - 1)
        texts.append(delta)
        chunk_ids += got
        if t.stopped:
            break
    full = decode_pieces(ids)
    at = min((full.find(s) for s in stops if s in full), default=None)
    assert t.text == (full if at is None else full[:at])
    assert "".join(texts) == t.text and chunk_ids == t.token_ids
    assert ids[:len(t.token_ids)] == t.token_ids
    kept = decode_pieces(t.token_ids)
    assert t.text.startswith(kept)
    if at is not None:
        assert t.stopped and not any(s in kept for s in stops)
        assert len(decode_pieces(ids[:len(t.token_ids) + 1])) > at  # the next id reaches into the stop string
    else:
        assert t.token_ids == ids


def test_stop_string_in_the_runtime_result(model, tiny_dir):
    gen = make(model, tiny_dir)
    kw = dict(eos_token_id=[1], threshold=0.5, max_new_tokens=64)
    full = gen.generate(PROMPT, **kw)
    text = full.text
    stop = next(text[i:i + 3] for i in range(8, len(text) - 3) if text.find(text[i:i + 3]) == i)
    res = gen.generate(PROMPT, stop=[stop], **kw)
    at = text.find(stop)
    assert res.finish_reason == "stop_string" and res.text == text[:at]
    n = len(res.token_ids)
    assert full.token_ids[:n] == res.token_ids and res.response_tokens == n
    assert stop not in gen.tokenizer.decode(res.token_ids) and res.text.startswith(gen.tokenizer.decode(res.token_ids))
    assert len(gen.tokenizer.decode(full.token_ids[:n + 1])) > at
    assert res.tokens_per_forward == pytest.approx(n / res.denoise_steps)
