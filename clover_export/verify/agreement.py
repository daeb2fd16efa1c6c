"""FP8 agreement: an FP8 graph against the graph it was quantized from (STEP_GRAPH.md 4).

Both graphs play the held-out prompts in ONNX Runtime as the runtime plays a
request (`calibration.PromptBatch`: prefill folded with a block of masks, then
a block-only step with the more confident half filled from the reference
graph's argmax); their block logits are compared at the masked positions,
the mask token itself left out: top-1 agreement and the logit error.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from clover_export.core import names
from clover_export.core.errors import CloverError
from clover_export.quantize.calibration import prompt_batch

FP8_MIN_AGREEMENT = 0.97  # top-1 agreement an FP8 graph needs with the graph it was quantized from
HELDOUT_PROMPTS = [  # none of them among calibration.BUILTIN_PROMPTS
    "Sort: 6 1 4", "Reverse: 3 3 7 2", "Sort: 2 9 4 4 0", "Reverse: 8 6 5 1 9 2",
    "Tell me a short fact.", "Sort: 1 0 5 7 3 8 2", "Reverse: 5 4", "Say hi in French.",
]


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
    from clover_export.model.model import allocate_pools
    from clover_export.verify.runners import OrtRunner

    ref_art, cand_art = load_artifact(reference_dir), load_artifact(candidate_dir)
    batch = prompt_batch(model_dir, prompts, ref_art.block_size)
    runners = [OrtRunner.load(a, "CPUExecutionProvider") for a in (ref_art, cand_art)]
    first = batch.prefill_step()
    L = first[names.INPUT_IDS].shape[1] + ref_art.block_size
    pools = [{k: v.numpy() for k, v in allocate_pools(ref_art.config, len(prompts), L).items()} for _ in runners]
    agree, total, errs = 0, 0, []
    feeds = first
    for step in range(2):
        outs = []
        for i, runner in enumerate(runners):
            res = runner.run({**feeds, **pools[i]})
            pools[i] = {p: res[names.present_name(p)] for p in pools[i]}
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
    """(report line, passed) of an FP8 artifact against the graph it was quantized from."""
    from clover_export.artifact.manifest import MANIFEST, load_artifact

    source = Path(art.manifest.quantization.source)
    model_dir = art.model_dir
    if art.dtype != "fp32":
        raise CloverError("validate", f"{art.dir}: an FP8 graph on bf16 activations; ONNX Runtime's CPU EP has no "
                          "bf16 kernels", "validate its fp32-activation twin (onnx-fp8 of the same build) instead")
    if not (source / MANIFEST).exists():
        raise CloverError("validate", f"{art.dir}: the graph it was quantized from ({source}) is gone")
    load_artifact(source)
    a = agreement(source, art.dir, model_dir, HELDOUT_PROMPTS)
    return a.line(), a.top1_agreement >= min_agreement
