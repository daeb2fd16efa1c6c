"""Score a model on held-out prompts with the runtime's LowConfidence loop (DECODING.md 1-2).

Greedy decoding through `clover_export.runtime` (scheduler, runner, torch
backend on the in-memory model), with every control of DECODING.md 3 off
(the trained model's generation config has them off too): per request the
prompt is one prefill chunk folded into the first denoise step of block 0,
the commit of block b is folded into the first denoise step of block b + 1,
and a block stops once an end token is filled with every position before it
filled. Needs no model folder, so training can score itself.

`score_ar` scores the next-token (autoregressive) mode without the runtime:
`generate_ar` is a plain greedy loop over the reference model that feeds the
prompt + the tokens so far as causal rows (no block, empty caches each
forward) and appends the argmax of the last causal row's logits, the mask
token excluded, until an end token or max_new_tokens. It applies no
generation control (DECODING.md 3): the trained model's generation config
has them neutral, and nothing here reads it.

`score_tools` scores the tool task (tasks.py) with the same loop, both turns:
the call must parse, by the server's own `qwen3_coder` parser, into exactly
one call of the task's tool with the prompt's list as its arguments and no
other content; the answer after the tool's result must equal that result. The
second turn's prompt holds the expected call, as a client sends the call back.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from clover_export.core.generation import GenerationSettings
from clover_export.model.model import CloverModel
from clover_export.train.data import ChatCodec
from clover_export.train.tasks import Example, ToolCase, is_correct, tool_case

# greedy LowConfidence with the generation controls off (DECODING.md 3: repetition 1, other strengths 0)
NO_CONTROLS = dict(repetition_penalty=1.0, frequency_penalty=0.0, presence_penalty=0.0,
                   dllm_length_penalty=0.0, dllm_think_end_bias=0.0)


@dataclass
class Decoded:
    token_ids: list[int]  # response, cut after the first end token (kept) and at max_new_tokens
    steps: int  # denoise forwards (the folded prefill / commits included)
    blocks: int
    coreset_sum: float = 0.0  # sum over steps of the mean |kept set| over layers

    @property
    def tokens_per_forward(self) -> float:
        return len(self.token_ids) / max(self.steps, 1)

    @property
    def experts_per_block(self) -> float:
        return self.coreset_sum / max(self.steps, 1)


@torch.no_grad()
def generate(model: CloverModel, prompts: list[list[int]], threshold: float, end_ids: list[int],
             max_new_tokens: int = 32) -> list[Decoded]:
    """Greedy block decoding of a batch of prompts through the runtime loop, all stepping together."""
    from clover_export.backends.torch_backend import TorchBackend
    from clover_export.runtime.loop import Loop
    from clover_export.runtime.request import Request
    from clover_export.runtime.runner import Runner
    from clover_export.runtime.scheduler import Scheduler

    cfg, N = model.cfg, model.block_size
    mask_id = cfg.require_mask_token()
    settings = GenerationSettings(threshold=threshold, max_new_tokens=max_new_tokens, eos_token_id=tuple(end_ids),
                                  **NO_CONTROLS).validate(cfg.vocab_size)
    longest = max(len(p) for p in prompts)
    runner = Runner(TorchBackend(model), len(prompts), longest + -(-max_new_tokens // N) * N, mask_id)
    loop = Loop(Scheduler(len(prompts), N, prefill_chunk=longest), runner)
    reqs = [Request(list(p), max_new_tokens, frozenset(end_ids), N, mask_id, cfg.block_alignment, params=settings)
            for p in prompts]
    for req in reqs:
        loop.add(req)
    while loop.has_work():
        for event in loop.step():
            if event.error is not None:
                raise event.error
    return [Decoded(r.response, r.denoise_steps, r.blocks, r.coreset_sum) for r in reqs]


@torch.no_grad()
def generate_ar(model: CloverModel, prompts: list[list[int]], end_ids: list[int], max_new_tokens: int = 32,
                pad_id: int = 0) -> list[list[int]]:
    """Greedy next-token decoding: per forward one token per unfinished prompt from its last causal row.

    Each forward recomputes prompt + response from empty caches (`model.causal_hidden`, block rows
    all mask tokens); a response is cut after its first end token (kept) or at max_new_tokens."""
    N, mask_id = model.block_size, model.cfg.require_mask_token()
    seqs = [list(p) for p in prompts]
    out: list[list[int]] = [[] for _ in prompts]
    live = list(range(len(prompts)))
    for _ in range(max_new_tokens):
        if not live:
            break
        B, C = len(live), max(len(seqs[i]) for i in live)
        ids = torch.full((B, C + N), pad_id, dtype=torch.long)
        ids[:, C:] = mask_id
        for r, i in enumerate(live):
            ids[r, :len(seqs[i])] = torch.tensor(seqs[i])
        n_causal = torch.tensor([len(seqs[i]) for i in live], dtype=torch.int32)
        h = model.causal_hidden(ids, n_causal)
        last = h[torch.arange(B), n_causal.long() - 1]
        logits = model.logits(last)
        logits[:, mask_id] = float("-inf")
        nxt = logits.argmax(-1).tolist()
        for i, t in zip(live, nxt):
            seqs[i].append(t)
            out[i].append(t)
        live = [i for i in live if out[i][-1] not in end_ids and len(out[i]) < max_new_tokens]
    return out


@dataclass
class ArScore:
    accuracy: float  # percent
    results: list[tuple[Example, str, bool]]

    @property
    def accuracy_by_items(self) -> dict[int, float]:
        return percent_correct_by_items(self.results)


def score_ar(model: CloverModel, codec: ChatCodec, examples: list[Example], enable_thinking: bool = False,
             batch_size: int = 64, max_new_tokens: int = 32) -> ArScore:
    """`generate_ar` on every example and check its answer (exact match), one token per forward."""
    results, _ = _answer_all(codec, examples, enable_thinking, batch_size,
                             lambda prompts, end_ids: generate_ar(model, prompts, end_ids, max_new_tokens,
                                                                  pad_id=codec.eot))
    return ArScore(_percent_correct(results), results)


def _answer_all(codec: ChatCodec, examples: list[Example], enable_thinking: bool, batch_size: int, decode,
                token_ids=lambda out: out) -> tuple[list[tuple[Example, str, bool]], list]:
    """The examples' prompts through `decode(prompt id lists, end ids)` (one output each) `batch_size` at a
    time; returns (example, answer text without end tokens, correct) per example, and the outputs.
    `token_ids(output)`: the response ids of an output."""
    end_ids = [codec.im_end, codec.eot]
    results, outs = [], []
    for s in range(0, len(examples), batch_size):
        chunk = examples[s:s + batch_size]
        for ex, out in zip(chunk, decode([codec.prompt_ids(ex.prompt, enable_thinking) for ex in chunk], end_ids)):
            text = codec.tokenizer.decode([t for t in token_ids(out) if t not in end_ids])
            results.append((ex, text, is_correct(ex, text)))
            outs.append(out)
    return results, outs


def _percent_correct(results: list[tuple[Example, str, bool]]) -> float:
    """Percent of the results judged correct."""
    return 100.0 * sum(r[2] for r in results) / len(results)


def percent_correct_by_items(results: list[tuple[Example, str, bool]]) -> dict[int, float]:
    """Percent judged correct per input length (the list's number of items), shortest first."""
    lengths = sorted({ex.items for ex, _, _ in results})
    return {n: _percent_correct([r for r in results if r[0].items == n]) for n in lengths}


@dataclass
class Score:
    accuracy: float  # percent
    tokens_per_forward: float  # total response tokens / total denoise steps
    forwards_per_block: float
    experts_per_block: float  # mean |kept set| over layers and steps
    results: list[tuple[Example, str, bool]]

    @property
    def accuracy_by_items(self) -> dict[int, float]:
        return percent_correct_by_items(self.results)

    def line(self) -> str:
        return (f"acc={self.accuracy:.1f}% tpf={self.tokens_per_forward:.2f} "
                f"fwd/block={self.forwards_per_block:.2f} experts/block={self.experts_per_block:.2f}")


def score(model: CloverModel, codec: ChatCodec, examples: list[Example], threshold: float = 0.95,
          enable_thinking: bool = False, batch_size: int = 64, max_new_tokens: int = 32) -> Score:
    """Decode every example and check its answer (exact match)."""
    results, decoded = _answer_all(codec, examples, enable_thinking, batch_size,
                                   lambda prompts, end_ids: generate(model, prompts, threshold, end_ids,
                                                                     max_new_tokens),
                                   token_ids=lambda d: d.token_ids)
    tokens = sum(len(d.token_ids) for d in decoded)
    steps = sum(d.steps for d in decoded)
    return Score(
        accuracy=_percent_correct(results),
        tokens_per_forward=tokens / steps,
        forwards_per_block=steps / sum(d.blocks for d in decoded),
        experts_per_block=sum(d.coreset_sum for d in decoded) / steps,
        results=results,
    )


TOOL_MAX_NEW_TOKENS = 128  # the longest call (8 digits, thinking mode) is 102 tokens with its end token


@dataclass
class ToolScore:
    call_accuracy: float  # percent of first turns that are the expected call, and only it
    answer_accuracy: float  # percent of second turns that answer the tool's result
    tokens_per_forward: float  # over both turns
    results: list[tuple[ToolCase, str, str, bool, bool]]  # case, call text, answer text, call ok, answer ok

    @property
    def accuracy(self) -> float:
        """Percent of cases with both turns right."""
        return 100.0 * sum(r[3] and r[4] for r in self.results) / len(self.results)

    def line(self) -> str:
        return (f"tools: call={self.call_accuracy:.1f}% answer={self.answer_accuracy:.1f}% "
                f"both={self.accuracy:.1f}% tpf={self.tokens_per_forward:.2f}")


def call_is_correct(case: ToolCase, text: str) -> bool:
    """`text` (an assistant turn, thinking included) is one call of the case's tool with its arguments, alone."""
    from clover_export.serve.tool_calls import XmlToolCalls

    if "</think>" in text:
        text = text.split("</think>", 1)[1]
    content, calls = XmlToolCalls.parse(text, case.tool_specs())
    return (not content.strip() and len(calls) == 1 and calls[0].name == case.name
            and json.loads(calls[0].arguments) == case.arguments)


def score_tools(model: CloverModel, codec: ChatCodec, examples: list[Example], threshold: float = 0.95,
                enable_thinking: bool = False, batch_size: int = 64) -> ToolScore:
    """Both turns of the tool task for each example, decoded greedily by the runtime loop."""
    end_ids = [codec.im_end, codec.eot]
    results, tokens, steps = [], 0, 0
    for s in range(0, len(examples), batch_size):
        cases = [tool_case(ex) for ex in examples[s:s + batch_size]]
        turns = [codec.tool_turns(c, enable_thinking) for c in cases]
        texts = []
        for t in range(2):
            decoded = generate(model, [tt[t][0] for tt in turns], threshold, end_ids, TOOL_MAX_NEW_TOKENS)
            tokens += sum(len(d.token_ids) for d in decoded)
            steps += sum(d.steps for d in decoded)
            texts.append([codec.tokenizer.decode([i for i in d.token_ids if i not in end_ids]) for d in decoded])
        for case, call, answer in zip(cases, *texts):
            results.append((case, call, answer, call_is_correct(case, call), is_correct(case.example, answer)))
    n = len(results)
    return ToolScore(100.0 * sum(r[3] for r in results) / n, 100.0 * sum(r[4] for r in results) / n,
                     tokens / steps, results)


def load_for_eval(model_dir: str | Path, top_p: float | None = None, dtype=torch.float32) -> CloverModel:
    """The reference model of a folder, with the coreset top_p overridden when given."""
    from clover_export.core.checkpoint import load_state_dict
    from clover_export.core.config import load_config
    from clover_export.model.loading import build_model

    cfg = load_config(model_dir)
    if top_p is not None:
        cfg = cfg.replace(moe_block_coreset_top_p=top_p)
    model = build_model(cfg, dtype, device="meta")
    model.load_state_dict(load_state_dict(Path(model_dir), cfg, dtype=dtype), strict=True, assign=True)
    return model.eval()
