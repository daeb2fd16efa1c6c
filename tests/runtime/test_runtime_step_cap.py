"""The runtime's own guards on a request's life: the per-block step cap and cancellation at the next step
(DECODING.md 2 step 6: every denoise step fills at least one masked position; SERVING.md 3)."""

from __future__ import annotations

import pytest
import torch

from clover_export.backends.torch_backend import TorchBackend
from clover_export.model.loading import load_model
from clover_export.runtime.generator import Generator

# threshold 1.0: no confidence is above it, so exactly one position fills per step (the most confident):
# every block takes exactly block_size steps, the most a legitimate block can take
ONE_PER_STEP = dict(raw=True, threshold=1.0)
SORT = "Please sort the list 3 1 2 4 9"  # no end token within 64 tokens


@pytest.fixture(scope="module")
def model(tiny_dir):
    return load_model(tiny_dir, dtype=torch.float32)


def make(model, tiny_dir, **kw) -> Generator:
    kw.setdefault("max_slots", 2)
    return Generator(TorchBackend(model, tiny_dir), tiny_dir, **kw)


def step_until_done(gen, handles, limit):
    for _ in range(limit):
        if all(h.done for h in handles):
            return
        gen.step()
    raise AssertionError(f"not done after {limit} steps")


@pytest.mark.parametrize("fold_commit", [True, False])
def test_a_block_may_take_exactly_block_size_steps(model, tiny_dir, fold_commit):
    gen = make(model, tiny_dir, fold_commit=fold_commit)
    res = gen.generate(SORT, max_new_tokens=64, **ONE_PER_STEP)
    assert (res.finish_reason, res.blocks, res.denoise_steps) == ("length", 2, 2 * gen.block_size)


def test_a_block_that_never_resolves_fails_alone_after_block_size_steps(model, tiny_dir, monkeypatch):
    """An infinite temperature in the fp32 parameter table (a bug: the settings refuse one) makes every
    sampled token the mask token, so the row fills nothing and would hold its slot forever. The cap fails it
    after block_size steps; the request beside it gets its single-request answer; both slots are free
    afterwards."""
    from clover_export.runtime import controls, runner

    def corrupted(settings):  # the sampling request's row, as an unchecked path could write it
        row = controls.param_row(settings)
        if settings.do_sample:
            row[controls.COLUMNS.index("temperature")] = float("inf")
        return row

    monkeypatch.setattr(runner, "param_row", corrupted)
    expected = make(model, tiny_dir).generate(SORT, max_new_tokens=64, **ONE_PER_STEP)
    gen = make(model, tiny_dir)
    stuck = gen.submit("Hi", raw=True, max_new_tokens=8, do_sample=True, temperature=2.0, seed=1)
    good = gen.submit(SORT, max_new_tokens=64, **ONE_PER_STEP)
    step_until_done(gen, [stuck], gen.block_size + 1)
    assert stuck.request.denoise_steps == gen.block_size and stuck.result.response_tokens == 0
    assert stuck.result.finish_reason == "error" and "StepCapExceeded" in stuck.result.error
    assert f"within {gen.block_size} denoise steps" in stuck.result.error
    step_until_done(gen, [good], 200)
    assert good.result.token_ids == expected.token_ids
    assert sorted(gen.loop.scheduler.free_slots) == [0, 1] and not gen.loop.has_work()


def test_cancel_between_two_steps_of_a_block_frees_the_slot_for_the_next_step(model, tiny_dir):
    """Cancelled in the middle of a block, the row is not in the next step; a waiting request takes its
    slot in that very step and answers as it would alone."""
    expected = make(model, tiny_dir).generate("The answer is", raw=True, max_new_tokens=12)
    gen = make(model, tiny_dir, max_slots=1)
    rows = []
    gen.runner.observer = lambda plan, logits: rows.append([r.request_id for r in plan.requests])
    long = gen.submit(SORT, max_new_tokens=64, **ONE_PER_STEP)
    for _ in range(5):
        gen.step()
    assert 0 < long.request.state.steps < gen.block_size  # mid-block
    waiting = gen.submit("The answer is", raw=True, max_new_tokens=12)
    long.cancel()
    assert long.result.finish_reason == "cancelled" and gen.loop.scheduler.free_slots == [0]
    seen = len(rows)
    gen.step()
    assert rows[seen] == [waiting.request_id]
    step_until_done(gen, [waiting], 100)
    assert waiting.result.token_ids == expected.token_ids
