"""Calibration prompts: prompts -> the step feeds the activation ranges (amax) are collected on (STEP_GRAPH.md 4).

The built-in prompt set mixes plain chat with the embedded default's tasks;
`--calib FILE` replaces it (one prompt per line, or a JSON list of strings).
Each prompt is one batch row; a set is played as two steps, the way the
runtime plays a request: prefill folded with a block of masks, then a
block-only step with half the positions filled. The FP8 agreement plays its
held-out prompts the same way (`verify/agreement.py`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from clover_export.core import names
from clover_export.core.errors import CloverError
from clover_export.model.sizing import fp8_weight_names

BUILTIN_PROMPTS = [
    "Sort: 7 3 9 1", "Reverse: 4 8 2 6 1", "Sort: 5 5 0 9 2 8", "Reverse: 1 2 3",
    "Hello! Who are you?", "Write one sentence about the sea.", "What is 12 + 34?",
    "List three colours.", "Sort: 9 8 7 6 5 4 3", "Reverse: 0 9 1 8",
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
                names.PAST_LEN: np.zeros(B, np.int32),
                names.LOGIT_ROWS: np.array([[len(r) - 1] for r in self.ids], np.int32)}  # the prompt's last row

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
                names.PAST_LEN: np.array([len(r) for r in self.ids], np.int32),
                names.LOGIT_ROWS: np.zeros((B, 1), np.int32)}  # no causal rows: clamped to block row 0


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


def calibrate(model_dir: Path, steps, block_size: int, include_lm_head: bool = False, model=None) -> dict[str, float]:
    """amax of the input of every FP8 GEMM (by weight name), over the reference model run on `steps`.

    `steps`: step-graph feeds (names from `names.py`) played in order with the pools carried between
    them, exactly as the runtime plays them; or a `calibration.PromptBatch`, played as its prefill and
    then the denoise step that prefill's own logits fill (`calibration_steps` without playing the
    prefill twice: one pass over the weights fewer, which at full size is a pass over 64 GiB).
    `model`: the reference model (default: loaded whole; at full size `stream_calib.streamed_model`,
    one layer's weights resident at a time).
    """
    from clover_export.core.config import load_config
    from clover_export.model.loading import load_model
    from clover_export.model.model import allocate_pools

    cfg = load_config(model_dir)
    if model is None:
        model = load_model(model_dir, torch.float32, block_size=block_size)
    wanted = {n for n in fp8_weight_names(cfg, include_lm_head) if ".experts." not in n}  # experts: bf16 activations
    amax: dict[str, float] = {}
    hooks = []
    for mod_name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear) and f"{mod_name}.weight" in wanted:
            def hook(m, args, name=f"{mod_name}.weight"):
                amax[name] = max(amax.get(name, 0.0), float(args[0].detach().abs().max()))
            hooks.append(mod.register_forward_pre_hook(hook))
    batch = steps if isinstance(steps, PromptBatch) else None
    count = 2 if batch is not None else len(steps)
    pool_len = batch.pool_len() if batch is not None else step_pool_len(steps, block_size)
    pools = logits = None
    try:
        with torch.no_grad():
            for i in range(count):
                if batch is None:
                    feeds = steps[i]
                else:  # the denoise step is filled from the prefill's logits
                    feeds = batch.prefill_step() if i == 0 else batch.denoise_step(logits.numpy())
                if pools is None:
                    pools = allocate_pools(cfg, int(feeds["slot_ids"].max()) + 1, pool_len)
                if i == count - 1 and not include_lm_head:  # logits never read: no lm_head GEMM (0.3 TFLOP full size)
                    model.logits = lambda h: h[..., :0]
                logits, _, pools = model.step({k: torch.from_numpy(np.asarray(v)) for k, v in feeds.items()}, pools)
    finally:
        for h in hooks:
            h.remove()
        model.__dict__.pop("logits", None)
    missing = wanted - set(amax)
    if missing:
        raise CloverError("fp8", f"calibration saw no input for {sorted(missing)[:3]}", "an exporter bug")
    return amax


def step_pool_len(steps: list[dict], block_size: int) -> int:
    return max(int(f["past_len"].max()) + f["input_ids"].shape[1] for f in steps) + block_size
