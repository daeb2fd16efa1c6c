"""The decoding loop against a literal re-implementation of DECODING.md 1-3 written here.

The reference is slow and obvious: one request, the reference model called
step by step (prefill, then per block: denoise steps with no causal rows, then
a separate commit step), the controls and the LowConfidence rule as
per-position Python loops. The runtime (torch backend, fp32) must give the
same greedy tokens with and without its two optimisations (commit folding,
early block stop), for several thresholds and prompt lengths that are not a
multiple of the block size.

Margin rule: with random weights many decisions are close, and folding
changes the floating-point order. A reference step is *unclear* when a masked
position's top-2 logit gap, its confidence's distance to the threshold, or
the fallback's best-vs-second confidence gap is below a small epsilon. Tokens
are compared for every block before the first unclear step (which must cover
at least one block); logits are compared at every step before it.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch

from clover_export.backends.torch_backend import TorchBackend
from clover_export.model.model import allocate_pools
from clover_export.runtime.generator import Generator

LOGIT_EPS = 5e-4  # top-2 logit gap of a filled position below this: unclear
LOGIT_NOISE = 1e-5  # logit differences the two sides may have (fp32, other summation orders)
LOGIT_ATOL = 2e-4  # per-step block logits, folded vs unfolded, fp32


# --- the literal reference ---------------------------------------------------------------
@dataclass
class RefOut:
    response: list[int]
    step_logits: list[torch.Tensor] = field(default_factory=list)  # [N, V] per denoise step
    block_ends: list[int] = field(default_factory=list)  # response length after each block
    fill_step: list[int] = field(default_factory=list)  # per response position: the step that filled it
    first_unclear_step: int | None = None
    first_unclear_block: int | None = None
    unclear_why: str = ""
    denoise_steps: int = 0


def conf_tol(c: float) -> float:
    """How far an fp32 confidence may move: its rounding (1.5 ulps) plus the logit noise through the softmax."""
    return 1.5 * float(np.spacing(np.float32(c))) + LOGIT_NOISE * c * (1 - c)


def ramp(n, start, window):
    return min(max((n - start) / window, 0.0), 1.0)


def reference_generate(model, prompt, s, end_ids, mask_id, think_end_id, alignment="prompt_end") -> RefOut:
    """DECODING.md 1-3 for one request, greedy, no folding, no early stop."""
    cfg, N = model.cfg, model.block_size
    pools = allocate_pools(cfg, 1, len(prompt) + (s.max_new_tokens // N + 2) * N)
    i32 = lambda *v: torch.tensor(v, dtype=torch.int32)  # noqa: E731

    def forward(causal, block, past_len, has_block):
        nonlocal pools
        ids = torch.tensor([causal + (block if block else [mask_id] * N)], dtype=torch.int32)
        inputs = dict(input_ids=ids, n_causal=i32(len(causal)), has_block=i32(has_block), slot_ids=i32(0),
                      past_len=i32(past_len))
        with torch.no_grad():
            logits, _, pools = model.step(inputs, pools)
        return logits[0]

    # 1.3 prefill (absolute alignment: the prompt tail joins the first block)
    cut = len(prompt) // N * N if alignment == "absolute" else len(prompt)
    past = 0
    if cut:
        forward(list(prompt[:cut]), None, 0, 0)
        past = cut
    tail = list(prompt[cut:])
    out = RefOut([])
    step_no = 0
    while True:
        block = tail + [mask_id] * (N - len(tail))
        first = len(tail)  # block positions before `first` are prompt, not response
        filled_at = [-1] * N
        tail = []
        while mask_id in block[first:]:
            logits = forward([], block, past, 1)
            out.step_logits.append(logits.clone())
            counts = Counter(out.response + [t for t in block[first:] if t != mask_id])
            thinking = s.enable_thinking and counts[think_end_id] == 0
            toks, confs, gaps, unclear, why = {}, {}, {}, False, ""
            for i in range(first, N):
                if block[i] != mask_id:
                    continue
                l = logits[i].clone()  # fp32, as the runtime: ties and saturation (conf == 1.0) match
                l[mask_id] = -math.inf
                n_i = len(out.response) + i - first
                for t, c in counts.items():
                    v = l[t].item()
                    v = v / s.repetition_penalty if v > 0 else v * s.repetition_penalty
                    v -= s.frequency_penalty * c
                    v -= s.presence_penalty
                    l[t] = v
                for e in end_ids:
                    l[e] += s.dllm_length_penalty * ramp(n_i, s.dllm_length_penalty_start, s.dllm_length_penalty_window)
                if thinking:
                    l[think_end_id] += s.dllm_think_end_bias * ramp(
                        n_i, s.dllm_think_end_start, s.dllm_think_end_window
                    )
                top2 = torch.topk(l, 2).values
                tok = int(torch.argmax(l))
                conf = float(torch.softmax(l, 0)[tok])
                toks[i], confs[i], gaps[i] = tok, conf, float(top2[0] - top2[1])
                # a confidence this close to the threshold could fall either side (none exceeds 1.0)
                if s.threshold < 1.0 and abs(conf - s.threshold) < conf_tol(s.threshold):
                    unclear, why = True, f"position {i}: confidence {conf:.9g} at threshold {s.threshold}"
            fills = [i for i in toks if confs[i] > s.threshold]
            if not fills:
                ranked = sorted(toks, key=lambda i: (-confs[i], i))
                fills = ranked[:1]
                if len(ranked) > 1:  # an exact tie (e.g. both saturated at 1.0) is decided by index on both sides
                    gap = confs[ranked[0]] - confs[ranked[1]]
                    if 0 < gap < conf_tol(confs[ranked[0]]):
                        unclear, why = True, f"fallback: confidences {confs[ranked[0]]:.9g} vs {confs[ranked[1]]:.9g}"
            for i in fills:
                block[i] = toks[i]
                filled_at[i] = step_no
                if gaps[i] < LOGIT_EPS:  # only the filled positions' tokens matter
                    unclear, why = True, f"position {i}: top-2 logit gap {gaps[i]:.3g}"
            if unclear and out.first_unclear_step is None:
                out.first_unclear_step, out.first_unclear_block = step_no, len(out.block_ends)
                out.unclear_why = why
            step_no += 1
        out.denoise_steps = step_no
        done = False
        for i, t in enumerate(block[first:], start=first):
            if len(out.response) >= s.max_new_tokens:
                done = True
                break
            out.response.append(t)
            out.fill_step.append(filled_at[i])
            if t in end_ids:
                done = True
                break
        done |= len(out.response) >= s.max_new_tokens
        out.block_ends.append(len(out.response))
        if done:
            return out
        forward(list(block), None, past, 0)  # 1.4 commit
        past += N


# --- fixtures ------------------------------------------------------------------------------
PROMPTS = {
    "short": "What is 123 + 456?",  # 22 tokens with the template
    "long": "Please sort the list 3 1 2 in ascending order, then reverse the word robot.",
}
# <|endoftext|> is no end token here (only <|im_end|> and <|im_start|>), so responses run over several blocks
LONG = dict(eos_token_id=[1], max_new_tokens=70)


def run_both(model, tiny_dir, tok, prompt_text, alignment="prompt_end", fold=True, early=True, backend=None,
             **params):
    """(runtime Result, literal reference, the runtime's block logits per denoise step); the runtime drives
    `backend` (default: the torch backend on `model`), the reference always `model`."""
    backend = backend or TorchBackend(model, tiny_dir)
    if alignment != "prompt_end":
        backend.cfg = backend.cfg.replace(block_alignment=alignment)
    gen = Generator(backend, tiny_dir, max_slots=2, fold_commit=fold, early_stop=early)
    seen: list[torch.Tensor] = []
    gen.runner.observer = lambda plan, logits: seen.extend(
        logits[r].clone() for r in range(plan.batch) if plan.has_block[r])
    prompt = tok.apply_chat_template([{"role": "user", "content": prompt_text}])
    assert len(prompt) % model.block_size != 0
    res = gen.generate(prompt_ids=prompt, **params)
    s = gen.settings(**params)
    ref = reference_generate(model, prompt, s, set(s.eos_token_id) | {tok.im_end_id}, gen.mask_id,
                             tok.think_end_id, alignment)
    return res, ref, seen


def check_same(res, ref, seen, atol: float = LOGIT_ATOL) -> int:
    """Tokens of every block before the first unclear step equal; logits before it close.
    Returns how many response tokens were compared."""
    k = len(ref.response)
    if ref.first_unclear_block is None:
        assert res.token_ids == ref.response
        n_steps = len(ref.step_logits)
    else:
        assert ref.first_unclear_block >= 1, f"margin rule left nothing to compare: step {ref.first_unclear_step}, " \
                                             f"{ref.unclear_why}"
        k = ref.block_ends[ref.first_unclear_block - 1]
        assert res.token_ids[:k] == ref.response[:k]
        n_steps = ref.first_unclear_step
    for i, (a, b) in enumerate(zip(seen[:n_steps], ref.step_logits[:n_steps])):
        a = a.cpu()
        assert torch.allclose(a, b, atol=atol, rtol=0), f"step {i}: max err {(a - b).abs().max():.3g}"
    return k


@pytest.mark.parametrize("threshold", [1.0, 0.9, 0.05])
@pytest.mark.parametrize("optimised", [True, False], ids=["fold+early", "plain"])
@pytest.mark.parametrize("prompt", ["short", "long"])
def test_loop_matches_literal_reference(tiny_model, tiny_fp32_dir, tok, threshold, optimised, prompt):
    """The runtime's loop against the literal reference, on random fp32 weights: the trained default is so sure
    of its short answers that its confidences tie at 1.0 in fp32, which leaves the order of fills undecided."""
    prompt = PROMPTS[prompt]
    res, ref, seen = run_both(tiny_model, tiny_fp32_dir, tok, prompt, fold=optimised, early=optimised,
                              threshold=threshold, **LONG)
    compared = check_same(res, ref, seen)
    assert compared >= min(len(ref.response), 32)
    if threshold == 1.0:  # one token per step: a block takes exactly block_size steps
        assert ref.denoise_steps == 32 * len(ref.block_ends)
    if not optimised:
        assert res.denoise_steps == ref.denoise_steps
        # every commit but the last block's is a forward of its own
        assert res.forwards_per_block == (res.denoise_steps + res.blocks - 1) / res.blocks
    else:
        assert res.forwards_per_block == res.denoise_steps / res.blocks


# every control active early in the response: ramps starting at n = 3..10, strong count penalties
STRONG_CONTROLS = dict(repetition_penalty=1.4, frequency_penalty=0.3, presence_penalty=0.6,
                       dllm_length_penalty=6.0, dllm_length_penalty_start=10, dllm_length_penalty_window=40,
                       dllm_think_end_bias=4.0, dllm_think_end_start=3, dllm_think_end_window=6)


@pytest.mark.parametrize("threshold", [1.0, 0.7])
@pytest.mark.parametrize("thinking", [True, False])
def test_controls_in_the_loop_match_the_reference(tiny_model, tiny_fp32_dir, tok, threshold, thinking):
    """As test_loop_matches_literal_reference (random fp32 weights), with every control active."""
    params = dict(LONG, threshold=threshold, enable_thinking=thinking, **STRONG_CONTROLS)
    res, ref, seen = run_both(tiny_model, tiny_fp32_dir, tok, PROMPTS["short"], **params)
    assert check_same(res, ref, seen) >= min(len(ref.response), 32)
    plain, _, _ = run_both(tiny_model, tiny_fp32_dir, tok, PROMPTS["short"], **dict(LONG, threshold=threshold,
                                                                              enable_thinking=thinking))
    assert plain.token_ids != res.token_ids  # the controls changed the output


def test_low_thresholds_fill_several_positions_per_step(model, tiny_dir, tok):
    """At threshold 0.05 a denoise step fills more than two block positions on average (at 1.0 it fills one),
    in the runtime and in the literal reference alike."""
    res, ref, seen = run_both(model, tiny_dir, tok, PROMPTS["long"], fold=False, early=False, threshold=0.05, **LONG)
    check_same(res, ref, seen)
    assert (res.blocks, res.denoise_steps) == (len(ref.block_ends), ref.denoise_steps)
    assert model.block_size * res.blocks / res.denoise_steps > 2, (res.blocks, res.denoise_steps)


def test_absolute_alignment_matches_reference(model, tiny_dir, tok):
    kw = dict(LONG, max_new_tokens=40)
    res, ref, seen = run_both(model, tiny_dir, tok, PROMPTS["long"], alignment="absolute", threshold=0.9, **kw)
    assert check_same(res, ref, seen) == len(ref.response)
    P = res.prompt_tokens
    if res.response_tokens == 40:  # the first block held the prompt tail
        assert res.blocks == math.ceil((P % 32 + 40) / 32)


@pytest.mark.parametrize("threshold", [1.0, 0.9])
def test_early_stop_keeps_output_and_saves_steps(tiny_model, tiny_fp32_dir, tok, threshold):
    """An end token filled while later positions are still masked: same tokens, fewer denoise steps than
    without early stop (a response token that resolves before its block does is made an end token for the
    request; random fp32 weights, whose fills do not tie as the trained default's do)."""
    model, tiny_dir = tiny_model, tiny_fp32_dir
    _, probe, _ = run_both(model, tiny_dir, tok, PROMPTS["long"], threshold=threshold, early=False, **LONG)
    candidates = []  # (how much sooner than its block the prefix up to p resolved, p)
    for p, t in enumerate(probe.response[:32]):  # the first block: later ones may meet near ties
        start = p // 32 * 32
        block_done, prefix_done = max(probe.fill_step[start:start + 32]), max(probe.fill_step[start:p + 1])
        if t not in probe.response[:p] and prefix_done < block_done:
            candidates.append((prefix_done - block_done, p))
    assert candidates, "no position resolves before its block does; pick another prompt"
    p = min(candidates)[1]
    params = dict(threshold=threshold, max_new_tokens=70, eos_token_id=[probe.response[p]])
    res, ref, seen = run_both(model, tiny_dir, tok, PROMPTS["long"], **params)
    assert check_same(res, ref, seen) == len(ref.response)
    assert res.finish_reason == "stop" and res.token_ids == probe.response[:p + 1]
    late, _, _ = run_both(model, tiny_dir, tok, PROMPTS["long"], early=False, **params)
    assert late.token_ids == res.token_ids
    assert res.denoise_steps < late.denoise_steps == ref.denoise_steps
