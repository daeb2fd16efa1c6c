"""Grammar-constrained decoding for `ar` and `self_spec` (docs/structured_output.md, "How the runtime applies
it"). A request with a grammar carries a `RequestGrammar`: its matcher (the grammar's state after the
committed response) and the bitmask rows it fills each step.

- The logit rows (`ar`, `self_spec` verification): row i is masked under the state after the draft's first
  i tokens (`Matcher.fill_draft_masks`), so the AR token of every row is one the grammar allows.
- The block rows (`self_spec`'s next draft): position by position, each masked under the state after the
  draft, the block's greedy choices before it; the walk stops once the grammar is complete. The host keeps a
  draft only as far as the grammar allows it (`allowed_prefix`), so a draft never holds a refused token
  even when the controls or sampling chose differently from the walk.
- Committed tokens are accepted into the matcher (`commit`); a rejected draft never enters the state: the
  walks above roll back what they accepted.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the scheduler imports the strategies without tensor libraries; a grammar brings them
    import torch

    from clover_export.constraints import Matcher


@dataclass
class RequestGrammar:
    matcher: Matcher
    rows: torch.Tensor  # [block_size + 1, words] the logit rows' masks
    walk: torch.Tensor  # [1, words] the block walk's mask

    @classmethod
    def start(cls, grammar, block_size: int) -> "RequestGrammar":
        from clover_export.constraints import allocate_bitmask

        m = grammar.matcher()
        return cls(m, allocate_bitmask(block_size + 1, m.vocab), allocate_bitmask(1, m.vocab))


def mask_logit_rows(g: RequestGrammar, draft: list[int], causal_logits: torch.Tensor) -> None:
    """causal_logits [R, V]: row i (i <= len(draft)) to -inf where the grammar refuses the token after the
    draft's first i tokens. Rows past the first refused draft token stay as they are: acceptance stops there."""
    from clover_export.constraints import apply_bitmask_

    ok = g.matcher.fill_draft_masks(draft, g.rows[:len(draft) + 1])
    apply_bitmask_(causal_logits, g.rows, list(range(ok + 1)))


def mask_block(g: RequestGrammar, draft: list[int], block_logits: torch.Tensor) -> None:
    """block_logits [N, V]: position j masked under the state after the draft and the greedy choices of the
    positions before j, in order, until the grammar is complete; the matcher is left as it was."""
    from clover_export.constraints import apply_bitmask_

    m = g.matcher
    accepted = len(allowed_prefix(g, draft))
    for token in draft[:accepted]:
        m.accept(token)
    if accepted == len(draft):
        for j in range(block_logits.shape[0]):
            if m.is_terminated():
                break
            m.fill_mask(g.walk[0])
            apply_bitmask_(block_logits, g.walk, [j])
            choice = int(block_logits[j].argmax())
            if block_logits[j, choice] == float("-inf") or not m.accept(choice):
                break  # nothing allowed (cannot happen with the engine's masks): leave the rest as it is
            accepted += 1
    m.rollback(accepted)


def allowed_prefix(g: RequestGrammar, draft: list[int]) -> list[int]:
    """The longest prefix of `draft` the grammar allows after the committed response."""
    m, n = g.matcher, 0
    for token in draft:  # nothing follows the end token: a stopped matcher's mask is not to be trusted
        if m.is_terminated() or not m.allowed(token) or not m.accept(token):
            break
        n += 1
    m.rollback(n)
    return draft[:n]


def commit(g: RequestGrammar, tokens: list[int]) -> None:
    """Move the matcher on by the committed tokens (up to its completion)."""
    for token in tokens:
        if g.matcher.is_terminated() or not g.matcher.accept(token):
            return
