"""Synthetic tasks with checkable, several-token answers.

Two digit-list tasks, both answered in one block: sort a list of single
digits ("Sort: 7 3 9" -> "3 7 9") and reverse it ("Reverse: 7 3 9" -> "9 3 7").
Every digit is one token (tokenizer_assets splits digits), so an answer of n
digits is 2n - 1 tokens. Lists have MIN_ITEMS (1) to MAX_ITEMS (8) digits;
the training stream draws the length uniformly (a `min_items` of 3 is the
stream the embedded default's first two stages were trained on).

Held-out set (never produced by the training stream, which skips its prompts),
chosen per length because the prompt space is 10^n per task:
- long lists (LONG_MIN_ITEMS.. MAX_ITEMS, 10^3+ prompts per task): the first
  LONG_HELDOUT distinct prompts of a sampler over those lengths with a seed of
  its own (HELDOUT_SEED), about 33 per length;
- short lists (1 and 2 items, only 10 and 100 prompts per task): a fixed share
  per task, SHORT_HELDOUT (3 of the 10 one-digit prompts, 15 of the 100
  two-digit ones), drawn with the same seed; the other 7 and 85 are trained on.
A held-out prompt is never trained on, so evaluating on every short prompt
would leave none to train; the shares keep both sides for every length.
`heldout_examples` lists the set length by length in turn (1, 2, ..., 8, 1, ...),
so any prefix covers every length while it lasts.

The tool task is the same prompts with tools offered (`TOOL_NAMES`: `sort_digits`
and `reverse_digits`, one string parameter `digits`): the task's own tool,
alone or beside the other in either order. The answer is two turns: a call of
the task's tool with the prompt's list, in Qwen3.6's XML (`tool_call_text`),
then, after the `tool` message holding the tool's result, that result.
`tool_case` draws the offer for an example from the example's prompt alone,
so the held-out tool cases are fixed as well.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

TASKS = ("sort", "reverse")
MIN_ITEMS, MAX_ITEMS = 1, 8
LONG_MIN_ITEMS = 3  # lists this long or longer are held out by sampling, shorter ones by share
LONG_HELDOUT = 200
SHORT_HELDOUT = {1: 3, 2: 15}  # held-out prompts per task, of the 10 ** n
HELDOUT_SEED = 1_000_003


@dataclass(frozen=True)
class Example:
    task: str
    prompt: str  # the user message
    answer: str  # the exact expected assistant content
    items: int = field(default=0, compare=False)  # the list's length


def make_example(task: str, digits: list[int]) -> Example:
    listed = " ".join(map(str, digits))
    if task == "sort":
        return Example(task, f"Sort: {listed}", " ".join(map(str, sorted(digits))), len(digits))
    if task == "reverse":
        return Example(task, f"Reverse: {listed}", " ".join(map(str, digits[::-1])), len(digits))
    raise ValueError(f"unknown task {task!r}; expected one of {TASKS}")


def sample_example(rng: random.Random, min_items: int = MIN_ITEMS) -> Example:
    task = rng.choice(TASKS)
    n = rng.randint(min_items, MAX_ITEMS)
    return make_example(task, [rng.randint(0, 9) for _ in range(n)])


def _long_heldout() -> list[Example]:
    rng = random.Random(HELDOUT_SEED)
    seen: dict[str, Example] = {}
    while len(seen) < LONG_HELDOUT:
        ex = sample_example(rng, LONG_MIN_ITEMS)
        seen.setdefault(ex.prompt, ex)
    return list(seen.values())


def _short_heldout() -> list[Example]:
    """SHORT_HELDOUT[n] distinct n-digit lists per task, the tasks alternating."""
    rng = random.Random(HELDOUT_SEED)
    out = []
    for n, k in SHORT_HELDOUT.items():
        picks = {task: rng.sample(range(10 ** n), k) for task in TASKS}
        for i in range(k):
            out += [make_example(task, [int(c) for c in f"{picks[task][i]:0{n}d}"]) for task in TASKS]
    return out


def heldout_examples(count: int | None = None) -> list[Example]:
    """The fixed held-out set (all of it, or its first `count`), the lengths taking turns."""
    by_length: dict[int, list[Example]] = {n: [] for n in range(MIN_ITEMS, MAX_ITEMS + 1)}
    for ex in _short_heldout() + _long_heldout():
        by_length[ex.items].append(ex)
    rounds = max(len(v) for v in by_length.values())
    turns = [exs[i] for i in range(rounds) for exs in by_length.values() if i < len(exs)]
    return turns if count is None else turns[:count]


def training_stream(seed: int, exclude: set[str], min_items: int = MIN_ITEMS):
    """Endless deterministic training examples, skipping every prompt in `exclude`."""
    rng = random.Random(seed)
    while True:
        ex = sample_example(rng, min_items)
        if ex.prompt not in exclude:
            yield ex


TOOL_NAMES = {"sort": "sort_digits", "reverse": "reverse_digits"}
TOOL_PARAMETER = "digits"


def tool_spec(task: str) -> dict:
    """The OpenAI tool object of a task's tool."""
    verb = {"sort": "Sort digits in ascending order", "reverse": "Reverse the order of digits"}[task]
    return {"type": "function", "function": {
        "name": TOOL_NAMES[task], "description": verb + ", given as one string of digits separated by spaces.",
        "parameters": {"type": "object", "properties": {TOOL_PARAMETER: {"type": "string"}},
                       "required": [TOOL_PARAMETER]}}}


@dataclass(frozen=True)
class ToolCase:
    example: Example
    tools: tuple[str, ...]  # the tasks whose tools are offered, in order; the example's own among them

    @property
    def name(self) -> str:
        """The function the call names: the example's task's tool."""
        return TOOL_NAMES[self.example.task]

    @property
    def arguments(self) -> dict[str, str]:
        """The call's arguments: the prompt's list as written."""
        return {TOOL_PARAMETER: self.example.prompt.split(": ", 1)[1]}

    def tool_specs(self) -> list[dict]:
        return [tool_spec(t) for t in self.tools]


def tool_case(example: Example) -> ToolCase:
    """The tools offered with `example`: its own alone, or both in either order (a draw seeded by the prompt)."""
    rng = random.Random(example.prompt)
    other = next(t for t in TASKS if t != example.task)
    return ToolCase(example, rng.choice([(example.task,), (example.task, other), (other, example.task)]))


def tool_call_text(name: str, arguments: dict[str, str]) -> str:
    """A call as Qwen3.6's template writes it in an assistant turn (and the model should write it)."""
    params = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in arguments.items())
    return f"<tool_call>\n<function={name}>\n{params}</function>\n</tool_call>"


def is_correct(example: Example, text: str) -> bool:
    """Exact match of the assistant content, ignoring an empty think section and outer whitespace."""
    if "</think>" in text:
        text = text.split("</think>", 1)[1]
    return text.strip() == example.answer
