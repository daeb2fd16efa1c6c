"""The loop: scheduler and runner joined, one step at a time (DECODING.md 1, 4; nano-vllm's `step()`).

It knows neither the backend nor the tokenizer: requests in, resolved blocks out.

Failure isolation (DECODING.md 4): an exception fails only the requests it
concerns; they leave the batch with `finish_reason` "error" and `error` set,
their slots are freed, and the loop goes on.
- At admission, `Runner.claim` checks the request's host-side state (a
  request built past `Generator.submit`'s checks); it fails that request alone.
- In a step (the backend, or selection on its logits), the exception cannot
  name its rows. The loop undoes the step (`Runner.hold` before it, then
  `StateMover.undo`: the GDN states of the causal rows' slots and the sampling
  rows' generators; the scheduler has not moved on), then re-runs each row alone, undoing each try,
  and fails the rows that raise alone. The others are stepped again by the
  next `step()`, so their tokens are those of a run without the failing rows.
  When no row fails alone (e.g. out of memory at this batch size), every row
  of the step fails: the loop never retries a failing batch as it was.
- After a step, a request whose active block is still unresolved after
  `block_size` denoise steps fails alone (`StepCapExceeded`): every
  LowConfidence step fills at least one masked position (DECODING.md 2 step
  6), so such a block never resolves (e.g. non-finite logits or sampling
  parameters choosing the mask token); the cap keeps it from holding a slot.
After a step, the rows whose strategy rejected part of a draft (`Strategy.undoes`) get their slots' GDN
states back (`StateMover.undo_rows`, DECODING.md 5). `on_step(plan, outputs)`, when set, sees every
step's plan and typed outputs before the scheduler reads them (tests, debugging).
Cost: the held copy takes the causal rows' GDN states before every step with
causal rows (the fixed per-sequence cache bytes, `cache_bytes_per_token_and_fixed`),
and a failed step of B rows costs B single-row retries. A backend left broken
(e.g. a lost CUDA context) fails every later step too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from clover_export.runtime.decoding.base import RowOutput
from clover_export.runtime.request import Request
from clover_export.runtime.runner import Runner
from clover_export.runtime.scheduler import Scheduler, StepPlan
from clover_export.runtime.state_mover import StepUndo

StepObserver = Callable[[StepPlan, list[RowOutput]], None]


class StepCapExceeded(RuntimeError):
    """A block took `block_size` denoise steps without resolving: a fault, never a slow request."""

    def __init__(self, req: Request):
        super().__init__(f"its block did not resolve within {req.block_size} denoise steps (every step must fill "
                         "a masked position: non-finite logits or sampling parameters?)")


def over_step_cap(req: Request) -> bool:
    """True when the request's active block is unresolved after `block_size` denoise steps."""
    return req.strategy.over_step_cap(req)


@dataclass
class BlockEvent:
    """A request's block resolved this step (its response grew by `new_tokens`), or it failed (`error`)."""

    request: Request
    new_tokens: list[int]
    finished: bool
    error: Exception | None = None


class Loop:
    def __init__(self, scheduler: Scheduler, runner: Runner):
        self.scheduler = scheduler
        self.runner = runner
        self.steps = 0
        self.on_step: StepObserver | None = None

    def add(self, req: Request) -> None:
        self.scheduler.add(req)

    def cancel(self, req: Request) -> None:
        """Leave the batch now; the slot is free for the next admission."""
        self.scheduler.finish(req, "cancelled")

    def finish(self, req: Request, reason: str) -> None:
        self.scheduler.finish(req, reason)

    def fail(self, req: Request, error: Exception) -> BlockEvent:
        """Leave the batch with an error; the slot is free for the next admission."""
        req.error = error
        self.scheduler.finish(req, "error")
        return BlockEvent(req, [], True, error)

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def step(self) -> list[BlockEvent]:
        events = []
        for req in self.scheduler.admit_each():
            try:
                self.runner.claim(req)
            except Exception as e:  # noqa: BLE001 - any failure of one request fails that request only
                events.append(self.fail(req, e))
        plan = self.scheduler.schedule()
        if plan is None:
            return events
        held = self.runner.hold(plan)
        before = {id(r): len(r.response) for r in plan.requests}
        try:
            with self.runner.thread_scope(plan):
                outputs = self.runner.run(plan)
        except Exception as e:  # noqa: BLE001
            self.runner.states.undo(held)
            return events + self._isolate(plan, held, e)
        self.steps += 1
        if self.on_step is not None:
            self.on_step(plan, outputs)
        self.runner.states.undo_rows(held, [req.slot for req, out in zip(plan.requests, outputs)
                                            if req.strategy.undoes(req, out)])
        resolved = self.scheduler.update(plan, outputs)
        events += [BlockEvent(r, r.response[before[id(r)]:], r.finished) for r in resolved]
        return events + [self.fail(r, StepCapExceeded(r)) for r in plan.requests if over_step_cap(r)]

    def _isolate(self, plan: StepPlan, held: StepUndo, error: Exception) -> list[BlockEvent]:
        """The step raised `error` and was undone: fail the rows that raise alone (all when none does)."""
        failing: list[tuple[Request, Exception]] = []
        if plan.batch > 1:
            observer, self.runner.observer = self.runner.observer, None
            try:
                for r, req in enumerate(plan.requests):
                    try:
                        self.runner.run(plan.subset([r]))
                    except Exception as e:  # noqa: BLE001
                        failing.append((req, e))
                    finally:
                        self.runner.states.undo(held)
            finally:
                self.runner.observer = observer
        if not failing:
            failing = [(req, error) for req in plan.requests]
        return [self.fail(req, e) for req, e in failing]
