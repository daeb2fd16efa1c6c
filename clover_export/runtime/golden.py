"""Golden files: a reference implementation's outputs, and how ours compares to them.

Format (JSON, written by `tools/make_golden.py` from any model folder that
`transformers` can run, e.g. the official Clover implementation):

    {
      "format": "clover-export/golden", "version": 1,
      "source": "free text: model, library, versions",
      "prompt_ids": [int, ...],                      # the prompt, already templated and tokenised
      "params": {"max_new_tokens": 32, ...},         # generation parameters (GenerationSettings fields,
                                                     #   plus "block_size"); greedy unless do_sample
      "expected_token_ids": [int, ...] | null,       # the response ids the reference generated
      "expected_logits": [[float, ...], ...]         # optional: causal next-token logits of the prompt,
                         | "NAME.npy" | null,        #   [prompt_len, vocab] fp32, inline or an .npy beside
      "logits_atol": 0.001                           # optional tolerance for the logit comparison
    }

`compare_golden` reports the largest logit error (ours: the torch backend's
causal rows) and the first response position where our tokens diverge.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from clover_export.core.atomic import atomic_write
from clover_export.core.errors import CloverError

FORMAT = "clover-export/golden"
VERSION = 1
DEFAULT_ATOL = 1e-3


@dataclass
class Golden:
    path: Path
    prompt_ids: list[int]
    params: dict[str, Any]
    expected_token_ids: list[int] | None
    expected_logits: torch.Tensor | None  # [P, V] fp32
    logits_atol: float
    source: str = ""


def read_golden(path: str | Path) -> Golden:
    path = Path(path)
    try:
        d = json.loads(path.read_text())
    except FileNotFoundError:
        raise CloverError("golden", f"{path}: file not found") from None
    except json.JSONDecodeError as e:
        raise CloverError("golden", f"{path}: not valid JSON ({e})") from None
    if not isinstance(d, dict) or d.get("format") != FORMAT:
        raise CloverError("golden", f"{path}: not a golden file (field 'format' must be {FORMAT!r})")
    if d.get("version") != VERSION:
        raise CloverError("golden", f"{path}: version {d.get('version')!r}, expected {VERSION}")
    ids = d.get("prompt_ids")
    if not isinstance(ids, list) or not ids or not all(isinstance(i, int) for i in ids):
        raise CloverError("golden", f"{path}: field 'prompt_ids' must be a non-empty list of ints")
    logits = d.get("expected_logits")
    if isinstance(logits, str):
        import numpy as np

        npy = path.parent / logits
        if not npy.is_file():
            raise CloverError("golden", f"{path}: field 'expected_logits' names {npy}, which does not exist")
        logits = torch.from_numpy(np.load(npy).astype("float32"))
    elif logits is not None:
        logits = torch.tensor(logits, dtype=torch.float32)
    if logits is not None and (logits.dim() != 2 or logits.shape[0] != len(ids)):
        raise CloverError("golden", f"{path}: 'expected_logits' has shape {tuple(logits.shape)}, "
                                    f"expected [prompt_len={len(ids)}, vocab]")
    expected = d.get("expected_token_ids")
    if expected is not None and not (isinstance(expected, list) and all(isinstance(i, int) for i in expected)):
        raise CloverError("golden", f"{path}: field 'expected_token_ids' must be a list of ints or null")
    return Golden(path, ids, dict(d.get("params") or {}), expected, logits,
                  float(d.get("logits_atol", DEFAULT_ATOL)), str(d.get("source", "")))


def write_golden(path: str | Path, prompt_ids: list[int], params: dict, expected_token_ids: list[int] | None,
                 expected_logits=None, npy: bool = False, source: str = "", logits_atol: float | None = None) -> Path:
    """Write a golden file atomically; logits (array-like [P, V]) inline or as `<stem>.logits.npy` beside."""
    import numpy as np

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    d: dict[str, Any] = {"format": FORMAT, "version": VERSION, "source": source, "prompt_ids": list(prompt_ids),
                         "params": params, "expected_token_ids": expected_token_ids, "expected_logits": None}
    if logits_atol is not None:
        d["logits_atol"] = logits_atol
    if expected_logits is not None:
        arr = np.asarray(expected_logits, dtype=np.float32)
        if npy:
            name = path.stem + ".logits.npy"
            atomic_write(path.parent / name, lambda f: np.save(f, arr))
            d["expected_logits"] = name
        else:
            d["expected_logits"] = arr.tolist()
    atomic_write(path, lambda f: f.write(json.dumps(d).encode()))
    return path


@dataclass
class CompareReport:
    logits_max_abs_err: float | None = None
    logits_argmax_agree: float | None = None  # fraction of prompt positions with the same argmax
    logits_ok: bool | None = None
    first_divergence: int | None = None  # response index of the first differing token (None: identical)
    tokens_compared: int = 0
    tokens_ok: bool | None = None
    note: str = ""

    @property
    def ok(self) -> bool:
        return self.logits_ok is not False and self.tokens_ok is not False

    def lines(self, atol: float) -> list[str]:
        out = []
        if self.logits_max_abs_err is not None:
            out.append(f"prompt logits: max |error| {self.logits_max_abs_err:.3g} (tolerance {atol:g}), "
                       f"argmax agrees at {self.logits_argmax_agree:.1%} of positions: "
                       f"{'ok' if self.logits_ok else 'MISMATCH'}")
        if self.tokens_ok is not None:
            if self.first_divergence is None:
                out.append(f"response tokens: all {self.tokens_compared} identical: ok")
            else:
                out.append(f"response tokens: first divergence at response index {self.first_divergence} "
                           f"(of {self.tokens_compared}): MISMATCH")
        if self.note:
            out.append(self.note)
        return out


def first_divergence(ours: list[int], theirs: list[int]) -> int | None:
    for i, (a, b) in enumerate(zip(ours, theirs)):
        if a != b:
            return i
    return None if len(ours) == len(theirs) else min(len(ours), len(theirs))


def compare_logits(golden: Golden, ours: torch.Tensor, report: CompareReport) -> None:
    theirs = golden.expected_logits
    if ours.shape != theirs.shape:
        raise CloverError("compare", f"our prompt logits have shape {tuple(ours.shape)}, the golden file's "
                                     f"{tuple(theirs.shape)}", "is this the same model (vocabulary)?")
    ours = ours.float().cpu()
    report.logits_max_abs_err = float((ours - theirs).abs().max())
    report.logits_argmax_agree = float((ours.argmax(-1) == theirs.argmax(-1)).float().mean())
    report.logits_ok = report.logits_max_abs_err <= golden.logits_atol


def compare_tokens(golden: Golden, ours: list[int], report: CompareReport) -> None:
    theirs = golden.expected_token_ids
    report.first_divergence = first_divergence(ours, theirs)
    report.tokens_compared = max(len(ours), len(theirs))
    report.tokens_ok = report.first_divergence is None
