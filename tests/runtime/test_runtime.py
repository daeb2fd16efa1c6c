"""Runtime API: batching, streaming, stop strings, seeds, cancellation, up-front rejection (DECODING.md 1, 4)."""

from __future__ import annotations

import shutil

import pytest
import torch
from click.testing import CliRunner

from clover_export.backends.torch_backend import TorchBackend
from clover_export.cli import main
from clover_export.core.errors import CloverError
from clover_export.model.loading import load_model
from clover_export.model.tokenizer import ChatTokenizer
from clover_export.runtime.generator import Generator, context_needed

LOGIT_ATOL = 1e-4
PROMPT = "What is 123 + 456?"
# the trained tiny model's answers are short: past its end tokens the responses run over several blocks
LONG = dict(ignore_eos=True, threshold=0.5)


@pytest.fixture(scope="module")
def model(tiny_dir):
    return load_model(tiny_dir, dtype=torch.float32)


def make(model, tiny_dir, **kw) -> Generator:
    kw.setdefault("max_slots", 3)
    return Generator(TorchBackend(model, tiny_dir), tiny_dir, **kw)


def record(gen, layouts: list | None = None) -> dict[int, list[torch.Tensor]]:
    """request_id -> block logits of each of its denoise steps; each step's (n_causal, has_block) to `layouts`."""
    seen: dict[int, list[torch.Tensor]] = {}

    def obs(plan, logits):
        if layouts is not None:
            layouts.append(list(zip(plan.n_causal, plan.has_block)))
        for r, req in enumerate(plan.requests):
            if plan.has_block[r]:
                seen.setdefault(req.request_id, []).append(logits[r].clone())

    gen.runner.observer = obs
    return seen


def test_batch_invariance_across_phases(model, tiny_dir):
    """A request's logits and tokens alone equal those in a batch whose other rows prefill, sample,
    use other parameters, finish and join at other times."""
    params = dict(LONG, max_new_tokens=48, threshold=1.0)
    alone = make(model, tiny_dir, prefill_chunk=16)
    seen_alone = record(alone)
    a1 = alone.submit(PROMPT, **params)
    r_alone = a1.wait()

    gen = make(model, tiny_dir, max_slots=2, prefill_chunk=16)
    layouts: list = []
    seen = record(gen, layouts)
    a = gen.submit(PROMPT, **params)
    for _ in range(3):
        gen.step()
    long_prompt = "Please sort the list 3 1 2 4 9 in ascending order, then reverse the word robot. " * 2
    b = gen.submit(long_prompt, max_new_tokens=40, do_sample=True, seed=5, temperature=0.8, threshold=1.0,
                   eos_token_id=[1])  # prefills in chunks next to a's denoise steps
    c = gen.submit("What is 1 + 2?", max_new_tokens=8, presence_penalty=0.0)  # waits for a slot
    gen.step()
    assert c.request.slot is None
    r_a, r_b, r_c = gen.wait([a, b, c])
    assert c.request.slot in (0, 1)  # took the slot a finished row left

    assert r_a.token_ids == r_alone.token_ids
    mine, ref = seen[a.request_id], seen_alone[a1.request_id]
    assert len(mine) == len(ref) == r_a.denoise_steps
    for i, (x, y) in enumerate(zip(mine, ref)):
        assert torch.allclose(x, y, atol=LOGIT_ATOL, rtol=0), f"step {i}: {(x - y).abs().max():.3g}"
    assert r_b.response_tokens <= 40 and r_c.response_tokens <= 8
    # rows really were in different phases within one step
    assert any((16, 0) in rows and (0, 1) in rows for rows in layouts)  # a prefill chunk next to a plain denoise
    assert any((32, 1) in rows and len(rows) == 2 for rows in layouts)  # a folded commit next to another row


def test_stream_chunks_add_up_to_the_result(model, tiny_dir):
    gen = make(model, tiny_dir)
    chunks = list(gen.stream(PROMPT, max_new_tokens=70, **LONG))
    res = chunks[-1].result
    assert res is not None and all(c.result is None for c in chunks[:-1])
    assert len(chunks) == res.blocks == 3
    assert sum((c.token_ids for c in chunks), []) == res.token_ids
    assert "".join(c.text for c in chunks) == res.text
    assert res.response_tokens == len(res.token_ids) == 70  # cut at max_new_tokens inside the third block
    assert res.tokens_per_forward == pytest.approx(70 / res.denoise_steps)


def test_stop_string_cuts_text_and_ends_the_request(model, tiny_dir):
    gen = make(model, tiny_dir)
    full = gen.generate(PROMPT, max_new_tokens=64, **LONG)
    text = full.text
    stop = next(text[i:i + 3] for i in range(8, len(text) - 3) if text.find(text[i:i + 3]) == i)
    res = gen.generate(PROMPT, max_new_tokens=64, stop=[stop], **LONG)
    assert res.finish_reason == "stop_string"
    assert res.text == text[:text.find(stop)]
    assert full.token_ids[:len(res.token_ids)] == res.token_ids
    kept = gen.tokenizer.decode(res.token_ids)  # ids end before the stop string (DECODING.md 1.5)
    assert stop not in kept and res.text.startswith(kept)


def test_end_token_kept_in_ids_not_in_text(model, tiny_dir):
    gen = make(model, tiny_dir)
    probe = gen.generate(PROMPT, max_new_tokens=40, **LONG)
    ends = next(i for i, t in enumerate(probe.token_ids) if t in gen.defaults.eos_token_id)  # the model's own end
    k = next(i for i in range(5, ends) if probe.token_ids[i] not in probe.token_ids[:i])
    eos = probe.token_ids[k]
    res = gen.generate(PROMPT, max_new_tokens=40, threshold=0.5, eos_token_id=[eos])
    assert res.token_ids == probe.token_ids[:k + 1] and res.finish_reason == "stop"
    assert res.text == gen.tokenizer.decode(probe.token_ids[:k])


def test_seeded_sampling_is_reproducible_and_batch_independent(model, tiny_dir):
    gen = make(model, tiny_dir)
    kw = dict(LONG, max_new_tokens=32, do_sample=True, temperature=3.0, top_k=100, top_p=0.98)
    one = gen.generate(PROMPT, seed=11, **kw).token_ids
    assert gen.generate(PROMPT, seed=11, **kw).token_ids == one
    batch = gen.generate_batch([PROMPT, "What is 2 + 2?"], seed=11, **kw)
    assert batch[0].token_ids == one
    assert gen.generate(PROMPT, seed=12, **kw).token_ids != one


def test_cancel_frees_the_slot(model, tiny_dir):
    gen = make(model, tiny_dir, max_slots=1)
    s = gen.stream(PROMPT, max_new_tokens=200, **LONG)
    first = next(s)
    assert len(first.token_ids) == 32
    waiting = gen.submit("Hi", max_new_tokens=8, **LONG)
    s.cancel()
    assert s.result.finish_reason == "cancelled" and s.result.token_ids == first.token_ids
    assert list(s) == []
    res = waiting.wait()
    assert res.response_tokens == 8 and gen.runner is not None
    assert not gen.loop.has_work()


def test_stream_as_context_manager_cancels_on_exit_and_messages_prompt(model, tiny_dir):
    gen = make(model, tiny_dir, max_slots=1)
    with gen.stream(messages=[{"role": "user", "content": PROMPT}], max_new_tokens=200, **LONG) as s:
        next(s)
    assert s.result.finish_reason == "cancelled"
    assert gen.loop.scheduler.free_slots == [0] and not gen.loop.has_work()
    raw = gen.submit("What is", raw=True, max_new_tokens=4)
    assert raw.request.prompt_ids == gen.tokenizer.encode("What is", add_special_tokens=True)
    raw.cancel()


def test_context_limit_rejects_before_any_compute(model, tiny_dir):
    gen = make(model, tiny_dir, max_context=256)
    calls = []
    step = gen.backend.step
    gen.backend.step = lambda *a: calls.append(1) or step(*a)
    ids = list(range(10, 10 + 100))
    assert context_needed(100, 150, 32, "prompt_end") == 100 + 5 * 32 > 256
    with pytest.raises(CloverError, match="needs 260 positions.*context limit of 256"):
        gen.submit(prompt_ids=ids, max_new_tokens=150)
    assert calls == [] and not gen.loop.has_work()
    with pytest.raises(CloverError, match="needs 257 positions"):
        gen.submit(prompt_ids=ids[:97], max_new_tokens=129)  # 97 + 5 * 32
    ok = gen.submit(prompt_ids=ids[:96], max_new_tokens=129)  # 96 + 160 = 256: fits exactly
    ok.cancel()
    assert calls == []


def test_context_limit_is_the_lower_of_model_and_engine(model, tiny_dir):
    gen = make(model, tiny_dir)
    assert gen.max_context == model.cfg.max_context == 2048
    assert make(model, tiny_dir, max_context=512).max_context == 512
    backend = TorchBackend(model, tiny_dir)
    backend.max_context = 300  # an engine built for less
    assert Generator(backend, tiny_dir).max_context == 300


@pytest.mark.parametrize(
    "params, field",
    [
        (dict(threshold=0.0), "threshold"),
        (dict(threshold=1.5), "threshold"),
        (dict(max_new_tokens=0), "max_new_tokens"),
        (dict(repetition_penalty=-1.0), "repetition_penalty"),
        (dict(presence_penalty=-2.5), "presence_penalty"),
        (dict(frequency_penalty=2.1), "frequency_penalty"),
        (dict(top_p=0.0), "top_p"),
        (dict(temperature=0.0), "temperature"),
        (dict(block_size=16), "block_size"),
        (dict(bogus=1), "bogus"),
    ],
)
def test_invalid_parameters_are_rejected_with_their_name(model, tiny_dir, params, field):
    gen = make(model, tiny_dir)
    with pytest.raises(CloverError, match=field):
        gen.submit("Hello", **params)
    assert not gen.loop.has_work()


def test_prompt_problems_are_rejected(model, tiny_dir):
    gen = make(model, tiny_dir)
    with pytest.raises(CloverError, match="empty"):
        gen.submit(prompt_ids=[])
    with pytest.raises(CloverError, match="outside the vocabulary"):
        gen.submit(prompt_ids=[1, 99999])
    with pytest.raises(CloverError, match="exactly one"):
        gen.submit("a", prompt_ids=[1])


def test_config_gates(model, tiny_dir):
    backend = TorchBackend(model, tiny_dir)  # logits_shift is supported now: tests/runtime/test_logits_shift.py
    backend.cfg = model.cfg.replace(mask_token_id=None)
    with pytest.raises(CloverError, match="mask_token_id"):
        Generator(backend, tiny_dir)


def test_trt_backend_says_tensorrt_is_missing(tiny_dir):
    pytest.importorskip("torch")
    try:
        import tensorrt  # noqa: F401
        pytest.skip("TensorRT is installed here")
    except ImportError:
        pass
    with pytest.raises(CloverError, match="TensorRT is not installed"):
        Generator.load(tiny_dir, backend="trt")


def test_template_reaching_python_internals_is_refused(tiny_dir, tmp_path):
    shutil.copy(tiny_dir / "tokenizer.json", tmp_path / "tokenizer.json")
    (tmp_path / "chat_template.jinja").write_text("{{ ''.__class__.__mro__ }}")
    tok = ChatTokenizer(tmp_path)
    with pytest.raises(CloverError, match="refused"):
        tok.render([{"role": "user", "content": "hi"}])
    (tmp_path / "chat_template.jinja").write_text("{% set m = messages %}{{ m.append(1) }}")
    with pytest.raises(CloverError, match="refused"):
        ChatTokenizer(tmp_path).render([{"role": "user", "content": "hi"}])


def test_chat_template_and_thinking_switch(tiny_dir):
    tok = ChatTokenizer(tiny_dir)
    on = tok.render([{"role": "user", "content": "Hi"}], enable_thinking=True)
    off = tok.render([{"role": "user", "content": "Hi"}], enable_thinking=False)
    assert on == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n"
    assert off == on + "\n</think>\n\n"
    ids = tok.apply_chat_template([{"role": "user", "content": "Hi"}], enable_thinking=False)
    assert tok.think_end_id in ids and tok.decode(ids) == off


def test_cli_generate_json_and_rejection(tiny_dir):
    runner = CliRunner()
    r = runner.invoke(main, ["generate", str(tiny_dir), "--prompt", "Hello", "--prompt", "Hi", "--max-new-tokens", "10",
                             "--no-think", "--dtype", "fp32", "--json"])
    assert r.exit_code == 0, r.output
    import json

    rows = [json.loads(line) for line in r.output.strip().splitlines()]
    assert len(rows) == 2
    for row in rows:
        assert row["response_tokens"] == len(row["token_ids"]) <= 10
        assert row["tokens_per_forward"] == pytest.approx(row["response_tokens"] / row["denoise_steps"])
        for key in ("text", "forwards_per_block", "distinct_experts_per_block", "prompt_tokens", "wall_time_s"):
            assert key in row
    r = runner.invoke(main, ["generate", str(tiny_dir), "--prompt", "Hello", "--max-new-tokens", "5000"])
    assert r.exit_code == 1
    assert r.output.strip().count("\n") == 0 and "context limit" in r.output and "Traceback" not in r.output
