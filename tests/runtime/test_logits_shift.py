"""`logits_shift: true` (MODEL.md 5.1): block position i is predicted by the logits of the row before it.

The runtime (torch backend, and the exported graph on ONNX Runtime) must give
the tokens of a cache-free reference written here: every denoise step
recomputes the whole sequence (prompt + committed blocks as causal rows, the
block as block rows) with the reference model's trunk, and takes the logits
of rows start-1 .. start+N-2 for the block at `start`. The decoding rules
and the margin rule are test_loop.py's literal DECODING.md reference.
"""

from __future__ import annotations

import pytest
import torch
from test_loop import LONG, PROMPTS, check_same, run_both

from clover_export.backends.torch_backend import TorchBackend
from clover_export.core import names
from clover_export.model.loading import load_model
from clover_export.model.model import allocate_pools


class CacheFree:
    """Stands in for the model in test_loop.reference_generate: no cache, the whole sequence every step."""

    def __init__(self, model):
        self.model, self.cfg, self.block_size = model, model.cfg, model.block_size
        self.seq: list[int] = []  # committed tokens (prompt, then blocks)

    def step(self, inputs, pools):
        N, ids = self.block_size, inputs[names.INPUT_IDS][0].tolist()
        assert int(inputs[names.PAST_LEN][0]) == len(self.seq)
        self.seq += ids[:int(inputs[names.N_CAUSAL][0])]
        if not int(inputs[names.HAS_BLOCK][0]):  # prefill / commit: the reference ignores these logits
            return torch.zeros(1), None, pools
        C = len(self.seq)
        i32 = lambda v: torch.tensor([v], dtype=torch.int32)  # noqa: E731
        fresh = allocate_pools(self.cfg, 1, C)
        with torch.no_grad():
            h, _, _ = self.model.trunk(torch.tensor([self.seq + ids[-N:]], dtype=torch.int32), i32(C), i32(1), i32(0),
                                       i32(0), *fresh.values())
            every_row = self.model.logits(h[0])  # [C + N, V]
        return every_row[C - 1:C + N - 1].unsqueeze(0), None, pools  # position i <- row i - 1


@pytest.fixture(scope="module")
def shifted_dir(tmp_path_factory):
    from clover_export.tiny import generate_random_tiny

    return generate_random_tiny(tmp_path_factory.mktemp("shift") / "model", seed=2, dtype=torch.float32,
                                logits_shift=True)


@pytest.fixture(scope="module")
def shifted_model(shifted_dir):
    model = load_model(shifted_dir)
    assert model.cfg.logits_shift
    return model


def compare(model, folder, tok, backend, **kw):
    res, ref, seen = run_both(CacheFree(model), folder, tok, PROMPTS["short"], backend=backend, threshold=1.0,
                              **LONG, **kw)
    assert check_same(res, ref, seen) >= 32  # at least one whole block compared
    return res


@pytest.mark.parametrize("fold", [True, pytest.param(False, marks=pytest.mark.slow)], ids=["fold+early", "plain"])
def test_torch_logits_shift_matches_cache_free_reference(shifted_model, shifted_dir, tok, fold):
    compare(shifted_model, shifted_dir, tok, TorchBackend(shifted_model, shifted_dir), fold=fold, early=fold)


@pytest.mark.slow
def test_ort_logits_shift_matches_cache_free_reference(shifted_model, shifted_dir, tok, tmp_path):
    pytest.importorskip("onnxruntime")
    from clover_export.backends.ort_backend import OrtBackend
    from clover_export.exporter.export import export

    art = tmp_path / "shifted-fp32"
    export(shifted_dir, art, dtype="fp32", weights="copy", slots=2, max_batch=2, max_len=512)
    backend = OrtBackend.load(art, providers=["CPUExecutionProvider"])
    assert backend.cfg.logits_shift
    compare(shifted_model, shifted_dir, tok, backend)
