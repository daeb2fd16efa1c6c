"""The block-diffusion training loop through the reference model (MODEL.md 5.1-5.3).

Objective: per example, the prompt as causal rows and one block of the
response (+ `<|im_end|>`, `<|endoftext|>` padding) with k ~ U{1..N} of its N
positions masked; cross-entropy on the masked positions, averaged over all
masked positions of the batch. We use the plain mean rather than LLaDA's
1/ratio weighting: the tasks are deterministic, so we need accurate
predictions at every mask ratio rather than a likelihood bound, and the 1/ratio
weight mostly adds variance by up-weighting examples with one or two masks.
Block rows route through the expert coreset exactly as at inference
(config `moe_block_coreset_top_p`). Deterministic for a seed and thread count.
"""

from __future__ import annotations

import json
import math
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from clover_export.core.config import config_from_dict
from clover_export.model.loading import build_model
from clover_export.model.model import CloverModel, allocate_pools, init_random_
from clover_export.train import tasks
from clover_export.train.data import Batch, ChatCodec, encode, make_batch


@dataclass
class TrainSettings:
    steps: int = 1500  # the shipped run (clover_export/tiny/trained/training.json)
    batch_size: int = 32
    lr: float = 3e-3
    min_lr_ratio: float = 0.05
    warmup: int = 100
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    seed: int = 0
    thinking_fraction: float = 0.5  # share of examples rendered with enable_thinking=True
    eval_every: int = 500
    eval_count: int = 48  # held-out prompts scored at each eval (threshold 0.95)


def lr_at(s: TrainSettings, step: int) -> float:
    """Linear warmup, then cosine decay to min_lr_ratio * lr."""
    if step < s.warmup:
        return s.lr * (step + 1) / s.warmup
    t = (step - s.warmup) / max(1, s.steps - s.warmup)
    return s.lr * (s.min_lr_ratio + (1 - s.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * t)))


def block_loss(model: CloverModel, batch: Batch) -> torch.Tensor:
    """Mean cross-entropy over the masked block positions of one step from empty caches."""
    B = batch.input_ids.shape[0]
    C = batch.input_ids.shape[1] - model.block_size
    pools = allocate_pools(model.cfg, B, max(C, 1), dtype=model.dtype)
    zeros = torch.zeros(B, dtype=torch.int32)
    logits, _coreset, *_ = model(batch.input_ids, batch.n_causal, torch.ones(B, dtype=torch.int32),
                                 torch.arange(B, dtype=torch.int32), zeros, zeros[:, None], *pools.values())
    return F.cross_entropy(logits[batch.masked], batch.targets[batch.masked])


class Batches:
    """Deterministic batch stream for a seed: examples, thinking flags and masks."""

    def __init__(self, codec: ChatCodec, settings: TrainSettings, block_size: int, exclude: set[str]):
        self.codec, self.s, self.N = codec, settings, block_size
        self.examples = tasks.training_stream(settings.seed, exclude)
        self.rng = random.Random(settings.seed + 1)
        self.gen = torch.Generator().manual_seed(settings.seed + 2)

    def next(self) -> Batch:
        exs = [next(self.examples) for _ in range(self.s.batch_size)]
        thinking = [self.rng.random() < self.s.thinking_fraction for _ in exs]
        prompts, targets = encode(self.codec, exs, thinking, self.N)
        return make_batch(prompts, targets, self.codec.mask, self.codec.eot, self.gen)


def new_model(cfg_dict: dict, seed: int) -> CloverModel:
    """fp32 reference model with the deterministic random init of `init_random_`."""
    return init_random_(build_model(config_from_dict(cfg_dict, source="<train>")), seed=seed)


def train(model: CloverModel, codec: ChatCodec, settings: TrainSettings, log=print,
          heldout: list[tasks.Example] | None = None) -> dict:
    """Run `settings.steps` optimizer steps in place; returns training facts (losses, timings, evals)."""
    torch.manual_seed(settings.seed)
    heldout = heldout if heldout is not None else tasks.heldout_examples()
    batches = Batches(codec, settings, model.block_size, {ex.prompt for ex in heldout})
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": settings.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=settings.lr, betas=(0.9, 0.98))
    history, evals = [], []
    start = time.time()
    running = None
    model.train()
    for step in range(settings.steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(settings, step)
        loss = block_loss(model, batches.next())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), settings.grad_clip)
        opt.step()
        running = loss.item() if running is None else 0.95 * running + 0.05 * loss.item()
        done = step + 1
        if done % 25 == 0 or done == settings.steps:
            history.append([done, round(running, 4)])
            log(f"step {done}/{settings.steps} loss {loss.item():.4f} avg {running:.4f} "
                f"lr {lr_at(settings, step):.2e} {time.time() - start:.0f}s")
        if settings.eval_every and (done % settings.eval_every == 0 or done == settings.steps):
            from clover_export.train.evaluate import score

            model.eval()
            sc = score(model, codec, heldout[: settings.eval_count], threshold=0.95)
            model.train()
            evals.append({"step": done, "accuracy": sc.accuracy, "tokens_per_forward": sc.tokens_per_forward})
            log(f"eval step {done}: {sc.line()}")
    model.eval()
    return {"settings": asdict(settings), "wall_seconds": round(time.time() - start, 1),
            "final_loss_avg": round(running, 5), "loss_avg_every_25_steps": history, "evals": evals}


def save_trained(model: CloverModel, cfg_dict: dict, out_dir: Path, facts: dict,
                 generation_config: dict) -> Path:
    """Write the model folder (BF16 safetensors, config, generation config, tokenizer) + training.json."""
    import tempfile

    from clover_export.core.checkpoint import save_checkpoint
    from clover_export.tiny import tokenizer_assets as tok

    with tempfile.TemporaryDirectory() as tmp:
        tok.build_tokenizer_files(Path(tmp))
        extra = {p.name: p.read_text() for p in Path(tmp).iterdir()}
    extra["config.json"] = json.dumps(cfg_dict, indent=2) + "\n"
    extra["generation_config.json"] = json.dumps(generation_config, indent=2) + "\n"
    extra["training.json"] = json.dumps(facts, indent=2) + "\n"
    state = {k: v.detach().to(torch.bfloat16) for k, v in model.state_dict().items()}
    return save_checkpoint(state, out_dir, extra_files=extra)
