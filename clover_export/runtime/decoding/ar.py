"""`ar`: the causal model's own decoding, one token per forward (DECODING.md 5).

After the prompt each step's causal rows are the tokens not yet cached (`ArState.pending`) and the draft
(`ArState.draft`, always empty here; `self_spec` fills it); `logit_rows` names the row of the newest pending
token and one row per draft token. The device verifies (`DeviceWork.VERIFY`): the AR token of each logit row,
or speculative sampling for sampling rows. A fully accepted draft commits every causal row; otherwise the
runner has undone the step's GDN state changes (`StateMover.undo`) and the accepted tokens stay pending.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from clover_export.runtime.decoding.base import DeviceWork, Phase, RowOutput, Rows, Strategy, Verdict
from clover_export.runtime.decoding.grammar import allowed_prefix, commit, mask_logit_rows
from clover_export.runtime.decoding.logprobs import verified


@dataclass
class ArState:
    pending: list[int] = field(default_factory=list)  # response tokens not yet in the caches (the last: newest)
    draft: list[int] = field(default_factory=list)  # unverified tokens after the response


def accept_greedy(draft: list[int], ar_tokens: list[int]) -> tuple[int, int]:
    """(accepted, bonus): the longest prefix of `draft` equal to the AR tokens of its rows, then the AR token
    after it. ar_tokens[i] is the AR choice at logit row i (len(draft) + 1 of them)."""
    m = 0
    while m < len(draft) and draft[m] == ar_tokens[m]:
        m += 1
    return m, ar_tokens[m]


def draft_room(req) -> int:
    """The most draft tokens worth verifying: the response limit leaves room for them plus a bonus token."""
    return max(0, min(req.block_size - 1, req.max_new_tokens - len(req.response) - 1))


def until_end(draft: list[int], end_ids) -> list[int]:
    """The draft up to its first end token, that token included: an accepted end token ends the response
    (Request.append), so nothing after it is ever kept, and verifying it would only cost rows."""
    for i, tok in enumerate(draft):
        if tok in end_ids:
            return draft[:i + 1]
    return draft


def draft_finishes(req) -> bool:
    """Whether the draft, all accepted, ends the request: it ends with an end token, or it and the bonus
    token reach max_new_tokens. Then no block after it can become a next draft (DECODING.md 5)."""
    d = req.state.draft
    return bool(d) and (d[-1] in req.end_ids or len(req.response) + len(d) + 1 >= req.max_new_tokens)


class Ar(Strategy):
    name = "ar"
    device_work = frozenset({DeviceWork.VERIFY})
    block_alignment = False  # one token after another from the prompt's end
    grammar_mode = "ar"
    logit_hook = True  # a request with a grammar: its logit rows masked (runtime/decoding/grammar.py)

    def new_state(self) -> ArState:
        return ArState()

    def rows(self, req, chunk: list[int] | None, fold_commit: bool) -> Rows:
        st = req.state
        if req.phase is Phase.PREFILL:
            if req.prefill_pos + len(chunk) < len(req.prefill_ids):
                return Rows(chunk)
            causal = chunk
        else:
            causal = st.pending + st.draft
        first = len(causal) - len(st.draft) - 1  # the newest pending token's row predicts the first draft token
        block = self.block_rows(req)
        return Rows(causal, block, list(range(first, len(causal))),
                    len(req.response) + len(st.draft) if block is not None else 0, list(st.draft))

    def block_rows(self, req) -> list[int] | None:
        return None

    def seen_counts(self, req) -> Counter:
        c = req.counts.copy()
        c.update(req.state.draft)  # a block drafts what follows the draft
        return c

    def verdict(self, req, out: RowOutput, rows: Rows) -> Verdict | None:
        if not rows.verified_rows:
            return None
        m, bonus = out.sampled
        if m < 0:  # greedy: not sampled on the device
            m, bonus = accept_greedy(rows.draft, out.ar_tokens)
        return Verdict(m, bonus, self.next_draft(out, rows, m, bonus))

    def next_draft(self, out: RowOutput, rows: Rows, accepted: int, bonus: int) -> list[int]:
        return []

    def advance(self, req, row: Rows, out: RowOutput, books) -> bool:
        v = out.verdict
        if v is None:  # a prefill chunk before the prompt's last
            books.commit_rows(req, len(row.causal))
            return False
        st = req.state
        full = v.accepted == len(st.draft)
        new = st.draft[:v.accepted] + [v.bonus]
        if full:
            books.commit_rows(req, len(row.causal))
            st.pending = [v.bonus]
        else:
            st.pending = st.pending + new
        self._count(req, v)
        req.phase = Phase.SPEC
        if req.grammar is not None:
            commit(req.grammar, new)
        lps = verified(out, req.params.logprobs, v.accepted, v.bonus, st.draft, out.sampled[0] >= 0) \
            if req.wants_logprobs else None
        if req.append(new, lps):
            books.finish(req)
            return True
        st.draft = until_end(v.draft[:draft_room(req)], req.end_ids) if full else []
        if req.grammar is not None:  # a draft never holds a token the grammar refuses
            st.draft = allowed_prefix(req.grammar, st.draft)
        return True

    def mask_logits(self, req, block_logits, causal_logits) -> None:
        if req.grammar is not None:
            mask_logit_rows(req.grammar, req.state.draft, causal_logits)

    @staticmethod
    def _count(req, v: Verdict) -> None:
        req.forwards += 1
        if req.state.draft:
            req.verifications += 1
            req.drafted_tokens += len(req.state.draft)
            req.accepted_tokens += v.accepted

    def undoes(self, req, out: RowOutput) -> bool:
        """A rejected draft's rows changed the slot's GDN states: the step is undone for this row."""
        return out.verdict is not None and out.verdict.accepted < len(req.state.draft)

    def resumable_prompt(self, req) -> list[int]:
        return req.prefill_ids[:-1]  # the prompt's last row's logits are read: resume before it at the latest
