"""Calibration and FP8 agreement: prompts -> step feeds -> amax / top-1 agreement (STEP_GRAPH.md 4).

The built-in prompt set mixes plain chat with the embedded default's tasks;
`--calib FILE` replaces it (one prompt per line, or a JSON list of strings).
Each prompt is one batch row; a set is played as two steps, the way the
runtime plays a request: prefill folded with a block of masks, then a
block-only step with half the positions filled.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from clover_export.core import names
from clover_export.core.errors import CloverError

BUILTIN_PROMPTS = [
    "Sort: 7 3 9 1", "Reverse: 4 8 2 6 1", "Sort: 5 5 0 9 2 8", "Reverse: 1 2 3",
    "Hello! Who are you?", "Write one sentence about the sea.", "What is 12 + 34?",
    "List three colours.", "Sort: 9 8 7 6 5 4 3", "Reverse: 0 9 1 8",
]
FP8_MIN_AGREEMENT = 0.97  # top-1 agreement of an FP8 graph with the graph it was quantised from (issue target)
HELDOUT_PROMPTS = [
    "Sort: 6 1 4", "Reverse: 3 3 7 2", "Sort: 2 9 4 4 0", "Reverse: 8 6 5 1 9 2",
    "Tell me a short fact.", "Sort: 1 0 5 7 3 8 2", "Reverse: 5 4", "Say hi in French.",
]


def read_prompts(path: str | Path | None) -> list[str]:
    if path is None:
        return list(BUILTIN_PROMPTS)
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise CloverError("calibration", f"{p}: cannot read ({e.strerror})") from None
    try:
        data = json.loads(text)
        prompts = data if isinstance(data, list) else None
    except json.JSONDecodeError:
        prompts = [line for line in text.splitlines() if line.strip()]
    if not prompts or not all(isinstance(x, str) for x in prompts):
        raise CloverError("calibration", f"{p}: expected prompts, one per line or a JSON list of strings")
    return prompts


@dataclass
class PromptBatch:
    ids: list[list[int]]  # chat-templated prompt ids per row
    mask_id: int
    block_size: int

    def prefill_step(self) -> dict[str, np.ndarray]:
        B, C, N = len(self.ids), max(map(len, self.ids)), self.block_size
        ids = np.full((B, C + N), self.mask_id, np.int32)
        for b, row in enumerate(self.ids):
            ids[b, :len(row)] = row
        return {names.INPUT_IDS: ids, names.N_CAUSAL: np.array([len(r) for r in self.ids], np.int32),
                names.HAS_BLOCK: np.ones(B, np.int32), names.SLOT_IDS: np.arange(B, dtype=np.int32),
                names.PAST_LEN: np.zeros(B, np.int32)}

    def pool_len(self) -> int:
        """Cache rows the two steps need: the prefill's chunk and block, then the block again after the prompt."""
        return max(map(len, self.ids)) + 2 * self.block_size

    def denoise_step(self, block_logits: np.ndarray) -> dict[str, np.ndarray]:
        """Block-only step with the more confident half of each block filled by its argmax."""
        B, N = len(self.ids), self.block_size
        block = np.full((B, N), self.mask_id, np.int32)
        for b in range(B):  # a row at a time: float64 probabilities of a 248k vocabulary are 64 MB a row
            logits = block_logits[b].astype(np.float64)
            logits[..., self.mask_id] = -np.inf
            probs = np.exp(logits - logits.max(-1, keepdims=True))
            probs /= probs.sum(-1, keepdims=True)
            conf, tok = probs.max(-1), probs.argmax(-1)
            keep = np.argsort(-conf, kind="stable")[: N // 2]
            block[b, keep] = tok[keep]
        return {names.INPUT_IDS: block, names.N_CAUSAL: np.zeros(B, np.int32), names.HAS_BLOCK: np.ones(B, np.int32),
                names.SLOT_IDS: np.arange(B, dtype=np.int32),
                names.PAST_LEN: np.array([len(r) for r in self.ids], np.int32)}


def prompt_batch(model_dir: Path, prompts: list[str], block_size: int) -> PromptBatch:
    from clover_export.core.config import load_config
    from clover_export.model.tokenizer import ChatTokenizer

    cfg = load_config(model_dir)
    tok = ChatTokenizer(model_dir)
    ids = [tok.apply_chat_template([{"role": "user", "content": p}], enable_thinking=False) for p in prompts]
    return PromptBatch(ids, cfg.require_mask_token(), block_size)


def calibration_steps(model_dir: Path, prompts: list[str], block_size: int, model=None) -> list[dict[str, np.ndarray]]:
    """Prefill + one half-filled denoise step; the fill comes from the reference model's own argmax.
    `model`: the reference model to use (default: loaded whole; `stream_calib.streamed_model` at full size).
    (`fp8.calibrate` plays a `prompt_batch` itself, in one pass fewer than playing these steps again.)"""
    import torch

    from clover_export.core.config import load_config
    from clover_export.model.loading import load_model
    from clover_export.model.model import allocate_pools

    batch = prompt_batch(model_dir, prompts, block_size)
    first = batch.prefill_step()
    if model is None:
        model = load_model(model_dir, torch.float32, block_size=block_size)
    pools = allocate_pools(load_config(model_dir), len(prompts), batch.pool_len())
    with torch.no_grad():
        logits, _, _ = model.step({k: torch.from_numpy(v) for k, v in first.items()}, pools)
    return [first, batch.denoise_step(logits.numpy())]


@dataclass
class Agreement:
    positions: int
    top1_agreement: float  # fraction of denoise positions whose argmax matches the reference graph's
    max_abs_logit_error: float
    mean_abs_logit_error: float

    def line(self) -> str:
        return (f"FP8 vs fp32 graph over {self.positions} denoise positions: top-1 agreement "
                f"{100 * self.top1_agreement:.2f}%, logit error max {self.max_abs_logit_error:.4f} "
                f"mean {self.mean_abs_logit_error:.4f}")


def agreement(reference_dir: Path, candidate_dir: Path, model_dir: Path, prompts: list[str]) -> Agreement:
    """Play the same two steps through both graphs in ONNX Runtime; compare block logits (mask token excluded)."""
    from clover_export.artifact.manifest import load_artifact
    from clover_export.exporter.session import ort_session
    from clover_export.model.model import allocate_pools

    ref_art, cand_art = load_artifact(reference_dir), load_artifact(candidate_dir)
    batch = prompt_batch(model_dir, prompts, ref_art.block_size)
    sessions = [ort_session(a, ["CPUExecutionProvider"]) for a in (ref_art, cand_art)]
    first = batch.prefill_step()
    L = first[names.INPUT_IDS].shape[1] + ref_art.block_size
    pools = [{k: v.numpy() for k, v in allocate_pools(ref_art.config, len(prompts), L).items()} for _ in sessions]
    agree, total, errs = 0, 0, []
    feeds = first
    for step in range(2):
        outs = []
        for i, (sess, art) in enumerate(zip(sessions, (ref_art, cand_art))):
            res = dict(zip(art.output_names, sess.run(art.output_names, {**feeds, **pools[i]})))
            pools[i] = {p: res[names.present_name(p)] for p in art.pool_names}
            outs.append(res[names.LOGITS])
        masked = feeds[names.INPUT_IDS][:, -ref_art.block_size:] == batch.mask_id
        ref, cand = (np.delete(o, batch.mask_id, axis=-1) for o in outs)
        agree += int(((ref.argmax(-1) == cand.argmax(-1)) & masked).sum())
        total += int(masked.sum())
        errs.append(np.abs(ref - cand)[masked])
        if step == 0:
            feeds = batch.denoise_step(outs[0])
    e = np.concatenate(errs)
    return Agreement(total, agree / max(total, 1), float(e.max()), float(e.mean()))


def validate_fp8(art, min_agreement: float = FP8_MIN_AGREEMENT) -> tuple[str, bool]:
    """(report line, passed) of an FP8 artefact against the graph it was quantised from."""
    from clover_export.artifact.manifest import load_artifact

    source = Path(art.manifest["quantization"]["source"])
    model_dir = Path(art.manifest["model_dir"])
    if art.dtype != "fp32":
        raise CloverError("validate", f"{art.dir}: an FP8 graph on bf16 activations; ONNX Runtime's CPU EP has no "
                          "bf16 kernels", "validate its fp32-activation twin (onnx-fp8 of the same build) instead")
    if not (source / "manifest.json").exists():
        raise CloverError("validate", f"{art.dir}: the graph it was quantised from ({source}) is gone")
    load_artifact(source)
    a = agreement(source, art.dir, model_dir, HELDOUT_PROMPTS)
    return a.line(), a.top1_agreement >= min_agreement
