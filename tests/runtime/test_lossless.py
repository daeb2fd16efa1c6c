"""The lossless modes (DECODING.md 5): `ar` is the causal model's greedy decoding, `self_spec` gives `ar`'s output.

- `ar` equals an independent cache-free loop over transformers' Qwen3_5MoeForCausalLM (the upstream
  forward), with the generation controls written out by hand here.
- `self_spec` equals `ar` token for token whatever the draft: drafts from the model on random weights
  (mostly rejected, so the GDN rollback runs), drafts forced from `ar`'s own continuation with
  hypothesis-chosen corruptions (accepted, partly accepted, rejected at once), alone and in batches mixed
  with the other modes, with the prefix cache off and on. Every verification accepts exactly the draft's
  longest prefix equal to `ar`'s continuation, and controls that depend on the response index (min_tokens,
  the ramps, `</think>` closing thinking) apply at each draft row's own position.
"""

from __future__ import annotations

import json
import math
import random
from collections import Counter

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from clover_export.runtime import Generator

PROMPTS = ["sort: 5 3 9 1 7 2", "reverse: a b c d e f g", "hello", "sort: 9 8 7 1 1 4 4 2"]
CONTROLS = dict(repetition_penalty=1.3, frequency_penalty=0.2, presence_penalty=0.5)


def token_ids(results):
    return [r.token_ids for r in results]


# --- ar against transformers ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def qwen_clover_dir(tmp_path_factory, tiny_dir):
    """A random transformers Qwen3_5MoeForCausalLM saved with save_pretrained, our tokenizer files and a mask
    token id in its config (the Clover block tensors load zero-filled: `ar` never reads them)."""
    pytest.importorskip("transformers")
    from tiny_qwen import save_random_qwen

    out = tmp_path_factory.mktemp("qwen-ar") / "model"
    hf = save_random_qwen(out, tiny_dir, seed=11)
    config = json.loads((out / "config.json").read_text())
    config.update(mask_token_id=5, block_size=8)
    (out / "config.json").write_text(json.dumps(config))
    return out, hf


def hf_greedy(hf, prompt: list[int], max_new: int, mask_id: int, end_ids: set[int], p: dict) -> list[int]:
    """Cache-free greedy decoding over the upstream forward: the whole sequence each token, the last row's
    logits, mask token excluded, then DECODING.md 3's count penalties (the ramps are 0 this early)."""
    seq, out = list(prompt), []
    with torch.no_grad():
        while len(out) < max_new:
            l = hf(input_ids=torch.tensor([seq])).logits[0, -1].double()
            l[mask_id] = -math.inf
            for t, c in Counter(out).items():
                v = l[t] / p["repetition_penalty"] if l[t] > 0 else l[t] * p["repetition_penalty"]
                l[t] = v - p["frequency_penalty"] * c - p["presence_penalty"]
            tok = int(l.argmax())
            out.append(tok)
            seq.append(tok)
            if tok in end_ids:
                break
    return out


def test_ar_equals_a_cache_free_loop_over_transformers(qwen_clover_dir):
    folder, hf = qwen_clover_dir
    with pytest.warns(UserWarning, match="zero-filled"):
        gen = Generator.load(folder, "torch", dtype="fp32", allow_qwen=True, max_slots=4)
    prompts = [gen.prompt_ids(p, enable_thinking=False) for p in PROMPTS]
    got = gen.wait([gen.submit(prompt_ids=ids, decoding="ar", max_new_tokens=24, **CONTROLS) for ids in prompts])
    ends = set(gen.defaults.eos_token_id) | set(gen.extra_end_ids)
    for ids, res in zip(prompts, got):
        want = hf_greedy(hf, ids, 24, gen.mask_id, ends, CONTROLS)
        assert res.token_ids == want
        assert res.forwards == len(res.token_ids) and res.tokens_per_forward == 1.0  # one token per forward
    assert sum(len(r.token_ids) for r in got) > 40  # long enough continuations to mean something


# --- the greedy acceptance rule, by hand ------------------------------------------------------------
@pytest.mark.parametrize("draft,ar_tokens,accepted,emitted", [
    ([], [7], 0, [7]),  # nothing drafted: the AR token of the one logit row
    ([3, 4, 5], [3, 4, 5, 9], 3, [3, 4, 5, 9]),  # all match: the whole draft, then the AR token after it
    ([3], [3, 1], 1, [3, 1]),
    ([3, 4, 5], [8, 4, 5, 9], 0, [8]),  # the first token differs: only the AR token at row 0
    ([3, 4, 5], [3, 4, 6, 9], 2, [3, 4, 6]),  # the last one differs: two kept, then row 2's AR token
    ([3, 3, 3], [3, 2, 3, 3], 1, [3, 2]),  # later matches after a mismatch do not count
])
def test_accept_greedy_keeps_the_longest_matching_prefix_then_the_ar_token(draft, ar_tokens, accepted, emitted):
    from clover_export.runtime.decoding.ar import accept_greedy

    m, bonus = accept_greedy(draft, ar_tokens)
    assert (m, draft[:m] + [bonus]) == (accepted, emitted)


# --- self_spec against ar -------------------------------------------------------------------------
RANDOM_LOAD = dict(backend="torch", dtype="fp32", max_slots=4)


@pytest.fixture(scope="module", params=[False, True], ids=["cache-off", "cache-on"])
def random_gen(request, random_tiny_dir):
    """The random-weight model with the prefix cache off and on (then self_spec resumes from ar's caches)."""
    return Generator.load(random_tiny_dir, prefix_cache=request.param, **RANDOM_LOAD)


@pytest.fixture(scope="module")
def random_ar(random_tiny_dir):
    """`ar` on the random-weight model, the prefix cache off, one request at a time (memoised): the reference
    every self_spec run must equal."""
    gen, memo = Generator.load(random_tiny_dir, prefix_cache=False, **RANDOM_LOAD), {}

    def tokens(enable_thinking: bool = False, **params) -> list[list[int]]:
        key = json.dumps([enable_thinking, params], sort_keys=True)
        if key not in memo:
            memo[key] = [gen.generate(p, decoding="ar", enable_thinking=enable_thinking, **params).token_ids
                         for p in PROMPTS]
        return memo[key]

    return tokens


def run_modes(gen, modes, requests=None, enable_thinking=False, **params):
    handles = [gen.submit(p, decoding=m, enable_thinking=enable_thinking, **params) for p, m in zip(PROMPTS, modes)]
    if requests is not None:
        requests += [h.request for h in handles]
    return gen.wait(handles)


@pytest.fixture
def no_backoff(monkeypatch):
    """self_spec drafts at every step however badly its drafts do (no back-off to `ar` steps)."""
    from clover_export.runtime.decoding import self_spec

    monkeypatch.setattr(self_spec, "DRAFT_MISSES", 10**9)


@pytest.mark.parametrize("draft_threshold", [0.0, 0.3])
def test_self_spec_equals_ar_on_random_weights_alone_and_mixed(random_gen, random_ar, draft_threshold, no_backoff):
    """Random weights draft badly: most drafts are rejected and the slot's GDN states are rolled back (the
    back-off off, so that the rejections go on)."""
    params = dict(max_new_tokens=40, draft_threshold=draft_threshold, **CONTROLS)
    ar = run_modes(random_gen, ["ar"] * 4, **params)
    assert token_ids(ar) == random_ar(**params)
    handles = [random_gen.submit(p, decoding="self_spec", enable_thinking=False, **params) for p in PROMPTS]
    alone = [h.wait() for h in handles]  # one at a time
    reqs = []
    mixed = run_modes(random_gen, ["self_spec", "low_confidence", "self_spec", "ar"], reqs, **params)
    assert token_ids(alone) == token_ids(ar)
    assert [mixed[i].token_ids for i in (0, 2, 3)] == [ar[i].token_ids for i in (0, 2, 3)]
    assert mixed[1].decoding == "low_confidence" and mixed[1].forwards == mixed[1].denoise_steps
    spec = [h.request for h in handles] + [reqs[0], reqs[2]]
    drafted, accepted = sum(r.drafted_tokens for r in spec), sum(r.accepted_tokens for r in spec)
    if draft_threshold == 0.0:  # every block position drafted: most are rejected and the rollback runs
        assert drafted > accepted + 20


def test_drafts_that_add_nothing_back_off_to_ar_steps(random_gen, random_ar):
    """Random weights: the block rarely predicts the causal model's next tokens, so self_spec backs off to
    causal-only (`ar`) steps after DRAFT_MISSES fruitless block steps, for DRAFT_BACKOFF[0], then twice as
    many, ... steps; a 40-token answer then runs a block in a few steps only. The output stays ar's."""
    from clover_export.runtime.decoding.self_spec import DRAFT_BACKOFF, DRAFT_MISSES

    params = dict(max_new_tokens=40, **CONTROLS)
    steps: list[bool] = []  # per self_spec step after the prompt: whether the row ran a block
    random_gen.loop.on_step = lambda plan, outputs: steps.extend(
        row.block is not None for req, row in zip(plan.requests, plan.rows)
        if req.decoding == "self_spec" and req.response)
    try:
        spec = random_gen.wait([random_gen.submit(PROMPTS[0], decoding="self_spec", enable_thinking=False,
                                                  **params)])
    finally:
        random_gen.loop.on_step = None
    assert token_ids(spec) == random_ar(**params)[:1]
    assert spec[0].tokens_per_forward < 1.5  # the premise: these drafts add (almost) nothing
    # DRAFT_MISSES block steps, then a rest of 2, DRAFT_MISSES, a rest of 4, ... (a hit restarts the count):
    # over the answer's steps after its first token, DRAFT_MISSES block steps per rest that fits, and the last
    rests = [min(DRAFT_BACKOFF[0] * 2**i, DRAFT_BACKOFF[1]) for i in range(8)]
    fitting = next(i for i in range(8) if sum(rests[:i]) >= params["max_new_tokens"] - 1)
    assert sum(steps) <= DRAFT_MISSES * (fitting + 1) + 2, steps
    assert steps.count(False) >= len(steps) // 2, steps


def common_length(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


class OracleDrafts:
    """Replaces self_spec's drafts by the `ar` continuation, corrupted at chosen positions: any draft must
    give `ar`'s output. Each verification must accept exactly the draft's longest prefix equal to `ar`'s
    continuation (a correct draft: all of it); `checks` holds (drafted, expected, accepted) of the
    verifications whose drafted positions all lie within `ar`'s answer. It is the loop's `on_step` observer:
    it sees each step's typed outputs before the scheduler reads them, and rewrites their next drafts."""

    def __init__(self, truth: dict[tuple, list[int]], length: int, corrupt: float, rng: random.Random, vocab: int):
        self.truth, self.length, self.corrupt, self.rng, self.vocab = truth, length, corrupt, rng, vocab
        self.checks: list[tuple[int, int, int]] = []

    def expected_acceptance(self, plan) -> list[tuple[int, int] | None]:
        out = []
        for req, row in zip(plan.requests, plan.rows):
            truth, at = self.truth[tuple(req.prompt_ids)], len(req.response)
            within = req.decoding == "self_spec" and row.draft and at + len(row.draft) <= len(truth)
            out.append((len(row.draft), common_length(row.draft, truth[at:])) if within else None)
        return out

    def __call__(self, plan, outputs):
        from clover_export.runtime.request import Phase

        # a lossless step's causal rows (pending tokens + draft) never exceed block_size (docs/decoding.md)
        for req, n in zip(plan.requests, plan.n_causal):
            assert req.phase is Phase.PREFILL or n <= plan.block_size, req.state
        self.checks += [(*e, out.verdict.accepted) for e, out in zip(self.expected_acceptance(plan), outputs)
                        if e is not None]
        for req, out in zip(plan.requests, outputs):
            v = out.verdict
            if v is None or req.decoding != "self_spec":
                continue
            truth = self.truth[tuple(req.prompt_ids)] + [0] * 64
            start = len(req.response) + v.accepted + 1
            draft = list(truth[start:start + self.length])
            for i in range(len(draft)):
                if self.rng.random() < self.corrupt:
                    draft[i] = (draft[i] + 1 + self.rng.randrange(50)) % self.vocab
            v.draft = draft


def with_oracle_drafts(gen, ar, length, corrupt=0.0, seed=0, enable_thinking=False, **params):
    """self_spec (three rows) beside ar (one row), every draft replaced by OracleDrafts: (results, requests,
    oracle)."""
    prompts = [gen.prompt_ids(p, enable_thinking=enable_thinking) for p in PROMPTS]
    oracle = OracleDrafts({tuple(ids): t for ids, t in zip(prompts, ar)}, length, corrupt, random.Random(seed),
                          gen.cfg.vocab_size)
    reqs = []
    gen.loop.on_step = oracle
    try:
        spec = run_modes(gen, ["self_spec", "ar", "self_spec", "self_spec"], reqs, enable_thinking, **params)
    finally:
        gen.loop.on_step = None
    return spec, reqs, oracle


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**16), length=st.integers(0, 31), corrupt=st.sampled_from([0.0, 0.05, 0.3, 1.0]))
def test_self_spec_equals_ar_for_any_draft(random_gen, random_ar, seed, length, corrupt):
    params = dict(max_new_tokens=40, **CONTROLS)
    ar = random_ar(**params)
    spec, _, oracle = with_oracle_drafts(random_gen, ar, length, corrupt, seed, **params)
    assert token_ids(spec) == ar
    assert all(want == got for _, want, got in oracle.checks), oracle.checks
    if corrupt == 0.0:
        assert all(drafted == got for drafted, _, got in oracle.checks), oracle.checks


def test_correct_drafts_are_accepted_whole(random_gen, random_ar):
    """Drafts of 7 tokens equal to ar's continuation: every drafted token is accepted, so after the first
    token (the last prompt chunk's forward) each forward appends 8 tokens."""
    params, L = dict(max_new_tokens=40, **CONTROLS), 7
    ar = random_ar(**params)
    spec, reqs, oracle = with_oracle_drafts(random_gen, ar, L, **params)
    assert token_ids(spec) == ar
    assert oracle.checks and all(drafted == want == got for drafted, want, got in oracle.checks), oracle.checks
    for r, req in zip(spec, reqs):
        if req.decoding == "self_spec":
            assert req.accepted_tokens == req.drafted_tokens > 0
            assert r.forwards == 1 + math.ceil((len(r.token_ids) - 1) / (L + 1)), r


# the response index of every draft row (DECODING.md 3, 5): min_tokens with the length penalty pushing end tokens
# from n = 1 on ends the answer at exactly n = MIN_TOKENS; the think-end ramp puts `</think>` at n = THINK_AT, and
# the rows after it in the same draft see thinking closed. Neither position starts a step's rows (7-token drafts:
# rows 0 sit at n = 1, 9, 17, ...).
MIN_TOKENS, THINK_AT = 13, 10
POSITIONAL = {
    "min_tokens": dict(enable_thinking=False, min_tokens=MIN_TOKENS, dllm_length_penalty=100.0,
                       dllm_length_penalty_start=0, dllm_length_penalty_window=1),
    "think_end": dict(enable_thinking=True, dllm_think_end_bias=100.0, dllm_think_end_start=THINK_AT - 1,
                      dllm_think_end_window=1),
}


@pytest.mark.parametrize("case", list(POSITIONAL))
def test_position_dependent_controls_apply_at_each_draft_row(random_gen, random_ar, case):
    """Accepted drafts carry the positions where min_tokens lifts and `</think>` is pushed: self_spec equals
    ar token for token only if each draft row's controls use its own response index and the draft's
    `</think>` closes thinking for the rows after it."""
    params = dict(max_new_tokens=40, **CONTROLS, **POSITIONAL[case])
    ar = random_ar(**params)
    ends = set(random_gen.defaults.eos_token_id) | set(random_gen.extra_end_ids)
    think_end = random_gen.tokenizer.think_end_id
    for t in ar:  # the controls decide these positions (hand-set), whatever the weights
        if case == "min_tokens":
            assert len(t) == MIN_TOKENS + 1 and t[-1] in ends and not ends & set(t[:-1]), t
        else:
            assert t.index(think_end) == THINK_AT and len(t) > THINK_AT + 8, t
    spec, reqs, oracle = with_oracle_drafts(random_gen, ar, 7, **params)
    assert token_ids(spec) == ar
    assert oracle.checks and all(drafted == want == got for drafted, want, got in oracle.checks), oracle.checks


def test_self_spec_equals_ar_on_the_trained_default(tiny_dir):
    """Trained weights draft well: most drafts are accepted, several tokens a forward."""
    from clover_export.train import tasks

    gen = Generator.load(tiny_dir, "torch", dtype="fp32", max_slots=8)
    prompts = [ex.prompt for ex in tasks.heldout_examples(8)]
    ar = gen.wait([gen.submit(p, decoding="ar", enable_thinking=False, max_new_tokens=64) for p in prompts])
    spec = gen.wait([gen.submit(p, decoding="self_spec", enable_thinking=False, max_new_tokens=64) for p in prompts])
    assert token_ids(spec) == token_ids(ar)
    assert sum(len(r.token_ids) for r in spec) / sum(r.forwards for r in spec) >= 3


def test_a_draft_stops_at_its_end_token_and_a_finishing_draft_runs_without_a_block(tiny_dir):
    """Every position drafted (threshold 0), so the block's choices run on past the answer's end token: the
    draft stops at that token (nothing after an accepted end token is kept), and the step verifying a draft
    that ends the request when accepted runs its causal rows alone (no block can become a next draft).
    The output stays ar's."""
    from clover_export.train import tasks

    gen = Generator.load(tiny_dir, "torch", dtype="fp32", max_slots=8)
    ends = set(gen.defaults.eos_token_id) | set(gen.extra_end_ids)
    params = dict(enable_thinking=False, max_new_tokens=64, draft_threshold=0.0)
    prompts = [ex.prompt for ex in tasks.heldout_examples(6)]
    ar = gen.wait([gen.submit(p, decoding="ar", **params) for p in prompts])
    seen = []
    gen.loop.on_step = lambda plan, outputs: seen.extend(
        (list(row.draft), row.block is not None) for req, row in zip(plan.requests, plan.rows)
        if req.decoding == "self_spec" and row.draft)
    try:
        spec = gen.wait([gen.submit(p, decoding="self_spec", **params) for p in prompts])
    finally:
        gen.loop.on_step = None
    assert token_ids(spec) == token_ids(ar)
    assert all(r.token_ids[-1] in ends for r in ar)  # every answer ends at an end token, within the limit
    assert seen and all(not ends & set(draft[:-1]) for draft, _ in seen), seen
    finishing = [has_block for draft, has_block in seen if draft[-1] in ends]
    assert finishing and not any(finishing), seen
    assert all(has_block for draft, has_block in seen if draft[-1] not in ends), seen


# --- speculative sampling -------------------------------------------------------------------------
def _chi2_fits(counts: list[int], probs: list[float]) -> float:
    """p-value of a chi-square goodness-of-fit test (categories with expected count < 5 merged)."""
    from scipy.stats import chisquare

    n = sum(counts)
    obs, exp, o_rest, e_rest = [], [], 0, 0.0
    for c, p in zip(counts, probs):
        if n * p >= 5:
            obs.append(c)
            exp.append(n * p)
        else:
            o_rest, e_rest = o_rest + c, e_rest + n * p
    if e_rest > 0:
        obs.append(o_rest)
        exp.append(e_rest)
    total = sum(exp)
    return chisquare(obs, [e * n / total for e in exp]).pvalue  # expected sums exactly to n


P = torch.tensor([[0.5, 0.2, 0.1, 0.1, 0.05, 0.05], [0.05, 0.05, 0.1, 0.2, 0.3, 0.3], [0.3, 0.1, 0.1, 0.1, 0.2, 0.2]])
Q = torch.tensor([[0.05, 0.05, 0.3, 0.3, 0.1, 0.2], [0.4, 0.2, 0.1, 0.1, 0.1, 0.1]])  # far from P


def emitted_counts(accept, draws: int = 20000) -> tuple[list[int], list[int], list[int]]:
    """Counts of the first, second and third emitted token over seeded draws: a 2-token draft drawn from Q,
    then `accept(P, Q, draft, generator)` -> (accepted, bonus). A third token is the bonus after a fully
    accepted draft."""
    from clover_export.runtime.selector import draw

    counts = [[0] * 6 for _ in range(3)]
    gen = torch.Generator().manual_seed(0)
    for _ in range(draws):
        draft = draw(Q, gen)
        m, bonus = accept(P, Q, draft, gen)
        for i, t in enumerate(draft[:int(m)].tolist() + [int(bonus)]):
            counts[i][t] += 1
    return counts[0], counts[1], counts[2]


def accept_every_draft_token(p, q, draft, generator):
    """The mutation the sampling test must catch: the draft kept whole, the bonus drawn from p."""
    from clover_export.runtime.selector import draw

    return torch.tensor(draft.shape[0]), draw(p[draft.shape[0]:], generator)[0]


def bonus_drawn_from_q(p, q, draft, generator):
    """The mutation the bonus check must catch: after a fully accepted draft, the bonus drawn from the last
    draft position's q instead of p."""
    from clover_export.runtime.decoding.speculative import accept_sampled
    from clover_export.runtime.selector import draw

    m, bonus = accept_sampled(p, q, draft, generator)
    if draft.shape[0] and int(m) == draft.shape[0]:
        bonus = draw(q[-1], generator)
    return m, bonus


def test_speculative_sampling_rule_gives_the_target_distribution():
    """Draft tokens drawn from Q and kept with probability min(1, p/q), the residual drawn on rejection, the
    bonus after a fully accepted draft drawn from p: the three emitted tokens follow P exactly (20,000
    seeded draws against the hand-set target, the third over the ~4,000 fully accepted drafts:
    sum min(P, Q) = 0.4 and 0.5 a row; P's rows do not depend on the tokens before, which a target may do).
    The fit rejects Q itself, the mutation that accepts every draft token, and a bonus drawn from q."""
    from clover_export.runtime.decoding.speculative import accept_sampled

    first, second, third = emitted_counts(accept_sampled)
    assert _chi2_fits(first, P[0].tolist()) > 1e-3
    assert _chi2_fits(second, P[1].tolist()) > 1e-3
    assert 3700 < sum(third) < 4300  # 20,000 x 0.4 x 0.5 fully accepted
    assert _chi2_fits(third, P[2].tolist()) > 1e-3
    assert _chi2_fits(first, Q[0].tolist()) < 1e-6
    mutated, _, _ = emitted_counts(accept_every_draft_token)
    assert _chi2_fits(mutated, P[0].tolist()) < 1e-6
    _, _, from_q = emitted_counts(bonus_drawn_from_q)
    assert _chi2_fits(from_q, P[2].tolist()) < 1e-6


SPEC_SAMPLING = dict(temperature=0.7, top_k=40, top_p=1.0, dllm_length_penalty=0.0, dllm_think_end_bias=0.0,
                     **CONTROLS)


def block_q_by_hand(logits: torch.Tensor, seen: list[int], mask_id: int) -> torch.Tensor:
    """q of a self_spec sampling row written out from its raw block logits [N, V] (float64): mask token
    excluded, DECODING.md 3's count penalties with `seen` (the response plus the draft) counted (the ramps are
    off in SPEC_SAMPLING), temperature, top-k (ties: the lower id), renormalised (DECODING.md 2.4)."""
    s = SPEC_SAMPLING
    l = logits.double().clone()
    l[:, mask_id] = -math.inf
    for t, c in Counter(seen).items():
        v = l[:, t]
        l[:, t] = torch.where(v > 0, v / s["repetition_penalty"], v * s["repetition_penalty"]) \
            - s["frequency_penalty"] * c - s["presence_penalty"]
    l = l / s["temperature"]
    top = l.argsort(dim=1, descending=True, stable=True)[:, :s["top_k"]]
    kept = torch.full_like(l, -math.inf).scatter(1, top, l.gather(1, top))
    return torch.softmax(kept, dim=1)


def test_a_sampled_draft_is_verified_against_the_distribution_it_was_drawn_from(tiny_dir, monkeypatch):
    """The q handed to the acceptance rule is the block distribution of the step that drew the draft (rows
    1..len(draft)), recomputed here from that step's raw block logits (the runner's observer) with the
    controls and sampling transforms written out, and the draft's tokens are the ones drawn there (the
    step's typed outputs, seen by the loop's `on_step`)."""
    from clover_export.runtime.decoding import speculative
    from clover_export.train import tasks

    gen = Generator.load(tiny_dir, "torch", dtype="fp32", max_slots=8)
    by_hand, kept, checked, current = {}, {}, [], []
    real_accept = speculative.accept_sampled

    def observe(plan, logits):  # the step's raw block logits, before any control
        current[:] = [req for req, row in zip(plan.requests, plan.rows) if row.logit_rows and req.params.do_sample]
        for req, row, l in zip(plan.requests, plan.rows, logits):
            if req.decoding == "self_spec" and row.block is not None:
                by_hand[req.request_id] = block_q_by_hand(l, req.response + req.state.draft, gen.mask_id)

    def drafted(plan, outputs):  # after this step's verification: what the next step verifies
        for req, row, out in zip(plan.requests, plan.rows, outputs):
            if req.decoding == "self_spec" and row.block is not None:
                kept[req.request_id] = (by_hand[req.request_id][1:], out.tokens[1:])

    def accept(p, q, draft, generator):
        req = current.pop(0)  # called for the sampling verifying rows in row order
        if len(draft):
            q_then, tokens_then = kept[req.request_id]
            D = len(draft)
            checked.append((torch.allclose(q.double(), q_then[:D], rtol=1e-4, atol=1e-6),
                            draft.tolist() == tokens_then[:D]))
        return real_accept(p, q, draft, generator)

    gen.runner.observer, gen.loop.on_step = observe, drafted
    monkeypatch.setattr(speculative, "accept_sampled", accept)
    gen.wait([gen.submit(ex.prompt, decoding="self_spec", do_sample=True, seed=i, max_new_tokens=32,
                         enable_thinking=False, draft_threshold=0.0, **SPEC_SAMPLING)
              for i, ex in enumerate(tasks.heldout_examples(8))])  # short answers: about one draft each
    assert len(checked) >= 4 and all(same_q and same_tokens for same_q, same_tokens in checked), checked


def sampled_continuations(gen, mode: str, runs: int, **params) -> Counter:
    """Tokens 2 and 3 of `runs` seeded sampling runs of a short continuation (the first token is always
    the AR model's own draw; the ones after it are what a draft can carry)."""
    handles = [gen.submit("hello", decoding=mode, do_sample=True, seed=s, max_new_tokens=4, enable_thinking=False,
                          ignore_eos=True, **params) for s in range(runs)]
    return Counter(tuple(r.token_ids[1:3]) for r in gen.wait(handles))


def _same_distribution(a: Counter, b: Counter) -> float:
    """p-value of a chi-square test that two samples come from one distribution (rare outcomes merged)."""
    from scipy.stats import chi2_contingency

    common = [t for t in set(a) | set(b) if a[t] + b[t] >= 10]
    rows = [[a[t] for t in common] + [sum(a.values()) - sum(a[t] for t in common)],
            [b[t] for t in common] + [sum(b.values()) - sum(b[t] for t in common)]]
    if rows[0][-1] + rows[1][-1] == 0:
        rows = [r[:-1] for r in rows]
    return chi2_contingency(rows).pvalue


def test_self_spec_sampling_is_distributed_as_ar_sampling(tiny_dir, monkeypatch):
    """On the embedded default, 600 seeded runs a mode at temperature 1 with every block position drafted
    (a prompt outside its tasks, where the block's q and the causal p differ): tokens 2-3 under self_spec
    follow ar's distribution (chi-square); accepting every draft token instead is detected."""
    from clover_export.runtime.decoding import speculative

    gen = Generator.load(tiny_dir, "torch", dtype="fp32", max_slots=16)
    params = dict(temperature=1.0, draft_threshold=0.0)
    ar = sampled_continuations(gen, "ar", 600, **params)
    spec = sampled_continuations(gen, "self_spec", 600, **params)
    monkeypatch.setattr(speculative, "accept_sampled", accept_every_draft_token)
    mutated = sampled_continuations(gen, "self_spec", 600, **params)
    assert _same_distribution(ar, spec) > 1e-3, (ar.most_common(4), spec.most_common(4))
    assert _same_distribution(ar, mutated) < 1e-4, (ar.most_common(4), mutated.most_common(4))


# --- every backend, and the prefix cache ---------------------------------------------------------
MODES_PROMPTS = ["Sort: 7 3 9 1 4", "Reverse: 4 5 6 1"]


def _ar_case(gen, max_new_tokens: int = 24) -> list[list[int]]:
    params = dict(max_new_tokens=max_new_tokens, draft_threshold=0.0, enable_thinking=False, ignore_eos=True)
    return [r.token_ids for r in gen.wait([gen.submit(p, decoding="ar", **params) for p in MODES_PROMPTS])]


def _spec_case(gen, max_new_tokens: int = 24) -> dict:
    """self_spec (every position drafted: rejections and rollbacks) beside low_confidence. `ignore_eos`: past
    the answer's end token the drafts meet text the model was never trained on, where they are rejected (a
    draft stops at an end token otherwise)."""
    params = dict(max_new_tokens=max_new_tokens, draft_threshold=0.0, enable_thinking=False, ignore_eos=True)
    modes = ["self_spec", "low_confidence", "self_spec"]
    handles = [gen.submit(p, decoding=m, **params) for p, m in zip(MODES_PROMPTS + MODES_PROMPTS[1:], modes)]
    spec = gen.wait(handles)
    return {"spec": [spec[0].token_ids, spec[2].token_ids],
            "drafted": sum(h.request.drafted_tokens for h in handles),
            "accepted": sum(h.request.accepted_tokens for h in handles)}


def test_self_spec_equals_ar_on_onnx_runtime():
    gen = Generator.load(None, backend="ort", max_slots=3)
    r = _spec_case(gen)
    assert r["spec"] == _ar_case(gen)
    assert r["drafted"] > r["accepted"] > 0


TRITON_CHILD = """
import json
from clover_export.runtime import Generator
import tests.runtime.test_lossless as t
gen = Generator.load(None, backend="triton", device="cpu", dtype="fp32", max_slots=3, prefill_chunk=64)
print("RESULT " + json.dumps(t._spec_case(gen, max_new_tokens=10)))
"""


@pytest.mark.slow
def test_self_spec_equals_ar_on_the_triton_kernels():
    """The Triton kernels (TRITON_INTERPRET=1 on the CPU, in a child process: the interpreter is global)
    against ar on the torch backend (fp32 both)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(root))
    proc = subprocess.run([sys.executable, "-c", TRITON_CHILD], env=env, capture_output=True, text=True,
                          timeout=1200, cwd=root)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    assert line, proc.stderr[-3000:]
    r = json.loads(line[len("RESULT "):])
    ar = _ar_case(Generator.load(None, backend="torch", dtype="fp32", max_slots=3), max_new_tokens=10)
    assert r["spec"] == ar
    assert r["drafted"] > 0


def test_self_spec_turns_with_the_prefix_cache_equal_ar_without_it(tiny_dir):
    """A conversation's turns and a shared system prompt: self_spec with the prefix cache on gives ar's
    tokens computed with it off (a slot holds (prompt + response)[:past_len] at every step boundary)."""
    outs = {}
    for mode, cache in (("ar", False), ("self_spec", True)):
        gen = Generator.load(tiny_dir, "torch", dtype="fp32", max_slots=2, prefix_cache=cache)
        messages = [{"role": "system", "content": "You sort and reverse lists."}]
        got = []
        for user in ("Sort: 3 1 2", "Reverse: 9 8 7 6", "Sort: 5 5 1 0 2"):
            messages.append({"role": "user", "content": user})
            r = gen.generate(messages=messages, decoding=mode, enable_thinking=False, max_new_tokens=32,
                             draft_threshold=0.2)
            messages.append({"role": "assistant", "content": r.text})
            got.append((r.token_ids, r.cached_tokens))
        outs[mode] = got
    assert [t for t, _ in outs["self_spec"]] == [t for t, _ in outs["ar"]]
    assert outs["self_spec"][2][1] > 0  # later turns resumed from the cache
