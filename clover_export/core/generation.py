"""Generation controls and their defaults (DECODING.md 3; model card).

`PARAMETERS` is the one table of per-request parameters: each entry's name,
default, accepted values, help, and its name at the server (the OpenAI body)
and on `clover-export generate`. `GenerationSettings` (its fields and
`validate`), the server's request fields (serve/protocol.py) and the
command's options (cli/generate.py) are made from it, so a parameter is
added here once (docs/runtime.md, Request parameters). Defaults come from the
table, then `generation_config.json`, then the call site; `validate` rejects
out-of-range values up front.
"""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from clover_export.core.errors import CloverError
from clover_export.core.json_file import read_json

DRAFT_THRESHOLD = 0.5  # self_spec's default draft confidence (bench/self_spec.py measures the choice)
# self_spec's back-off when its drafts do not pay (docs/decoding.md, Back-off): after DRAFT_MISSES block steps in a
# row that add no draft token, the next steps run without a block, as ar, DRAFT_BACKOFF[0] of them, doubling up to
# DRAFT_BACKOFF[1] while misses go on; an accepted or fresh draft token resets it
DRAFT_MISSES = 2
DRAFT_BACKOFF = (2, 32)


@dataclass(frozen=True)
class Range:
    """Accepted values of one scalar parameter: its kind and interval [low, high], or (low, high] when low_open."""

    kind: str  # "int" (an integer), "real" (a finite number) or "bool"
    low: float | None = None
    high: float | None = None
    low_open: bool = False

    def describe(self) -> str:
        if self.kind == "bool":
            return "true or false"
        what = "an integer" if self.kind == "int" else "a finite number"
        if self.high is not None:
            return f"{what} in {'(' if self.low_open else '['}{self.low}, {self.high}]"
        return f"{what} {'>' if self.low_open else '>='} {self.low}"

    def check(self, name: str, value: Any) -> None:
        """CloverError naming the parameter unless `value` is of this kind and inside the interval."""
        if self.kind == "bool":
            ok = isinstance(value, bool)
        else:
            number = numbers.Integral if self.kind == "int" else numbers.Real
            ok = (isinstance(value, number) and not isinstance(value, bool) and math.isfinite(value)
                  and (self.low is None or value > self.low or (value == self.low and not self.low_open))
                  and (self.high is None or value <= self.high))
        if not ok:
            raise _bad(name, f"must be {self.describe()}", value)


@dataclass(frozen=True)
class Choice:
    """Accepted values of a string parameter: one of `values` (checked and described as a `Range` is)."""

    values: tuple[str, ...]
    kind: str = "str"

    def describe(self) -> str:
        return "one of " + ", ".join(json.dumps(v) for v in self.values)

    def check(self, name: str, value: Any) -> None:
        """CloverError naming the parameter unless `value` is one of the values (any string before a set of
        values is registered: see DECODING)."""
        if not isinstance(value, str) or (self.values and value not in self.values):
            raise _bad(name, f"must be {self.describe() if self.values else 'a string'}", value)


# The decoding modes are the runtime's registry (runtime/decoding/__init__.py fills this in when imported, as the
# CLI and the server do before they read the table); core itself checks only that the name is a string.
DECODING = Choice(())


def register_decoding_modes(names: tuple[str, ...]) -> None:
    object.__setattr__(DECODING, "values", tuple(names))


SAMPLING_EPS = 1e-5  # a lower temperature decodes greedily (vLLM's _SAMPLING_EPS)
# The largest value of a real parameter: far past any useful one (a bias of 1e6 outweighs every logit, a
# position of 1e6 lies past any context, a temperature of 1e6 is uniform) and finite in float32, the dtype of
# the runner's parameter table (an infinite strength times a zero ramp would be NaN).
REAL_MAX = 10**6
# The smallest value of a parameter the controls divide by (repetition_penalty, the ramp windows): a logit
# divided by it stays finite in float32, where 1e-39 would overflow and 1e-46 rounds to a division by zero.
DIVISOR_MIN = 1 / REAL_MAX
MAX_TOP_LOGPROBS = 20  # OpenAI's top_logprobs limit
SEED_RANGE = Range("int", 0, 2**64 - 1)  # torch.Generator.manual_seed takes 64-bit seeds; None = random


@dataclass(frozen=True)
class Parameter:
    """One per-request parameter at every door (docs/runtime.md, Request parameters).

    `name` is the runtime's (`Generator.submit`, generation_config.json);
    `openai` the request body's field at the server (a dotted path for a
    nested one; None: not a field there) and `cli` the option of `clover-export
    generate` (None: no option; a flag for a boolean, `--no-...` setting
    False); `openai_accepts` OpenAI's own range where it differs.
    """

    name: str
    default: Any  # when neither the request nor generation_config.json sets it; None: unset (seed: random)
    accepts: Range | Choice
    help: str
    openai: str | None = None
    cli: str | None = None
    openai_accepts: Range | None = None

    @property
    def type(self) -> Any:
        kind = {"int": int, "real": float, "bool": bool, "str": str}[self.accepts.kind]
        return kind | None if self.default is None else kind

    def check(self, value: Any) -> None:
        """CloverError naming the parameter unless the runtime accepts `value` (None where the default is None)."""
        if value is not None or self.default is not None:
            self.accepts.check(self.name, value)


# The one table (DECODING.md 1.2 and 3; OpenAI's ranges for OpenAI's fields where they are narrower).
PARAMETERS: tuple[Parameter, ...] = (
    Parameter("max_new_tokens", 1024, Range("int", 1),
              "Hard limit on response tokens; with the prompt it must fit the context", "max_tokens",
              "--max-new-tokens"),
    Parameter("threshold", 0.95, Range("real", 0, 1, low_open=True),
              "LowConfidence: a denoise step fills the masked positions more confident than this (none: the most "
              "confident one)", "threshold", "--threshold"),
    Parameter("do_sample", False, Range("bool"), "Sampling (temperature, top-k, top-p) instead of greedy decoding",
              None, "--sample"),
    Parameter("temperature", 1.0, Range("real", 0, REAL_MAX, low_open=True),
              "Sampling temperature; below 1e-5 decodes greedily", "temperature", "--temperature",
              openai_accepts=Range("real", 0, 2)),
    Parameter("top_k", 0, Range("int", 0), "Sample among the k likeliest tokens; 0 = off", "top_k", "--top-k"),
    Parameter("top_p", 1.0, Range("real", 0, 1, low_open=True),
              "Sample among the likeliest tokens holding this much probability", "top_p", "--top-p"),
    Parameter("repetition_penalty", 1.05, Range("real", DIVISOR_MIN, REAL_MAX),
              "A seen token's logit l becomes l / p if l > 0, else l * p", "repetition_penalty",
              "--repetition-penalty"),
    Parameter("frequency_penalty", 0.0, Range("real", -2, 2),
              "Minus this times a seen token's count; negative favours repeats", "frequency_penalty",
              "--frequency-penalty"),
    Parameter("presence_penalty", 0.9, Range("real", -2, 2),
              "Minus this on every seen token's logit", "presence_penalty", "--presence-penalty"),
    Parameter("dllm_length_penalty", 10.0, Range("real", 0, REAL_MAX),
              "Plus this times ramp(n) = clamp((n - start) / window, 0, 1) on the end tokens at response position n "
              "(DECODING.md 3)", "dllm_length_penalty",
              "--dllm-length-penalty"),
    Parameter("dllm_length_penalty_start", 8192, Range("real", 0, REAL_MAX),
              "Response position where dllm_length_penalty starts to ramp", "dllm_length_penalty_start",
              "--dllm-length-penalty-start"),
    Parameter("dllm_length_penalty_window", 8192, Range("real", DIVISOR_MIN, REAL_MAX),
              "Positions over which dllm_length_penalty ramps to its full strength", "dllm_length_penalty_window",
              "--dllm-length-penalty-window"),
    Parameter("dllm_think_end_bias", 10.0, Range("real", 0, REAL_MAX),
              "Plus this times its ramp (as dllm_length_penalty's) on `</think>` while thinking is open",
              "dllm_think_end_bias", "--dllm-think-end-bias"),
    Parameter("dllm_think_end_start", 4096, Range("real", 0, REAL_MAX),
              "Response position where dllm_think_end_bias starts to ramp", "dllm_think_end_start",
              "--dllm-think-end-start"),
    Parameter("dllm_think_end_window", 4096, Range("real", DIVISOR_MIN, REAL_MAX),
              "Positions over which dllm_think_end_bias ramps to its full strength", "dllm_think_end_window",
              "--dllm-think-end-window"),
    Parameter("enable_thinking", True, Range("bool"),
              "Thinking: the chat template's think block and the `</think>` bias",
              "chat_template_kwargs.enable_thinking", "--no-think"),
    Parameter("min_tokens", 0, Range("int", 0), "No end token before this many response tokens (vLLM)", "min_tokens",
              "--min-tokens"),
    Parameter("ignore_eos", False, Range("bool"),
              "End tokens do not end the response: it runs to max_new_tokens (vLLM)", "ignore_eos", "--ignore-eos"),
    Parameter("seed", None, SEED_RANGE, "Seed of the request's sampler (sampling only); unset: random", "seed",
              "--seed"),
    Parameter("decoding", "low_confidence", DECODING,
              "How tokens are chosen (DECODING.md 2, 5). low_confidence: block diffusion, the fastest; its text "
              "differs from ar's. ar: greedy (or sampled) autoregressive decoding of the causal mode, one token per "
              "forward: the reference. self_spec: the same output as ar (greedy: token for token; sampling: the same "
              "distribution), several tokens per forward (the block drafts, the causal rows verify)",
              "decoding", "--decoding"),
    Parameter("logprobs", None, Range("int", 0, MAX_TOP_LOGPROBS),
              "Report each response token's log-probability and this many likeliest alternatives (docs/serving.md, "
              "Logprobs; `generate --json` prints them); unset: none", cli="--logprobs"),
    Parameter("prompt_logprobs", None, Range("int", 0, MAX_TOP_LOGPROBS),
              "Report each prompt token's log-probability under the causal model (the first token has none) and this "
              "many likeliest alternatives (docs/runtime.md, Prompt logprobs); the prompt is computed whole, not "
              "resumed from the prefix cache; unset: none", cli="--prompt-logprobs"),
    Parameter("draft_threshold", DRAFT_THRESHOLD, Range("real", 0, 1),
              "self_spec: how confident a block position must be to be drafted (0: every position, 1: none); changes "
              "the speed only, not the greedy output nor the sampled distribution", "draft_threshold",
              "--draft-threshold"),
)
PARAMETER = {p.name: p for p in PARAMETERS}
RANGES: dict[str, Range | Choice] = {p.name: p.accepts for p in PARAMETERS}  # the runtime's accepted values


class _Settings:
    """The methods of `GenerationSettings` (its fields come from PARAMETERS)."""

    def __post_init__(self):
        # a temperature below SAMPLING_EPS decodes greedily (vLLM's rule): float32 logits divided by it
        # overflow (1e-39) or divide by zero (1e-320 is 0 in float32), DECODING.md 2.4
        cold = isinstance(self.temperature, numbers.Real) and 0 < self.temperature < SAMPLING_EPS
        if self.do_sample is True and cold:
            object.__setattr__(self, "do_sample", False)

    def override(self, **changes: Any) -> "GenerationSettings":
        changes = {k: v for k, v in changes.items() if v is not None}
        unknown = set(changes) - {f.name for f in dataclasses.fields(self)}
        if unknown:
            raise CloverError("generate", f"unknown generation parameter(s): {', '.join(sorted(unknown))}")
        for key in ("eos_token_id", "stop"):
            if key in changes and not isinstance(changes[key], tuple):
                v = changes[key]
                changes[key] = tuple(v) if isinstance(v, (list, tuple)) else (v,)
        return dataclasses.replace(self, **changes).validate()

    def validate(self, vocab_size: int | None = None) -> "GenerationSettings":
        """Every field against PARAMETERS (types included); token ids against `vocab_size` when given."""
        for p in PARAMETERS:
            p.check(getattr(self, p.name))
        if self.min_tokens > self.max_new_tokens:
            raise _bad("min_tokens", f"must be at most max_new_tokens ({self.max_new_tokens})", self.min_tokens)
        if any(isinstance(t, bool) or not isinstance(t, numbers.Integral) for t in self.eos_token_id):
            raise _bad("eos_token_id", "must be integer token ids", self.eos_token_id)
        if vocab_size is not None:
            out = [t for t in self.eos_token_id if not 0 <= t < vocab_size]
            if out:
                raise _bad("eos_token_id", f"holds id {out[0]}, outside the vocabulary (size {vocab_size})",
                           self.eos_token_id)
        if not all(isinstance(x, str) for x in self.stop):
            raise _bad("stop", "must be strings", self.stop)
        return self


# A request's parameters: one field per PARAMETERS entry (its default), then the two lists no door takes as a
# scalar: the end tokens (generation_config.json) and the stop strings.
GenerationSettings = dataclasses.make_dataclass(
    "GenerationSettings",
    [(p.name, p.type, p.default) for p in PARAMETERS]
    + [("eos_token_id", tuple[int, ...], ()), ("stop", tuple[str, ...], ())],
    bases=(_Settings,), frozen=True)
GenerationSettings.__module__ = __name__


def _bad(name: str, why: str, value: Any) -> CloverError:
    return CloverError("generate", f"parameter '{name}' {why}, got {value!r}")


def load_generation_settings(model_dir: str | Path, eos_fallback: tuple[int, ...] = ()) -> GenerationSettings:
    """Defaults overridden by the model folder's generation_config.json, if any."""
    path = Path(model_dir) / "generation_config.json"
    raw = read_json(path, "generation_config") if path.exists() else {}
    names = {f.name for f in dataclasses.fields(GenerationSettings)}
    known = {k: v for k, v in raw.items() if k in names}
    if "eos_token_id" not in known and eos_fallback:
        known["eos_token_id"] = eos_fallback
    try:
        return GenerationSettings().override(**known)
    except CloverError as e:
        raise CloverError("generation_config", f"{path}: {e}") from None
