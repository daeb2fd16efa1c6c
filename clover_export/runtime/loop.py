"""The loop: scheduler and runner joined, one step at a time (DECODING.md 1, 4; nano-vllm's `step()`).

It knows neither the backend nor the tokenizer: requests in, resolved blocks out.
"""

from __future__ import annotations

from dataclasses import dataclass

from clover_export.runtime.request import Request
from clover_export.runtime.runner import Runner
from clover_export.runtime.scheduler import Scheduler


@dataclass
class BlockEvent:
    """A request's block resolved this step: its response grew by `new_tokens`."""

    request: Request
    new_tokens: list[int]
    finished: bool


class Loop:
    def __init__(self, scheduler: Scheduler, runner: Runner):
        self.scheduler = scheduler
        self.runner = runner
        self.steps = 0

    def add(self, req: Request) -> None:
        self.scheduler.add(req)

    def cancel(self, req: Request) -> None:
        """Leave the batch now; the slot is free for the next admission."""
        self.scheduler.finish(req, "cancelled")

    def finish(self, req: Request, reason: str) -> None:
        self.scheduler.finish(req, reason)

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def step(self) -> list[BlockEvent]:
        for req in self.scheduler.admit():
            self.runner.claim(req)
        plan = self.scheduler.schedule()
        if plan is None:
            return []
        before = {id(r): len(r.response) for r in plan.requests}
        with self.runner.thread_scope(plan):
            blocks, coreset = self.runner.run(plan)
        self.steps += 1
        resolved = self.scheduler.update(plan, blocks, coreset)
        return [BlockEvent(r, r.response[before[id(r)]:], r.finished) for r in resolved]
