"""Generation controls (DECODING.md 3) against hand-computed logits, order included."""

from __future__ import annotations

import pytest
import torch

from clover_export.core.generation import GenerationSettings
from clover_export.runtime.controls import RowParams, apply_controls_, param_row, ramp, thinking_open

THINK = 2
END = 5
MASK = 6  # the padding id of the counted-token list (never counted)
LOGITS = [2.0, -1.0, 0.5, 3.0, -2.0, 1.0, float("-inf")]


def run(counts, n, think_end_id=THINK, logits=LOGITS, **kw):
    base = dict(repetition_penalty=1.0, frequency_penalty=0.0, presence_penalty=0.0, dllm_length_penalty=0.0,
                dllm_think_end_bias=0.0)
    s = GenerationSettings(**{**base, **kw})
    p = RowParams(torch.tensor([param_row(s)]))
    logits = torch.tensor([[logits] * len(n)])
    end = torch.tensor([[END, -1]])  # one end token, one padding entry
    seen = {t: c for t, c in enumerate(counts) if c > 0}
    ids, cnt = sparse([seen], pad=MASK)
    open_ = torch.tensor([thinking_open(s.enable_thinking, think_end_id, seen)])
    out = apply_controls_(logits, ids, cnt, torch.tensor([n], dtype=torch.float32), p, end, think_end_id, open_)
    return out[0].tolist()


def sparse(rows: list[dict], pad: int):
    """Counted tokens as the runner uploads them: ids and counts padded to the longest row with (pad, 0)."""
    K = max(len(r) for r in rows)
    ids = [list(r) + [pad] * (K - len(r)) for r in rows]
    cnt = [list(r.values()) + [0] * (K - len(r)) for r in rows]
    return torch.tensor(ids, dtype=torch.long).view(len(rows), K), torch.tensor(cnt, dtype=torch.float32).view(
        len(rows), K
    )


def close(a, b):
    return len(a) == len(b) and all(x == pytest.approx(y, abs=1e-6) for x, y in zip(a, b))


def test_repetition_penalty_divides_positive_and_multiplies_negative():
    got = run([1, 1, 0, 0, 3, 0], [0], repetition_penalty=2.0)[0]
    assert close(got, [1.0, -2.0, 0.5, 3.0, -4.0, 1.0, float("-inf")])


def test_frequency_penalty_scales_with_count():
    got = run([2, 1, 0, 0, 3, 0], [0], frequency_penalty=0.5)[0]
    assert close(got, [1.0, -1.5, 0.5, 3.0, -3.5, 1.0, float("-inf")])


def test_presence_penalty_once_per_seen_token():
    got = run([2, 1, 0, 0, 3, 0], [0], presence_penalty=0.25)[0]
    assert close(got, [1.75, -1.25, 0.5, 3.0, -2.25, 1.0, float("-inf")])


def test_length_penalty_ramps_on_end_tokens_only():
    got = run([0] * 6, [4, 8, 12, 16, 40], dllm_length_penalty=10.0, dllm_length_penalty_start=8,
              dllm_length_penalty_window=8)
    for row, bonus in zip(got, [0.0, 0.0, 5.0, 10.0, 10.0]):  # ramp: clamp((n - 8) / 8, 0, 1)
        assert close(row, LOGITS[:END] + [1.0 + bonus] + LOGITS[END + 1:])


def test_think_end_bias_only_while_thinking_is_open():
    kw = dict(dllm_think_end_bias=4.0, dllm_think_end_start=2, dllm_think_end_window=4)
    got = run([0] * 6, [0, 3, 6, 9], **kw)
    for row, bonus in zip(got, [0.0, 1.0, 4.0, 4.0]):
        assert close(row, LOGITS[:THINK] + [0.5 + bonus] + LOGITS[THINK + 1:])
    closed = run([0, 0, 1, 0, 0, 0], [6], **kw)[0]  # </think> already in the response
    assert closed[THINK] == pytest.approx(0.5)
    off = run([0] * 6, [6], enable_thinking=False, **kw)[0]
    assert off[THINK] == pytest.approx(0.5)
    assert run([0] * 6, [6], think_end_id=None, **kw)[0][THINK] == pytest.approx(0.5)  # no </think> token


def test_all_controls_in_table_order():
    """Token 0 (l=2, count 2), token 1 (l=-1, count 1), end token 5 (l=1, count 1), n = 12:
    repetition first, then frequency, presence, length penalty, think bias."""
    got = run([2, 1, 0, 0, 0, 1], [12], repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25,
              dllm_length_penalty=10.0, dllm_length_penalty_start=8, dllm_length_penalty_window=8,
              dllm_think_end_bias=4.0, dllm_think_end_start=10, dllm_think_end_window=8)[0]
    want = [
        2.0 / 2 - 0.5 * 2 - 0.25,  # -0.25
        -1.0 * 2 - 0.5 * 1 - 0.25,  # -2.75
        0.5 + 4.0 * 0.25,  # think bias: ramp((12 - 10) / 8)
        3.0,
        -2.0,
        1.0 / 2 - 0.5 - 0.25 + 10.0 * 0.5,  # 4.75 (the length bonus after the penalties, not divided by 2)
        float("-inf"),
    ]
    assert close(got, want)


def test_two_rows_use_their_own_parameters_and_end_tokens():
    rows = [GenerationSettings(repetition_penalty=2.0, presence_penalty=0.0, dllm_length_penalty=10.0,
                               dllm_length_penalty_start=0, dllm_length_penalty_window=10, dllm_think_end_bias=0.0),
            GenerationSettings(repetition_penalty=1.0, presence_penalty=1.0, dllm_length_penalty=0.0,
                               dllm_think_end_bias=0.0)]
    p = RowParams(torch.tensor([param_row(s) for s in rows]))
    logits = torch.tensor([[LOGITS], [LOGITS]])
    ids, cnt = sparse([{0: 1, 4: 2}, {0: 1}], pad=MASK)  # row 1 padded with (MASK, 0)
    out = apply_controls_(logits, ids, cnt, torch.tensor([[5.0], [5.0]]), p, torch.tensor([[END, 0], [1, -1]]), None)
    assert close(out[0, 0].tolist(), [2.0 / 2 + 5.0, -1.0, 0.5, 3.0, -4.0, 1.0 + 5.0, float("-inf")])  # ends 5, 0
    assert close(out[1, 0].tolist(), [1.0, -1.0, 0.5, 3.0, -2.0, 1.0, float("-inf")])


def test_thinking_open_rule():
    assert thinking_open(True, THINK, {})
    assert not thinking_open(True, THINK, {THINK: 1})  # </think> already counted
    assert not thinking_open(False, THINK, {})
    assert not thinking_open(True, None, {})  # the tokenizer has no </think>


def test_ramp_clamps():
    n = torch.tensor([[0.0, 8.0, 12.0, 100.0]])
    assert ramp(n, torch.tensor([8.0]), torch.tensor([8.0])).tolist() == [[0.0, 0.0, 0.5, 1.0]]


def test_min_tokens_blocks_end_tokens_before_n_only():
    """vLLM's min_tokens: every end token is -inf at response positions n < min_tokens; other tokens and
    later positions keep their logits (the padding entry -1 of the end-token table touches nothing)."""
    got = run([0] * 6, [0, 2, 3, 7], min_tokens=3, max_new_tokens=8)
    for row, n in zip(got, [0, 2, 3, 7]):
        assert close(row, LOGITS[:END] + [float("-inf") if n < 3 else 1.0] + LOGITS[END + 1:])
    assert close(run([0] * 6, [0], min_tokens=0)[0], LOGITS)  # the default changes nothing
    # two end tokens, one row's table padded: both of row 0's ends blocked, row 1's own only
    rows = [GenerationSettings(min_tokens=4, **NEUTRAL), GenerationSettings(min_tokens=1, **NEUTRAL)]
    p = RowParams(torch.tensor([param_row(s) for s in rows]))
    logits = torch.tensor([[LOGITS], [LOGITS]])
    none = torch.zeros(2, 0)
    out = apply_controls_(logits, none.long(), none, torch.tensor([[2.0], [2.0]]), p,
                          torch.tensor([[END, 0], [1, -1]]), None)
    assert close(out[0, 0].tolist(), [float("-inf")] + LOGITS[1:END] + [float("-inf"), float("-inf")])
    assert close(out[1, 0].tolist(), LOGITS)  # n = 2 >= 1


NEUTRAL = dict(repetition_penalty=1.0, frequency_penalty=0.0, presence_penalty=0.0, dllm_length_penalty=0.0,
               dllm_think_end_bias=0.0)


def test_largest_accepted_values_keep_every_logit_a_number():
    """Every real parameter at its range's maximum, through the float32 parameter table, with min_tokens: the
    controlled logits hold no NaN (an infinite strength times a zero ramp would be one)."""
    from clover_export.core.generation import RANGES

    top = {name: rng.high for name, rng in RANGES.items()
           if rng.kind == "real" and name not in ("threshold", "top_p", "frequency_penalty", "presence_penalty")}
    for n in ([0, 1], [10, 11]):
        out = run([1, 2, 0, 1, 0, 0, 0], n, min_tokens=5, **top)
        assert not torch.tensor(out).isnan().any(), out


def test_the_smallest_accepted_divisors_keep_the_logits_finite_and_smaller_ones_are_refused():
    """repetition_penalty and the ramp windows divide the logits / response positions (DECODING.md 3). At
    their lowest accepted value the controls stay finite in float32 (a huge logit, a seen token, positions on
    and past the ramp start, strengths at their maximum); values that float32 turns into an overflow (1e-39)
    or a zero (1e-46) are refused naming the field."""
    from clover_export.core.errors import CloverError
    from clover_export.core.generation import RANGES

    divisors = ("repetition_penalty", "dllm_length_penalty_window", "dllm_think_end_window")
    low = {name: RANGES[name].low for name in divisors}
    strong = dict(dllm_length_penalty=RANGES["dllm_length_penalty"].high,
                  dllm_think_end_bias=RANGES["dllm_think_end_bias"].high, dllm_length_penalty_start=3.0,
                  dllm_think_end_start=3.0)
    huge = [1e4, -1e4, *LOGITS[2:]]
    out = run([1, 1, 0, 0, 0, 0, 0], [2.0, 3.0, 4.0], logits=huge, **low, **strong)
    assert all(torch.isfinite(torch.tensor(row[:-1])).all() for row in out), out
    assert out[0][0] == pytest.approx(1e4 / low["repetition_penalty"]) and out[0][END] == 1.0
    assert out[2][END] == pytest.approx(1.0 + strong["dllm_length_penalty"])
    for name in divisors:
        for bad in (low[name] / 2, 1e-39, 1e-46, 0.0):
            with pytest.raises(CloverError, match=f"'{name}' must be a finite number in \\[1e-06"):
                GenerationSettings().override(**{name: bad})
