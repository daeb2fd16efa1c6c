"""Prefix reuse across requests (runtime/prefix_cache.py, docs/prefix_cache.md).

The reference is the same runtime with the cache off, each prompt run alone:
with greedy decoding every response must be token for token the same with
the cache on (DECODING.md 4 allows floating-point noise between batch
compositions; the embedded default's margins are clear). How much is reused
is checked against the rows the runner was actually given: the causal rows
of each request's prefill steps, seen through the runner's observer.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import weakref
from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from clover_export.runtime.prefix_cache import HASH_RUN, PrefixCache, TokenRun
from clover_export.runtime.request import Phase, Request

SYSTEM = ("You are a careful assistant. Sort lists, reverse words and add small numbers. Answer with the result "
          "only, no explanation, and keep every answer on one line. ")


# ----------------------------------------------------------------------------- helpers
def make(backend, **kw):
    from clover_export.runtime import Generator

    kw.setdefault("prefill_chunk", 16)
    return Generator(backend, backend.source_dir, **kw)


class Rows:
    """Prompt rows each request computed: the causal rows of its prefill steps (the runner's observer)."""

    def __init__(self, gen):
        self.by_id: Counter = Counter()
        gen.runner.observer = self

    def __call__(self, plan, logits):
        for r, req in enumerate(plan.requests):
            if req.phase is Phase.PREFILL:
                self.by_id[req.request_id] += plan.n_causal[r]

    def of(self, res) -> int:
        return self.by_id[res.request_id]


class Reference:
    """Cache off, one request at a time (memoised): what every request must return."""

    def __init__(self, backend):
        self.gen = make(backend, prefix_cache=False, max_slots=1)
        self.memo: dict = {}

    def tokens(self, ids, **kw) -> list[int]:
        key = (tuple(ids), tuple(sorted(kw.items())))
        if key not in self.memo:
            self.memo[key] = self.gen.generate(prompt_ids=list(ids), **kw).token_ids
        return self.memo[key]


def snapshot_bytes(gen) -> int:
    return gen.runner.states.save(0)[1]


@pytest.fixture(scope="module")
def backend(tiny_dir):
    from clover_export.backends.torch_backend import TorchBackend

    return TorchBackend.load(None, device="cpu", dtype="fp32")


@pytest.fixture(scope="module")
def shifted(tmp_path_factory):
    """A random fp32 tiny model with logits_shift (MODEL.md 5.1): resuming needs the kept last row."""
    import torch

    from clover_export.backends.torch_backend import TorchBackend
    from clover_export.tiny import generate_random_tiny

    folder = generate_random_tiny(tmp_path_factory.mktemp("shift") / "model", seed=2, dtype=torch.float32,
                                  logits_shift=True)
    be = TorchBackend.load(folder, device="cpu", dtype="fp32")
    assert be.cfg.logits_shift
    return be


@pytest.fixture(scope="module")
def reference(backend):
    return Reference(backend)


def chat(gen, messages):
    return gen.prompt_ids(messages=messages, enable_thinking=False)


# ------------------------------------------------------------------ the index, plain Python
@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 3), max_size=300), st.lists(st.integers(0, 3), max_size=300), st.booleans())
def test_common_prefix_is_exact_even_when_hashes_collide(a, b, collide):
    x, y = TokenRun(a), TokenRun(b)
    if collide:  # every run hash equal: the tokens decide
        x.hashes = [0] * len(x.hashes)
        y.hashes = [0] * len(y.hashes)
    want = next((i for i, (p, q) in enumerate(zip(a, b)) if p != q), min(len(a), len(b)))
    assert x.common_prefix(y) == want == y.common_prefix(x)
    x.truncate(len(a) // 2)
    assert x.tokens == a[:len(a) // 2] and len(x.hashes) == len(a) // 2 // HASH_RUN


class FakeDevice:
    def __init__(self, nbytes=100):
        self.nbytes, self.saved = nbytes, []

    def save(self, slot):
        self.saved.append(slot)
        return object(), self.nbytes


def test_chunk_snapshots_stay_few_and_spread_and_the_budget_holds():
    cache = PrefixCache(FakeDevice(), budget_bytes=10_000, block_size=4, points_per_sequence=4)
    r = Request(list(range(10, 110)), 8, frozenset({1}), 4, 99)
    assert cache.place(r, [0], [])
    r.phase = Phase.PREFILL
    for _ in range(10):  # ten prefill chunks of 10
        r.past_len += 10
        cache.advanced(r, 10, prefill=True)
    points = sorted(cache.entries[0].points)
    kinds = {p: s.kind for p, s in cache.entries[0].points.items()}
    chunks = [p for p in points if kinds[p] == "chunk"]
    assert kinds[100] == "prompt" and chunks == [20, 40, 60, 90]  # spread over the prompt, the newest kept
    tight = PrefixCache(FakeDevice(), budget_bytes=250, block_size=4)
    for slot in range(4):  # four sequences, one prompt-end snapshot each, room for two
        q = Request([slot + 10] * 8, 8, frozenset({1}), 4, 99)
        assert tight.place(q, [slot], [])
        q.phase, q.past_len = Phase.PREFILL, 8
        tight.advanced(q, 8, prefill=True)
        assert tight.snapshot_bytes <= 250
    assert sorted(s.holders.pop() for s in tight.snaps) == [2, 3]  # the least recently used went first


# ------------------------------------------------------------------ identity and reuse, torch
@pytest.mark.parametrize("which", ["tiny", "shifted"])
def test_turns_of_a_conversation_compute_only_new_tokens_and_one_block(which, backend, shifted, reference):
    be = backend if which == "tiny" else shifted
    ref = reference if which == "tiny" else Reference(shifted)
    gen = make(be, max_slots=2)
    rows, N = Rows(gen), gen.block_size
    kw = dict(max_new_tokens=(2 if which == "tiny" else 1) * N + 5, ignore_eos=True, threshold=0.5)
    prompt = chat(gen, [{"role": "user", "content": "sort 3 1 2"}])
    history = []
    for turn in range(4 if which == "tiny" else 3):
        res = gen.generate(prompt_ids=prompt, **kw)
        assert res.token_ids == ref.tokens(prompt, **kw), f"turn {turn}"
        assert rows.of(res) == res.prompt_tokens - res.cached_tokens
        if history:
            before = history[-1]
            committed = len(before.token_ids) // N * N if len(before.token_ids) % N else len(before.token_ids) - N
            assert res.cached_tokens == before.prompt_tokens + committed  # the whole parked sequence
            assert rows.of(res) <= len(prompt) - len(before.prompt_ids) - len(before.token_ids) + N
        history.append(res)
        prompt = prompt + res.token_ids + chat(gen, [{"role": "user", "content": f"and {turn} more"}])


def test_a_chat_resent_through_the_template_computes_its_new_tokens_and_at_most_a_block(backend, reference):
    """The template renders an earlier answer its own way (no empty think block after the assistant header): the
    next turn agrees with the previous prompt + answer only up to there, and resumes within a block of it."""
    gen = make(backend, prefill_chunk=256)  # the default: prompts of one chunk
    rows, N = Rows(gen), gen.block_size
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "reverse the word stone"}]
    before = previous_prompt = None
    for turn in range(4):
        ids = chat(gen, messages)
        res = gen.generate(prompt_ids=ids, max_new_tokens=40)
        assert res.token_ids == reference.tokens(ids, max_new_tokens=40)
        assert rows.of(res) == len(ids) - res.cached_tokens
        if before is not None:
            common = TokenRun(ids).common_prefix(TokenRun(before))
            assert common < len(previous_prompt)  # it does not reach the previous prompt's end
            assert rows.of(res) <= len(ids) - common + N
        before, previous_prompt = ids + res.token_ids, ids
        messages += [{"role": "assistant", "content": res.content}, {"role": "user", "content": f"now {turn} + 2"}]


def test_sixteen_requests_sharing_a_system_prompt_compute_it_once(backend, reference):
    gen = make(backend, max_slots=4)
    rows = Rows(gen)
    prompts = [chat(gen, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"add {i} and {i + 3}"}])
               for i in range(16)]
    shared = min(TokenRun(prompts[0]).common_prefix(TokenRun(p)) for p in prompts[1:])
    assert shared > 2 * gen.block_size  # a real system prompt, a few blocks long
    handles = [gen.submit(prompt_ids=p, max_new_tokens=24) for p in prompts]
    results = gen.wait(handles)
    for p, res in zip(prompts, results):
        assert res.token_ids == reference.tokens(p, max_new_tokens=24)
    assert sum(rows.of(r) for r in results) == shared + sum(len(p) - shared for p in prompts)
    assert sorted(r.cached_tokens for r in results) == [0] + [shared] * 15


@pytest.mark.parametrize("which", ["tiny", "shifted"])
def test_identical_prompts_hit_together_and_later(which, backend, shifted, reference):
    be = backend if which == "tiny" else shifted
    ref = reference if which == "tiny" else Reference(shifted)
    gen = make(be, max_slots=3)
    rows = Rows(gen)
    short = chat(gen, [{"role": "user", "content": "sort 9 4"}])  # shorter than one chunk of 256 as well
    long = chat(gen, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "sort 9 4"}])
    for prompt in (short, long):
        kw = dict(max_new_tokens=30, threshold=0.5)
        together = gen.wait([gen.submit(prompt_ids=prompt, **kw) for _ in range(2)])
        later = gen.generate(prompt_ids=prompt, **kw)
        for res in together + [later]:
            assert res.token_ids == ref.tokens(prompt, **kw)
        assert [r.cached_tokens for r in together + [later]] == [0, len(prompt), len(prompt)]
        assert [rows.of(r) for r in together + [later]] == [len(prompt), 0, 0]


def test_a_prompt_diverging_inside_a_block_resumes_at_a_point_before_it(backend, reference):
    gen = make(backend, max_slots=2)
    N = gen.block_size
    kw = dict(max_new_tokens=3 * N, ignore_eos=True, threshold=0.5)
    prompt = chat(gen, [{"role": "user", "content": "reverse 1 2 3 4"}])
    first = gen.generate(prompt_ids=prompt, **kw)
    for cut in (N + N // 2, N + 1, 2 * N - 1):  # inside the second (committed) block
        edited = prompt + first.token_ids[:cut] + [first.token_ids[cut] + 1 if first.token_ids[cut] < 400 else 7]
        res = gen.generate(prompt_ids=edited, **kw)
        assert res.token_ids == reference.tokens(edited, **kw)
        assert len(prompt) <= res.cached_tokens <= len(prompt) + cut  # never past where it diverges


def test_a_short_prompt_hits_at_block_granularity(backend, reference):
    gen = make(backend, prefill_chunk=256)
    N = gen.block_size
    kw = dict(max_new_tokens=2 * N + 3, ignore_eos=True, threshold=0.5)
    prompt = chat(gen, [{"role": "user", "content": "hi"}])
    assert len(prompt) < 256
    first = gen.generate(prompt_ids=prompt, **kw)
    turn2 = prompt + first.token_ids + chat(gen, [{"role": "user", "content": "again"}])
    res = gen.generate(prompt_ids=turn2, **kw)
    assert res.token_ids == reference.tokens(turn2, **kw)
    assert res.cached_tokens == len(prompt) + 2 * N  # the two committed blocks of the first answer


def test_eviction_keeps_answers_and_frees_slots_for_new_requests(backend, reference):
    gen = make(backend, max_slots=2)
    prompts = [chat(gen, [{"role": "user", "content": f"sort {i} {i + 5} 2"}]) for i in range(5)]
    for round_ in range(2):
        for p in prompts + prompts[:1]:
            res = gen.generate(prompt_ids=p, max_new_tokens=20)
            assert res.token_ids == reference.tokens(p, max_new_tokens=20)
    # two slots, both parked: a batch of two new requests evicts both and runs at once
    batch = [chat(gen, [{"role": "user", "content": f"add {i} 1"}]) for i in range(2)]
    handles = [gen.submit(prompt_ids=p, max_new_tokens=20) for p in batch]
    gen.step()
    assert all(h.request.slot is not None for h in handles)
    assert [r.token_ids for r in gen.wait(handles)] == [reference.tokens(p, max_new_tokens=20) for p in batch]


def distinct_prompts(count: int, length: int, seed: int) -> list[list[int]]:
    """Token-id prompts with pairwise different first tokens (no common prefix), no special token."""
    rng = random.Random(seed)
    return [[first] + [rng.randrange(10, 400) for _ in range(length - 1)]
            for first in rng.sample(range(10, 400), count)]


def test_a_new_request_evicts_the_least_recently_used_parked_sequence(backend):
    """Two slots: A then B finish (parked), C evicts A's slot (the older one); B's prompt again takes its
    slot over whole, A's finds nothing. Hand-computed reuse: [0, 0, 0, len(B), 0]."""
    gen = make(backend, max_slots=2)
    a, b, c = distinct_prompts(3, 20, seed=5)
    cached = [gen.generate(prompt_ids=p, max_new_tokens=4).cached_tokens for p in (a, b, c, b, a)]
    assert cached == [0, 0, 0, len(b), 0]


def test_a_common_prefix_ending_inside_a_prefill_chunk_becomes_a_point(backend, reference):
    """Prefill chunks of 64, prompts of 150 sharing their first 110 tokens (inside the second chunk, 46 tokens
    past the chunk end at 64: more than a block).
    - One after another: Y resumes at X's chunk end (64) and cuts its own prefill at 110, so Z resumes at 110.
    - Together: Y waits for X, whose prefill is cut at 110, and resumes there.
    Hand-computed reuse: [0, 64, 110] and [0, 110]."""
    gen = make(backend, max_slots=3, prefill_chunk=64)
    assert 110 - 64 >= gen.block_size
    shared = distinct_prompts(1, 110, seed=6)[0]
    x, y, z = [shared + tail for tail in distinct_prompts(3, 40, seed=7)]
    kw = dict(max_new_tokens=4)
    assert [gen.generate(prompt_ids=p, **kw).cached_tokens for p in (x, y, z)] == [0, 64, 110]
    gen = make(backend, max_slots=3, prefill_chunk=64)
    together = gen.wait([gen.submit(prompt_ids=p, **kw) for p in (x, y)])
    assert [r.cached_tokens for r in together] == [0, 110]
    assert [r.token_ids for r in together] == [reference.tokens(p, **kw) for p in (x, y)]


def test_snapshot_memory_never_exceeds_the_budget(backend):
    gen = make(backend, max_slots=3, prefill_chunk=8)
    budget = 5 * snapshot_bytes(gen)
    gen = make(backend, max_slots=3, prefill_chunk=8, prefix_cache=budget / 2**30)
    alive: list = []  # every saved state, weakly: what the process still holds
    save = gen.runner.states.save

    def tracked(slot):
        saved, nbytes = save(slot)
        alive.append((weakref.ref(next(iter(saved.tensors.values()))), nbytes))
        return saved, nbytes

    gen.runner.states.save = tracked
    rng = random.Random(0)
    handles, peak = [], 0
    for i in range(24):
        handles.append(gen.submit(prompt_ids=[rng.randrange(10, 400) for _ in range(rng.randrange(20, 60))],
                                  max_new_tokens=8))
        for _ in range(3):
            gen.step()
            held = sum(n for ref, n in alive if ref() is not None)
            assert held <= budget and held == gen.prefix_cache.snapshot_bytes
            peak = max(peak, held)
    gen.wait(handles)
    assert len(alive) > 24 and peak == budget  # it saved far more than it kept, and filled the budget


def test_off_means_every_prompt_row_is_computed(backend):
    gen = make(backend, prefix_cache=False)
    rows = Rows(gen)
    prompt = chat(gen, [{"role": "user", "content": "sort 3 1 2"}])
    a, b = gen.generate(prompt_ids=prompt, max_new_tokens=8), gen.generate(prompt_ids=prompt, max_new_tokens=8)
    assert (a.cached_tokens, b.cached_tokens, rows.of(b)) == (0, 0, len(prompt))
    assert gen.loop.scheduler.cache is None and b.to_dict()["cached_tokens"] == 0


# ------------------------------------------------------------------ random conversation trees
@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                HealthCheck.function_scoped_fixture])
@given(st.data())
def test_random_conversation_trees_and_eviction_orders(backend, reference, data):
    snap = snapshot_bytes(make(backend, max_slots=1))
    gen = make(backend, max_slots=data.draw(st.integers(1, 3), label="slots"),
               prefill_chunk=data.draw(st.sampled_from([8, 16, 64]), label="chunk"),
               prefix_cache=data.draw(st.sampled_from([0, 1, 3, 50]), label="snapshots") * snap / 2**30)
    N = gen.block_size
    words = st.lists(st.integers(10, 400), min_size=1, max_size=12)
    done: list[tuple[list[int], list[int]]] = []  # (prompt, response) of finished requests
    for _ in range(data.draw(st.integers(2, 5), label="rounds")):
        prompts = []
        for _ in range(data.draw(st.integers(1, 3), label="batch")):
            kind = data.draw(st.sampled_from(["root", "continue", "fork", "repeat"]) if done else st.just("root"))
            if kind == "root":
                prompts.append(data.draw(st.lists(st.integers(10, 400), min_size=2, max_size=40)))
                continue
            prompt, answer = done[data.draw(st.integers(0, len(done) - 1), label="parent")]
            if kind == "continue":
                prompts.append(prompt + answer + data.draw(words))
            elif kind == "fork":
                whole = prompt + answer
                prompts.append(whole[:data.draw(st.integers(1, len(whole)), label="at")] + data.draw(words))
            else:
                prompts.append(list(prompt))
        kw = dict(max_new_tokens=N + 6, threshold=0.5)
        results = gen.wait([gen.submit(prompt_ids=p, **kw) for p in prompts])
        for p, res in zip(prompts, results):
            assert res.token_ids == reference.tokens(p, **kw)
            done.append((p, res.token_ids))


# ------------------------------------------------------------------ the other backends
def test_ort_backend_gives_the_same_tokens_with_the_cache():
    """A conversation's next turn, a fork and an identical prompt (batched) on the exported graph, on vs off."""
    from clover_export.runtime import Generator

    be = Generator.load(None, backend="ort", max_slots=2, prefill_chunk=16).backend
    N = be.block_size
    kw = dict(max_new_tokens=N + 4, ignore_eos=True, threshold=0.5)
    out = {}
    for on in (False, True):  # one after the other: an ORT backend's pool sets belong to one generator
        gen = Generator(be, be.source_dir, max_slots=2, prefill_chunk=16, prefix_cache=on)
        base = chat(gen, [{"role": "system", "content": SYSTEM[:60]}, {"role": "user", "content": "sort 3 1"}])
        first = gen.generate(prompt_ids=base, **kw)
        prompts = [base + first.token_ids + [30, 31, 32], base[:-6] + [40, 41], list(base)]
        results = [first] + gen.wait([gen.submit(prompt_ids=p, **kw) for p in prompts])
        out[on] = [(r.token_ids, r.cached_tokens) for r in results]
    assert [t for t, _ in out[True]] == [t for t, _ in out[False]]
    assert [c for _, c in out[False]] == [0] * 4
    cached = [c for _, c in out[True]]
    assert cached[0] == 0 and cached[1] == len(base) + N and 0 < cached[2] <= len(base) - 6 and cached[3] == len(base)


def triton_case(prompt: list[int], edited: list[int], chunk: int) -> dict:
    """On the kernels: a chat prompt, then one forked from its snapshot after the prompt's last end of turn
    (K/V rows copied into another slot, GDN states restored); three steps, the interpreter being slow."""
    from clover_export.runtime import Generator

    gen = Generator.load(None, backend="triton", device="cpu", dtype="fp32", max_slots=2, prefill_chunk=chunk)
    a = gen.submit(prompt_ids=prompt, max_new_tokens=8, threshold=0.1)
    a.wait()
    b = gen.submit(prompt_ids=edited, max_new_tokens=8, threshold=0.1)
    b.wait()
    return {"tokens": [a.result.token_ids, b.result.token_ids],
            "cached": [a.result.cached_tokens, b.result.cached_tokens],
            "slots": [a.request.slot, b.request.slot]}


@pytest.mark.slow
def test_triton_backend_gives_the_same_tokens_with_the_cache(backend):
    """The kernels under TRITON_INTERPRET=1 (set before triton is imported: a child process) against the torch
    backend with the cache off (test_runtime_triton.py: the two backends give the same tokens)."""
    import json

    off = make(backend, prefix_cache=False, max_slots=1)
    prompt = chat(off, [{"role": "user", "content": "sort 3 1"}])
    edited, chunk = prompt[:-1] + [prompt[-1] + 1], 64
    turn_end = len(prompt) - prompt[::-1].index(off.tokenizer.im_end_id)  # the point after the last <|im_end|>
    want = [off.generate(prompt_ids=p, max_new_tokens=8, threshold=0.1).token_ids for p in (prompt, edited)]
    env = dict(os.environ, TRITON_INTERPRET="1")
    code = ("import json, sys; sys.path.insert(0, %r); import test_prefix_cache as t; "
            "print('RESULT', json.dumps(t.triton_case(%r, %r, %d)))"
            % (os.path.dirname(__file__), prompt, edited, chunk))
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=1200)
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and line, proc.stderr[-3000:]
    got = json.loads(line[0][7:])
    assert got["tokens"] == want and got["cached"] == [0, turn_end] and got["slots"][0] != got["slots"][1]


# ------------------------------------------------------------------ the server
def test_server_reports_cached_tokens_and_the_cache_figures(tiny_dir):
    import httpx
    from prometheus_client.parser import text_string_to_metric_families
    from test_serve import ThreadServer

    from clover_export.runtime.config import RuntimeConfig
    from clover_export.serve.app import ServeOptions, build_app

    body = {"model": "clover-tiny", "max_tokens": 20,
            "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "sort 3 1 2"}]}
    for on in (True, False):
        with ThreadServer(build_app(ServeOptions(runtime=RuntimeConfig(max_slots=2, prefix_cache=on)))) as srv:
            srv.wait_healthy()
            outs = [httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=120).json() for _ in range(2)]
            streamed = [line for line in httpx.post(
                srv.url + "/v1/chat/completions", timeout=120,
                json={**body, "stream": True, "stream_options": {"include_usage": True}}).text.splitlines()
                if line.startswith("data: {")][-1]
            text = httpx.get(srv.url + "/metrics").text
            cache = srv.app.state.engine.gen.prefix_cache
        figures = {s.name + str(s.labels.get("kind", "")): s.value
                   for fam in text_string_to_metric_families(text) for s in fam.samples}
        prompt = outs[0]["usage"]["prompt_tokens"]
        cached = [o["usage"]["prompt_tokens_details"]["cached_tokens"] for o in outs]
        cached.append(__import__("json").loads(streamed[6:])["usage"]["prompt_tokens_details"]["cached_tokens"])
        assert outs[0]["choices"][0]["message"] == outs[1]["choices"][0]["message"]
        if not on:
            assert cache is None and cached == [0, 0, 0] and figures["clover_prefix_cache_bytessnapshots"] == 0
            continue
        assert cached[0] < prompt and cached[1:] == [prompt, prompt]
        assert figures["clover_prompt_tokens_cached_total"] == sum(cached)
        assert figures["clover_prefix_cache_hit_rate"] == pytest.approx(cache.hit_rate()) and 0 < cache.hit_rate() < 1
        assert figures["clover_prefix_cache_bytessnapshots"] == cache.snapshot_bytes > 0
        assert figures["clover_prefix_cache_bytesparked"] > 0
        assert figures["clover_prefix_cache_budget_bytes"] == 4 * 2**30


def test_serve_command_passes_the_cache_options(monkeypatch):
    from click.testing import CliRunner

    import clover_export.cli.serve as cli

    seen = []
    monkeypatch.setattr(cli, "_check_port", lambda host, port: None)
    monkeypatch.setattr(cli, "_run_uvicorn", lambda opts, *a: seen.append(opts))
    for args, want in (([], True), (["--no-prefix-cache"], False), (["--prefix-cache-gb", "0.5"], 0.5)):
        result = CliRunner().invoke(cli.serve, args)
        assert result.exit_code == 0, result.output
        assert seen[-1].runtime.prefix_cache == want and type(seen[-1].runtime.prefix_cache) is type(want)
    assert CliRunner().invoke(cli.serve, ["--prefix-cache-gb", "-1"]).exit_code == 2
