"""Chat-template rendering and block-diffusion batches (MODEL.md 5.1).

One training example is one forward step from empty caches: the rendered
prompt as causal rows (left-aligned, `n_causal` per row, padded) and one
block of `block_size` block rows holding the response, its `<|im_end|>` and
`<|endoftext|>` padding, of which a random subset is replaced by the mask
token. The loss is taken on the masked block positions only.

The next-token (causal) mode sees the same example as one causal sequence,
prompt + response + `<|im_end|>`, teacher-forced: causal row t predicts token
t + 1, with the loss on the rows that predict the response and its end token.
Its block rows are all mask tokens and the step has no block (`has_block` 0),
so it is a separate forward from the example's masked block, whose clean
positions would otherwise show the causal rows their answers.

A response longer than one block (a tool call) is trained one block at a
time, as the decoding loop meets it: block j of the response (blocks start
where the prompt ends, MODEL.md 5.1 `prompt_end`) is the step's block, and the
prompt plus the response's first j blocks are its causal rows (`block_at`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import jinja2
import torch
from tokenizers import Tokenizer

from clover_export.tiny import tokenizer_assets as tok_assets
from clover_export.train.tasks import Example, ToolCase, tool_call_text

THINK_CLOSE = "\n</think>\n\n"  # what a thinking-mode response starts with when it has no reasoning


class ChatCodec:
    """Tokenizer + chat template of a model folder (DECODING.md 1 step 1)."""

    def __init__(self, model_dir: str | Path):
        model_dir = Path(model_dir)
        self.tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
        self.template = env.from_string((model_dir / "chat_template.jinja").read_text())
        ids = tok_assets.special_token_ids()
        self.im_end, self.eot = ids["<|im_end|>"], ids["<|endoftext|>"]
        self.mask = ids[tok_assets.MASK_TOKEN]

    def prompt_ids(self, user: str, enable_thinking: bool) -> list[int]:
        text = self.template.render(messages=[{"role": "user", "content": user}],
                                    add_generation_prompt=True, enable_thinking=enable_thinking)
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def render_ids(self, messages: list[dict], enable_thinking: bool, tools: list[dict] | None = None) -> list[int]:
        """A conversation with the generation prompt, as the server renders it (arguments as objects)."""
        text = self.template.render(messages=messages, tools=tools, add_generation_prompt=True,
                                    enable_thinking=enable_thinking)
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def tool_turns(self, case: ToolCase, enable_thinking: bool) -> list[tuple[list[int], str]]:
        """The tool task's two turns, (prompt ids, the assistant text it should produce) each: the call, then
        after the tool's result (the example's answer) in a `tool` message, that result."""
        ex, tools = case.example, case.tool_specs()
        user = {"role": "user", "content": ex.prompt}
        sent = {"id": "call_0", "type": "function", "function": {"name": case.name, "arguments": case.arguments}}
        after = [user, {"role": "assistant", "content": "", "tool_calls": [sent]},
                 {"role": "tool", "content": ex.answer}]
        return [(self.render_ids([user], enable_thinking, tools), tool_call_text(case.name, case.arguments)),
                (self.render_ids(after, enable_thinking, tools), ex.answer)]

    def response_ids(self, answer: str, enable_thinking: bool) -> list[int]:
        """The assistant tokens the model should produce, without the end token."""
        text = (THINK_CLOSE if enable_thinking else "") + answer
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def block_target(self, answer: str, enable_thinking: bool, block_size: int) -> list[int]:
        """Response, `<|im_end|>`, then `<|endoftext|>` up to the block end."""
        response = self.response_ids(answer, enable_thinking)
        if len(response) + 1 > block_size:
            raise ValueError(f"response of {len(response) + 1} tokens does not fit one block of {block_size}")
        return self.block_at([], response, block_size, 0)[1]

    def block_at(self, prompt: list[int], response: list[int], block_size: int, j: int) -> tuple[list[int], list[int]]:
        """(causal ids, block target) of block j of `response` (its ids, `response_ids`): the prompt and the
        response's first j blocks, then block j's tokens, `<|im_end|>` after the response's last, `<|endoftext|>`
        to the block's end."""
        ids = response + [self.im_end]
        if not 0 <= j < blocks_of(len(ids), block_size):
            raise ValueError(f"response of {len(ids)} tokens has no block {j} of {block_size}")
        target = ids[j * block_size:(j + 1) * block_size]
        return prompt + ids[:j * block_size], target + [self.eot] * (block_size - len(target))

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)


def blocks_of(tokens: int, block_size: int) -> int:
    """Blocks a response of `tokens` tokens (its end token included) spans."""
    return -(-tokens // block_size)


@dataclass
class CausalBatch:
    input_ids: torch.Tensor  # [B, C + N]: prompt + response + <|im_end|> as causal rows (padded), then N masks
    n_causal: torch.Tensor  # [B] int32
    targets: torch.Tensor  # [B, C]: the token after each causal row (pad where there is none)
    scored: torch.Tensor  # [B, C] bool: the rows predicting a response token or the end token (the loss rows)


@dataclass
class Batch:
    input_ids: torch.Tensor  # [B, C + N]: causal rows (left-aligned, padded) then block rows
    n_causal: torch.Tensor  # [B] int32
    targets: torch.Tensor  # [B, N] clean block tokens
    masked: torch.Tensor  # [B, N] bool: positions replaced by the mask token (the loss positions)
    causal: CausalBatch | None = None  # the same examples in the next-token mode (a forward of its own)


def make_causal_batch(prompts: list[list[int]], responses: list[list[int]], end_id: int, mask_id: int,
                      pad_id: int, block_size: int) -> CausalBatch:
    """Teacher-forced next-token batch: row t of prompt + response + [end_id] predicts token t + 1."""
    seqs = [p + r + [end_id] for p, r in zip(prompts, responses)]
    B, C = len(seqs), max(len(s) for s in seqs)
    causal = torch.full((B, C), pad_id, dtype=torch.long)
    targets = torch.full((B, C), pad_id, dtype=torch.long)
    scored = torch.zeros(B, C, dtype=torch.bool)
    for i, (p, s) in enumerate(zip(prompts, seqs)):
        causal[i, :len(s)] = torch.tensor(s)
        targets[i, :len(s) - 1] = torch.tensor(s[1:])
        scored[i, len(p) - 1:len(s) - 1] = True
    block = torch.full((B, block_size), mask_id, dtype=torch.long)
    return CausalBatch(torch.cat([causal, block], dim=1), torch.tensor([len(s) for s in seqs], dtype=torch.int32),
                       targets, scored)


def encode(codec: ChatCodec, examples: list[Example], thinking: list[bool], block_size: int):
    """(prompt id lists, block targets [B, N])."""
    prompts = [codec.prompt_ids(ex.prompt, t) for ex, t in zip(examples, thinking)]
    targets = torch.tensor([codec.block_target(ex.answer, t, block_size) for ex, t in zip(examples, thinking)])
    return prompts, targets


def make_batch(prompts: list[list[int]], targets: torch.Tensor, mask_id: int, pad_id: int,
               gen: torch.Generator) -> Batch:
    """Mask k ~ U{1..N} block positions per example, chosen uniformly (exact-count masking)."""
    B, N = targets.shape
    C = max(len(p) for p in prompts)
    causal = torch.full((B, C), pad_id, dtype=torch.long)
    for i, p in enumerate(prompts):
        causal[i, :len(p)] = torch.tensor(p)
    k = torch.randint(1, N + 1, (B, 1), generator=gen)
    ranks = torch.rand(B, N, generator=gen).argsort(dim=1).argsort(dim=1)  # a random permutation per row
    masked = ranks < k
    block = torch.where(masked, torch.full_like(targets, mask_id), targets)
    return Batch(torch.cat([causal, block], dim=1), torch.tensor([len(p) for p in prompts], dtype=torch.int32),
                 targets, masked)
