"""The fp32 export on ONNX Runtime against the torch backend on a checkpoint with trained-like GDN layers.

STEP_GRAPH.md 2: keys sharing a direction, slow decay and beta
near 1 (tests/trained_like.py) with a prompt of several hundred tokens, so
that prefill runs full 256-row chunks through the BlockGDN function body.
With the nilpotent product-series inverse the ONNX Runtime tokens differ from
the first one; with the blocked triangular inverse they are the torch
backend's, and `validate` (which plays a full chunk) passes.
"""

from __future__ import annotations

import pytest
from trained_like import gdn_statistics, make_trained_like

PROMPT = "The quick brown fox jumps over the lazy dog while the committee reviews the annual budget. " * 30
PROMPT_TOKENS = 400


@pytest.fixture(scope="module")
def prompt_ids(tok):
    return tok.apply_chat_template([{"role": "user", "content": PROMPT}], enable_thinking=True)[:PROMPT_TOKENS]


@pytest.fixture(scope="module")
def checkpoint(tiny_dir, prompt_ids, tmp_path_factory):
    return make_trained_like(tiny_dir, tmp_path_factory.mktemp("trained-like") / "model", prompt_ids)


@pytest.fixture(scope="module")
def artifact(checkpoint, tmp_path_factory):
    from clover_export.exporter.export import export

    out = tmp_path_factory.mktemp("trained-like-export") / "fp32"
    export(checkpoint, out, dtype="fp32", weights="copy", max_batch=2, slots=2, max_len=1024)
    return out


def test_checkpoint_has_trained_like_gdn_layers(checkpoint, prompt_ids):
    from clover_export.model.loading import load_model

    stats = gdn_statistics(load_model(checkpoint), prompt_ids)
    assert len(stats) == 6
    for s in stats:
        assert s["key_cosine"] > 0.75 and s["beta_median"] > 0.95 and s["decay_min"] > 0.99, s
    assert sum(s["key_cosine"] for s in stats) / len(stats) > 0.8


@pytest.mark.slow
def test_ort_greedy_tokens_equal_the_torch_backend(checkpoint, artifact, prompt_ids):
    from clover_export.backends.ort_backend import OrtBackend
    from clover_export.backends.torch_backend import TorchBackend
    from clover_export.runtime.generator import Generator

    params = dict(prompt_ids=prompt_ids, max_new_tokens=64, threshold=0.9, ignore_eos=True)  # any weights: 64 tokens
    torch_gen = Generator(TorchBackend.load(checkpoint, dtype="fp32"), checkpoint, max_slots=1, prefill_chunk=256)
    ort_gen = Generator(OrtBackend.load(artifact, providers=["CPUExecutionProvider"]), artifact, max_slots=1,
                        prefill_chunk=256)
    want = torch_gen.generate(**params)
    got = ort_gen.generate(**params)
    assert len(want.token_ids) >= 32
    assert got.token_ids == want.token_ids


def prefill_block_logits(backend, prompt_ids, chunk=256):
    """The first block's logits after the prompt (a full chunk, then the rest folded with a masked block), then
    the causal logits of each chunk's last row."""
    import numpy as np
    import torch

    from clover_export.core import names

    N, mask = backend.block_size, backend.cfg.mask_token_id
    pools = backend.allocate_pools(1, 1024)
    i32 = lambda v: torch.tensor([v], dtype=torch.int32)  # noqa: E731
    past, causal = 0, []
    for start in range(0, len(prompt_ids), chunk):
        part = list(prompt_ids[start:start + chunk])
        last = start + chunk >= len(prompt_ids)
        ids = torch.tensor([part + [mask] * N], dtype=torch.int32)
        inputs = {names.INPUT_IDS: ids, names.N_CAUSAL: i32(len(part)), names.HAS_BLOCK: i32(int(last)),
                  names.SLOT_IDS: i32(0), names.PAST_LEN: i32(past), names.LOGIT_ROWS: i32([len(part) - 1])}
        res = backend.step(inputs, pools)
        logits, _, pools = res
        causal.append(res.causal_logits[0, 0].clone().numpy())
        past += len(part)
    return np.concatenate([logits[0].clone().numpy(), np.stack(causal)])


@pytest.mark.slow
def test_ort_block_logits_equal_the_torch_backend(checkpoint, artifact, prompt_ids):
    import numpy as np

    from clover_export.backends.ort_backend import OrtBackend
    from clover_export.backends.torch_backend import TorchBackend
    from clover_export.verify.compare import fp32_tolerance

    want = prefill_block_logits(TorchBackend.load(checkpoint, dtype="fp32"), prompt_ids)
    got = prefill_block_logits(OrtBackend.load(artifact, providers=["CPUExecutionProvider"]), prompt_ids)
    assert np.abs(got - want).max() <= fp32_tolerance(0, "logits", want)


@pytest.mark.slow
def test_validate_passes_at_full_chunk_on_trained_like_layers(artifact):
    from clover_export.verify import validate as V

    rep = V.validate(artifact, reference_evaluator=False)
    assert rep.passed, rep.format()
