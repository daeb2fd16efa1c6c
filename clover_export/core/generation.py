"""Generation controls and their defaults (DECODING.md 3; model card).

Defaults come from this table, then `generation_config.json`, then the call
site; `GenerationSettings.validate` rejects out-of-range values up front.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from clover_export.core.config import read_json
from clover_export.core.errors import CloverError

DRAFT_THRESHOLD = 0.5  # self_spec's default draft confidence (bench/self_spec.py measures the choice)


@dataclass(frozen=True)
class GenerationSettings:
    max_new_tokens: int = 1024
    threshold: float = 0.95
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    repetition_penalty: float = 1.05
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.9
    dllm_length_penalty: float = 10.0
    dllm_length_penalty_start: int = 8192
    dllm_length_penalty_window: int = 8192
    dllm_think_end_bias: float = 10.0
    dllm_think_end_start: int = 4096
    dllm_think_end_window: int = 4096
    enable_thinking: bool = True
    min_tokens: int = 0  # no end token before this many response tokens (vLLM's min_tokens)
    ignore_eos: bool = False  # end tokens do not end the response: it runs to max_new_tokens (vLLM)
    seed: int | None = None
    decoding: str = "low_confidence"  # a mode of runtime/decoding/ (DECODING.md 2, 5)
    draft_threshold: float = DRAFT_THRESHOLD  # self_spec: draft the leading block positions this confident
    eos_token_id: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()

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
        """Every field against `RANGES` (types included); token ids against `vocab_size` when given."""
        for name, allowed in RANGES.items():
            allowed.check(name, getattr(self, name))
        if self.seed is not None:
            SEED_RANGE.check("seed", self.seed)
        if not isinstance(self.decoding, str):  # one of the runtime's modes (runtime/decoding/ checks the name)
            raise _bad("decoding", "must be a decoding mode's name", self.decoding)
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


SAMPLING_EPS = 1e-5  # a lower temperature decodes greedily (vLLM's _SAMPLING_EPS)
# The largest value of a real parameter: far past any useful one (a bias of 1e6 outweighs every logit, a
# position of 1e6 lies past any context, a temperature of 1e6 is uniform) and finite in float32, the dtype of
# the runner's parameter table (an infinite strength times a zero ramp would be NaN).
REAL_MAX = 10**6
# The smallest value of a parameter the controls divide by (repetition_penalty, the ramp windows): a logit
# divided by it stays finite in float32, where 1e-39 would overflow and 1e-46 rounds to a division by zero.
DIVISOR_MIN = 1 / REAL_MAX

# The one place for the parameter ranges (DECODING.md 1.2 and 3).
RANGES: dict[str, Range] = {
    "max_new_tokens": Range("int", 1),
    "threshold": Range("real", 0, 1, low_open=True),
    "do_sample": Range("bool"),
    "temperature": Range("real", 0, REAL_MAX, low_open=True),  # below SAMPLING_EPS: greedy
    "top_k": Range("int", 0),  # 0 = off
    "top_p": Range("real", 0, 1, low_open=True),
    "repetition_penalty": Range("real", DIVISOR_MIN, REAL_MAX),
    "frequency_penalty": Range("real", -2, 2),  # OpenAI's range: negative favours repeats
    "presence_penalty": Range("real", -2, 2),
    "dllm_length_penalty": Range("real", 0, REAL_MAX),
    "dllm_length_penalty_start": Range("real", 0, REAL_MAX),
    "dllm_length_penalty_window": Range("real", DIVISOR_MIN, REAL_MAX),
    "dllm_think_end_bias": Range("real", 0, REAL_MAX),
    "dllm_think_end_start": Range("real", 0, REAL_MAX),
    "dllm_think_end_window": Range("real", DIVISOR_MIN, REAL_MAX),
    "enable_thinking": Range("bool"),
    "min_tokens": Range("int", 0),
    "ignore_eos": Range("bool"),
    "draft_threshold": Range("real", 0, 1),  # 0: draft every block position; 1: never draft (ar's forwards)
}
SEED_RANGE = Range("int", 0, 2**64 - 1)  # torch.Generator.manual_seed takes 64-bit seeds; None = random


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
