"""Requests isolated from each other (issue 10): seeded sampling independent of the batch, every
parameter checked up front, a failing step fails only the requests it concerns (DECODING.md 1.2, 4)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from clover_export.errors import CloverError
from clover_export.runtime.backends.torch_backend import TorchBackend
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


@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
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
