"""One request's grammar state, and the token mask on the logits (docs/structured_output.md, Masks).

A bitmask row is `vocab.mask_words` int32 words; bit t % 32 of word t // 32 allows token t. The engine fills
rows on the CPU. `apply_bitmask_` sets the refused logits to -inf in place, on the logits' device: on a GPU
the CPU-filled rows are copied over (pinned, non-blocking: 4 bytes per 32 tokens and row) and unpacked there,
so the fill can overlap the forward pass; only the rows that carry a grammar are touched. A pinned bitmask
must not be refilled before the device has read it: the step's sampled tokens coming back to the host
order that, so a runner keeps one bitmask (`allocate_bitmask` once) and refills it each step.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from clover_export.constraints.vocab import GrammarVocab
from clover_export.core.errors import CloverError


class Matcher:
    """A grammar's state after the tokens accepted so far. `fill_mask` / `allowed` ask what may come next,
    `accept` moves on by one token, `rollback` undoes accepted tokens (a speculative draft's rejected tail)."""

    def __init__(self, engine_matcher, vocab: GrammarVocab):
        self._m = engine_matcher
        self.vocab = vocab
        self._mask: torch.Tensor | None = None  # the current state's mask, unpacked, for `allowed`

    def fill_mask(self, row: torch.Tensor) -> None:
        """Write the mask of the next token into `row` (int32, CPU, contiguous, `vocab.mask_words` long).
        Padding ids (past the tokenizer) are refused; in the error state only the end tokens are allowed."""
        if row.dtype != torch.int32 or row.device.type != "cpu" or not row.is_contiguous() \
                or row.shape != (self.vocab.mask_words,):
            raise CloverError("grammar", f"a mask row must be a contiguous CPU int32 tensor of "
                                         f"{self.vocab.mask_words} words, not {row.dtype} {tuple(row.shape)}")
        self._m.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * row.element_size())

    def allowed(self, token: int) -> bool:
        """Whether the mask allows `token` next (nothing is consumed). The mask, not a byte-wise check: where
        the grammar forces text, the engine allows its canonical tokens only, as a model sees them."""
        if self._mask is None:
            row = torch.empty(self.vocab.mask_words, dtype=torch.int32)
            self.fill_mask(row)
            self._mask = unpack_bitmask(row[None], self.vocab.vocab_size)[0]
        return 0 <= token < self.vocab.vocab_size and bool(self._mask[token])

    def accept(self, token: int) -> bool:
        """Move on by `token`; False when the grammar refuses it (the matcher is then in its error state)."""
        self._mask = None
        return 0 <= token < self.vocab.vocab_size and self._m.consume_token(token)

    def rollback(self, n: int) -> None:
        """Undo the last `n` accepted tokens."""
        self._mask = None
        if n and not self._m.rollback(n):
            raise CloverError("grammar", f"cannot roll back {n} tokens: {self._m.get_error() or 'too many'}")

    def is_terminated(self) -> bool:
        """The grammar is complete and its end token accepted (or it failed): nothing more may come."""
        return self._m.is_stopped()

    @property
    def error(self) -> str | None:
        """The engine's message once a refused token was accepted or a limit was hit."""
        return self._m.get_error() or None

    def fill_draft_masks(self, draft: Sequence[int], rows: torch.Tensor) -> int:
        """Row i of `rows` ([len(draft) + 1, mask_words]): the mask after the draft's first i tokens (the
        rows a speculative step verifies). Stops at the first refused draft token; the state is left as it
        was. Returns how many draft tokens the grammar allows."""
        self.fill_mask(rows[0])
        ok = 0
        for token in draft:
            if not self.allowed(token):
                break
            self.accept(token)
            ok += 1
            self.fill_mask(rows[ok])
        self.rollback(ok)
        return ok


def allocate_bitmask(rows: int, vocab: GrammarVocab) -> torch.Tensor:
    """[rows, mask_words] int32 on the CPU, every token allowed (pinned where a GPU will read it)."""
    return torch.full((rows, vocab.mask_words), -1, dtype=torch.int32, pin_memory=torch.cuda.is_available())


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[rows, words] int32 -> [rows, vocab_size] bool, True where allowed."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1  # arithmetic shift of bit 31 is harmless under & 1
    return bits.view(bitmask.shape[0], -1)[:, :vocab_size].bool()


def apply_bitmask_(logits: torch.Tensor, bitmask: torch.Tensor, rows: Sequence[int]) -> None:
    """logits[rows[k]] = -inf where bitmask[k] refuses, in place; logits: [B, V] on any device. Row by row on
    views of `logits` (no copy of the batch); on a GPU a fused kernel would do every row in one launch."""
    if not rows:
        return
    refused = ~unpack_bitmask(bitmask[:len(rows)].to(logits.device, non_blocking=True), logits.shape[-1])
    for k, i in enumerate(rows):
        logits[i].masked_fill_(refused[k], float("-inf"))


def apply_masks_(logits: torch.Tensor, matchers: Sequence[Matcher | None], bitmask: torch.Tensor | None = None):
    """Mask logits [B, V] in place for the rows whose matcher is not None (the others untouched); `bitmask`
    ([>= rows with a matcher, words], CPU int32) is reused when given."""
    rows = [i for i, m in enumerate(matchers) if m is not None]
    if not rows:
        return
    vocab = matchers[rows[0]].vocab
    if logits.shape != (len(matchers), vocab.vocab_size):
        raise CloverError("grammar", f"logits {tuple(logits.shape)} do not match {len(matchers)} rows of the "
                                     f"grammar's vocab size {vocab.vocab_size}")
    bitmask = allocate_bitmask(len(rows), vocab) if bitmask is None else bitmask
    for k, i in enumerate(rows):
        matchers[i].fill_mask(bitmask[k])
    apply_bitmask_(logits, bitmask, rows)
