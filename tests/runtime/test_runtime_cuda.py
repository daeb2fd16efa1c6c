"""The runtime on a CUDA GPU (torch backend): the literal reference's tokens, batch invariance, seeds.

Skipped where there is no CUDA device. The reference runs on the CPU in fp32;
TF32 is switched off. GPU and CPU fp32 reduce in other orders: block logits
(magnitude up to ~20) differ by up to ~2e-4 on an H200, hence GPU_ATOL.
"""

from __future__ import annotations

import pytest
import torch
from test_loop import LONG, PROMPTS, check_same, run_both  # the literal DECODING.md reference, margin rule

GPU_ATOL = 1e-3

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.fixture(scope="module")
def models(tiny_dir):
    from clover_export.model.loading import load_model

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    return load_model(tiny_dir, dtype=torch.float32), load_model(tiny_dir, dtype=torch.float32, device="cuda")


@pytest.fixture(scope="module")
def tok(tiny_dir):
    from clover_export.model.tokenizer import ChatTokenizer

    return ChatTokenizer(tiny_dir)


@pytest.mark.parametrize("threshold", [1.0, 0.9])
@pytest.mark.parametrize("optimised", [True, False])
def test_cuda_matches_the_literal_reference(models, tiny_dir, tok, threshold, optimised):
    from clover_export.backends.torch_backend import TorchBackend

    cpu, gpu = models
    prompt = PROMPTS["short"]
    res, ref, seen = run_both(cpu, tiny_dir, tok, prompt, backend=TorchBackend(gpu, tiny_dir), fold=optimised,
                              early=optimised, threshold=threshold, **LONG)
    assert seen[0].is_cuda
    assert check_same(res, ref, seen, atol=GPU_ATOL) >= min(len(ref.response), 32)


def test_cuda_batch_invariance_and_seeds(models, tiny_dir):
    from clover_export.backends.torch_backend import TorchBackend
    from clover_export.runtime.generator import Generator

    gen = Generator(TorchBackend(models[1], tiny_dir), tiny_dir, max_slots=4, prefill_chunk=16)
    kw = dict(max_new_tokens=40, do_sample=True, temperature=3.0, top_p=0.98, eos_token_id=[1])
    alone = gen.generate("Hello", seed=3, **kw).token_ids
    greedy = gen.generate("Hi", max_new_tokens=40).token_ids
    batch = gen.generate_batch(["Hello", "What is 1 + 2? " * 5, "Hi"], seed=3, **kw)
    assert batch[0].token_ids == alone
    mixed = [gen.submit("Hi", max_new_tokens=40), gen.submit("What is 7 + 8? " * 4, **kw, seed=1)]
    assert gen.wait(mixed)[0].token_ids == greedy
