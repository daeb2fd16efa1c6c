"""The scheduler and request record: plain Python, exact step layouts (STEP_GRAPH.md 1; DECODING.md 1)."""

from __future__ import annotations

import subprocess
import sys

from clover_export.runtime.decoding.base import RowOutput
from clover_export.runtime.decoding.low_confidence import block_resolved, new_block, take_block
from clover_export.runtime.request import Phase, Request
from clover_export.runtime.scheduler import PAD_ID, Scheduler

M = 99  # mask id
N = 4


def outputs(blocks, coreset):
    """What a runner's step would hand back: each row's block tokens and mean coreset size."""
    return [RowOutput(block=b, coreset=c) for b, c in zip(blocks, coreset)]


def req(prompt, max_new=8, ends=(1,), alignment="prompt_end"):
    return Request(list(prompt), max_new, frozenset(ends), N, M, alignment)


def test_scheduler_imports_without_tensor_libraries():
    code = ("import sys; sys.modules['torch'] = None; sys.modules['numpy'] = None\n"
            "import clover_export.runtime.scheduler, clover_export.runtime.request\n"
            "import clover_export.runtime\n")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_prefill_chunks_fold_into_first_block_and_rows_are_left_aligned():
    s = Scheduler(num_slots=2, block_size=N, prefill_chunk=3)
    a, b = req([10, 11, 12, 13, 14]), req([20, 21])
    s.add(a)
    s.add(b)
    assert s.admit() == [a, b] and (a.slot, b.slot) == (0, 1)
    p = s.schedule()
    assert p.causal_rows == 3 and p.width == 7
    assert p.input_ids == [10, 11, 12, M, M, M, M, 20, 21, PAD_ID, M, M, M, M]
    assert (p.n_causal, p.has_block, p.slot_ids, p.past_len) == ([3, 2], [0, 1], [0, 1], [0, 0])
    s.update(p, outputs([[M] * 4, [7, M, M, M]], [0.0, 3.0]))
    assert a.phase is Phase.PREFILL and b.phase is Phase.DENOISE and b.past_len == 2
    p = s.schedule()
    assert p.causal_rows == 2
    assert p.input_ids == [13, 14, M, M, M, M, PAD_ID, PAD_ID, 7, M, M, M]
    assert (p.n_causal, p.has_block, p.past_len) == ([2, 0], [1, 1], [3, 2])
    done = s.update(p, outputs([[M, M, 5, M], [7, 8, 9, 6]], [2.0, 3.0]))
    assert done == [b] and b.response == [7, 8, 9, 6]
    p = s.schedule()  # b's commit folded into its next block's first denoise step
    assert p.input_ids == [PAD_ID] * 4 + [M, M, 5, M] + [7, 8, 9, 6] + [M] * 4
    assert (p.causal_rows, p.n_causal, p.past_len, p.response_base) == (4, [0, 4], [5, 2], [0, 4])
    s.update(p, outputs([[M, M, 5, M], [M] * 4], [0.0, 0.0]))
    assert b.past_len == 6 and b.state.pending_commit == []
    assert b.denoise_steps == 3 and b.coreset_sum == 6.0


def test_commit_without_folding_is_its_own_step():
    s = Scheduler(num_slots=1, block_size=N, prefill_chunk=8, fold_commit=False)
    r = req([10, 11])
    s.add(r)
    s.admit()
    p = s.schedule()
    assert (p.n_causal, p.has_block) == ([2], [0])  # prefill alone
    s.update(p, outputs([[M] * 4], [0.0]))
    p = s.schedule()
    assert (p.causal_rows, p.has_block) == (0, [1])
    s.update(p, outputs([[3, 4, 5, 6]], [1.0]))
    p = s.schedule()
    assert p.input_ids == [3, 4, 5, 6, M, M, M, M] and (p.n_causal, p.has_block) == ([4], [0])
    s.update(p, outputs([[M] * 4], [0.0]))
    assert r.unfolded_commits == 1 and r.past_len == 6 and r.phase is Phase.DENOISE


def test_absolute_alignment_puts_the_prompt_tail_in_the_first_block():
    s = Scheduler(num_slots=1, block_size=N, prefill_chunk=8)
    r = req([10, 11, 12, 13, 14, 15], alignment="absolute")
    s.add(r)
    s.admit()
    p = s.schedule()
    assert p.input_ids == [10, 11, 12, 13, 14, 15, M, M]
    assert (p.n_causal, p.past_len, p.response_base) == ([4], [0], [-2])
    s.update(p, outputs([[14, 15, 7, 8]], [0.0]))
    assert r.response == [7, 8]  # the tail is prompt, not response
    p = s.schedule()
    assert p.input_ids == [14, 15, 7, 8, M, M, M, M] and p.past_len == [4] and p.response_base == [2]
    short = req([10, 11], alignment="absolute")  # shorter than a block: no causal prefill at all
    s2 = Scheduler(num_slots=1, block_size=N)
    s2.add(short)
    s2.admit()
    p = s2.schedule()
    assert p.causal_rows == 0 and p.input_ids == [10, 11, M, M]


def test_end_token_early_stop_and_max_new_tokens():
    r = req([10], max_new=8, ends=(1,))
    new_block(r)
    r.state.block = [5, 1, M, M]
    assert block_resolved(r, early_stop=True) and not block_resolved(r, early_stop=False)
    r.state.block = [M, 1, 5, 5]
    assert not block_resolved(r, early_stop=True)  # a position before the end token is still masked
    r.state.block = [5, 1, 6, 7]
    assert take_block(r) and r.response == [5, 1] and r.finish_reason == "stop"
    r = req([10], max_new=6)
    new_block(r)
    r.state.block = [5, 6, 7, 8]
    assert not take_block(r)
    new_block(r)
    r.state.block = [9, 9, 9, 9]
    assert take_block(r) and r.response == [5, 6, 7, 8, 9, 9] and r.finish_reason == "length"


def test_finish_frees_the_slot_for_a_waiting_request():
    s = Scheduler(num_slots=1, block_size=N)
    a, b = req([1, 2]), req([3, 4])
    s.add(a)
    s.add(b)
    assert s.admit() == [a]
    assert s.admit() == []
    s.finish(a, "cancelled")
    assert a.finish_reason == "cancelled" and s.running == []
    assert s.admit() == [b] and b.slot == a.slot


def test_fixed_engine_profiles_pad_cap_and_rotate():
    """TensorRT-style profiles: decode (C = N, up to 2 rows) and prefill (C = 8, one row)."""
    from clover_export.backends import StepShape

    s = Scheduler(num_slots=3, block_size=N, prefill_chunk=16,
                  shapes=[StepShape(N, N, 2), StepShape(8, 8, 1)])
    a = req(list(range(10, 30)))
    s.add(a)
    s.admit()
    p = s.schedule()
    assert p.causal_rows == 8 and p.n_causal == [8]  # alone: the prefill profile, chunk capped at 8
    s.update(p, outputs([[M] * 4], [0.0]))
    b, c = req([1, 2]), req([3, 4])
    s.add(b)
    s.add(c)
    s.admit()
    seen = []
    for _ in range(3):
        p = s.schedule()
        assert p.batch == 2 and p.causal_rows == N  # at most 2 rows; C padded/capped to the decode profile
        seen.append([r.request_id for r in p.requests])
        s.update(p, outputs([r.state.block or [M] * 4 for r in p.requests], [0.0] * 2))
    assert {i for ids in seen for i in ids} == {a.request_id, b.request_id, c.request_id}  # everyone gets a turn
    assert a.prefill_pos == 8 + 4 * sum(a.request_id in ids for ids in seen)
