"""The training loop through the reference model: block diffusion (MODEL.md 5.1-5.3) + next-token.

Objective: `block_loss + ar_weight * ar_loss` per step, on the same examples.
Block diffusion: per example, the prompt as causal rows and one block of the
response (+ `<|im_end|>`, `<|endoftext|>` padding) with k ~ U{1..N} of its N
positions masked; cross-entropy on the masked positions, averaged over all
masked positions of the batch. We use the plain mean rather than LLaDA's
1/ratio weighting: the tasks are deterministic, so we need accurate
predictions at every mask ratio rather than a likelihood bound, and the 1/ratio
weight mostly adds variance by up-weighting examples with one or two masks.
Block rows route through the expert coreset exactly as at inference
(config `moe_block_coreset_top_p`).
Next-token (`ar_loss`): the example as causal rows, prompt + response +
`<|im_end|>`, in a forward of its own with no block (data.py); cross-entropy
of each response row's next token, averaged over those rows of the batch. It
teaches the causal rows' logits (the step's `causal_logits`) to continue the
response, which the autoregressive and self-speculative decoding modes read.
`ar_weight` 0 skips that forward: the block-diffusion objective alone, as
the embedded default's first stage was trained.
Tool task (`tool_batch_size` > 0): a second batch a step, of tool-task turns
(tasks.py; two calls to one answer after the tool's result: a call is 2-3
blocks of exact copying, the answer is the model's own task again), with
the same two losses in forwards of its own, so that its longer prompts do not
pad the task batch; for a call, one of its blocks drawn uniformly (data.py
`block_at`). The step's loss adds the two batches' objectives.
Deterministic for a seed and thread count.
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
from clover_export.train.data import (
    Batch,
    CausalBatch,
    ChatCodec,
    blocks_of,
    encode,
    make_batch,
    make_causal_batch,
)


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
    eval_count: int = 48  # held-out prompts scored at each eval (threshold 0.95, and next-token greedy)
    ar_weight: float = 1.0  # weight of the next-token loss (0: block diffusion alone, no causal forward)
    min_items: int = tasks.MIN_ITEMS  # shortest training list (3: the stream of the default's first two stages)
    tool_batch_size: int = 0  # tool-task turns a step, in a batch of their own (0: none)


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


def ar_loss(model: CloverModel, batch: CausalBatch) -> torch.Tensor:
    """Mean next-token cross-entropy over the scored causal rows of one causal-only step from empty caches."""
    C = batch.input_ids.shape[1] - model.block_size
    h = model.causal_hidden(batch.input_ids, batch.n_causal)
    return F.cross_entropy(model.logits(h[:, :C][batch.scored]), batch.targets[batch.scored])


class Batches:
    """Deterministic batch stream for a seed: examples, thinking flags and masks."""

    def __init__(self, codec: ChatCodec, settings: TrainSettings, block_size: int, exclude: set[str]):
        self.codec, self.s, self.N = codec, settings, block_size
        self.examples = tasks.training_stream(settings.seed, exclude, settings.min_items)
        self.rng = random.Random(settings.seed + 1)
        self.gen = torch.Generator().manual_seed(settings.seed + 2)
        self.tool_examples = tasks.training_stream(settings.seed + 3, exclude, settings.min_items)
        self.tool_rng = random.Random(settings.seed + 4)

    def next_tools(self) -> Batch:
        """A batch of tool-task turns: two calls (one block of each, drawn uniformly) to one answer."""
        causal, targets, prompts, responses = [], [], [], []
        for i in range(self.s.tool_batch_size):
            case = tasks.tool_case(next(self.tool_examples))
            thinking = self.tool_rng.random() < self.s.thinking_fraction
            prompt, answer = self.codec.tool_turns(case, thinking)[int(i % 3 == 2)]  # two calls, then an answer
            ids = self.codec.response_ids(answer, thinking)
            j = self.tool_rng.randrange(blocks_of(len(ids) + 1, self.N))
            rows, target = self.codec.block_at(prompt, ids, self.N, j)
            causal.append(rows)
            targets.append(target)
            prompts.append(prompt)
            responses.append(ids)
        batch = make_batch(causal, torch.tensor(targets), self.codec.mask, self.codec.eot, self.gen)
        if self.s.ar_weight:
            batch.causal = make_causal_batch(prompts, responses, self.codec.im_end, self.codec.mask,
                                             self.codec.eot, self.N)
        return batch

    def next(self) -> Batch:
        exs = [next(self.examples) for _ in range(self.s.batch_size)]
        thinking = [self.rng.random() < self.s.thinking_fraction for _ in exs]
        prompts, targets = encode(self.codec, exs, thinking, self.N)
        batch = make_batch(prompts, targets, self.codec.mask, self.codec.eot, self.gen)
        if self.s.ar_weight:  # no random draws: the block batches are the same whatever the weight
            responses = [self.codec.response_ids(ex.answer, t) for ex, t in zip(exs, thinking)]
            batch.causal = make_causal_batch(prompts, responses, self.codec.im_end, self.codec.mask,
                                             self.codec.eot, self.N)
        return batch


def by_items(percents: dict[int, float]) -> dict[str, float]:
    """A per-length accuracy table as JSON keeps it (string keys, rounded percents)."""
    return {str(n): round(v, 2) for n, v in percents.items()}


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
    running = {"block": None, "ar": None}  # exponential moving averages (0.95) of the losses
    if settings.tool_batch_size:
        running.update({"tool_block": None, "tool_ar": None})
    model.train()
    for step in range(settings.steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(settings, step)
        batch = batches.next()
        parts = {"block": block_loss(model, batch)}
        if batch.causal is not None:
            parts["ar"] = ar_loss(model, batch.causal)
        if settings.tool_batch_size:
            tools_batch = batches.next_tools()
            parts["tool_block"] = block_loss(model, tools_batch)
            if tools_batch.causal is not None:
                parts["tool_ar"] = ar_loss(model, tools_batch.causal)
        loss = sum(settings.ar_weight * v if k.endswith("ar") else v for k, v in parts.items())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), settings.grad_clip)
        opt.step()
        for k, v in parts.items():
            running[k] = v.item() if running[k] is None else 0.95 * running[k] + 0.05 * v.item()
        done = step + 1
        if done % 25 == 0 or done == settings.steps:
            history.append([done, *(None if v is None else round(v, 4) for v in running.values())])
            shown = " ".join(f"{k} {v:.4f}" for k, v in running.items() if v is not None)
            log(f"step {done}/{settings.steps} loss {loss.item():.4f} avg {shown} "
                f"lr {lr_at(settings, step):.2e} {time.time() - start:.0f}s")
        if settings.eval_every and (done % settings.eval_every == 0 or done == settings.steps):
            from clover_export.train.evaluate import score, score_ar, score_tools

            model.eval()
            sc = score(model, codec, heldout[: settings.eval_count], threshold=0.95)
            ar = score_ar(model, codec, heldout[: settings.eval_count])
            tools = score_tools(model, codec, heldout[: settings.eval_count]) if settings.tool_batch_size else None
            model.train()
            evals.append({"step": done, "accuracy": sc.accuracy, "tokens_per_forward": sc.tokens_per_forward,
                          "ar_accuracy": ar.accuracy, "accuracy_by_items": by_items(sc.accuracy_by_items),
                          "ar_accuracy_by_items": by_items(ar.accuracy_by_items)})
            if tools is not None:
                evals[-1].update(tool_call_accuracy=tools.call_accuracy, tool_answer_accuracy=tools.answer_accuracy)
            log(f"eval step {done}: {sc.line()} | next-token greedy acc={ar.accuracy:.1f}% | by items "
                f"{evals[-1]['accuracy_by_items']} | next-token {evals[-1]['ar_accuracy_by_items']}"
                + (f" | {tools.line()}" if tools is not None else ""))
    model.eval()
    return {"settings": asdict(settings), "wall_seconds": round(time.time() - start, 1),
            "final_block_loss_avg": round(running["block"], 5),
            "final_ar_loss_avg": None if running["ar"] is None else round(running["ar"], 5),
            **({"final_tool_losses_avg": {k: round(running[k], 5) for k in ("tool_block", "tool_ar")
                                          if running[k] is not None}} if settings.tool_batch_size else {}),
            "loss_avg_every_25_steps": {"columns": ["step", *running], "rows": history}, "evals": evals}


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
