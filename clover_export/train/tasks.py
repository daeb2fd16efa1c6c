"""Synthetic tasks with checkable, several-token answers.

Two digit-list tasks, both answered in one block: sort a list of single
digits ("Sort: 7 3 9" -> "3 7 9") and reverse it ("Reverse: 7 3 9" -> "9 3 7").
Every digit is one token (tokenizer_assets splits digits), so an answer of n
digits is 2n - 1 tokens. Held-out prompts come from their own seed and are
never produced by the training stream.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

TASKS = ("sort", "reverse")
MIN_ITEMS, MAX_ITEMS = 3, 8
HELDOUT_SEED = 1_000_003


@dataclass(frozen=True)
class Example:
    task: str
    prompt: str  # the user message
    answer: str  # the exact expected assistant content


def make_example(task: str, digits: list[int]) -> Example:
    listed = " ".join(map(str, digits))
    if task == "sort":
        return Example(task, f"Sort: {listed}", " ".join(map(str, sorted(digits))))
    if task == "reverse":
        return Example(task, f"Reverse: {listed}", " ".join(map(str, digits[::-1])))
    raise ValueError(f"unknown task {task!r}; expected one of {TASKS}")


def sample_example(rng: random.Random) -> Example:
    task = rng.choice(TASKS)
    n = rng.randint(MIN_ITEMS, MAX_ITEMS)
    return make_example(task, [rng.randint(0, 9) for _ in range(n)])


def heldout_examples(count: int = 200) -> list[Example]:
    """The fixed held-out set: the first `count` distinct prompts of a separate seed."""
    rng = random.Random(HELDOUT_SEED)
    seen: dict[str, Example] = {}
    while len(seen) < count:
        ex = sample_example(rng)
        seen.setdefault(ex.prompt, ex)
    return list(seen.values())


def training_stream(seed: int, exclude: set[str]):
    """Endless deterministic training examples, skipping every prompt in `exclude`."""
    rng = random.Random(seed)
    while True:
        ex = sample_example(rng)
        if ex.prompt not in exclude:
            yield ex


def is_correct(example: Example, text: str) -> bool:
    """Exact match of the assistant content, ignoring an empty think section and outer whitespace."""
    if "</think>" in text:
        text = text.split("</think>", 1)[1]
    return text.strip() == example.answer
