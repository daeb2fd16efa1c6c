"""The vocabulary a grammar masks (docs/structured_output.md, Vocabulary).

The model folder's `tokenizer.json`, read by the grammar engine itself (llguidance reads the Hugging Face
format; no transformers). A mask is as wide as the model's logits: a padded vocabulary (embedding rows past
the tokenizer's last id) keeps those ids in the mask, always refused. Special tokens are never text: the
engine allows them only where a grammar names them, and the end tokens only where the grammar is complete.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from clover_export.core.errors import CloverError

INSTALL_NOTE = "structured output needs the grammar engine: pip install 'clover-export[cpu]' (llguidance)"


def engine():
    """The llguidance module, imported on first use so the package imports where it is absent."""
    try:
        import llguidance
    except ImportError:
        raise CloverError("grammar", "the grammar engine llguidance is not installed", INSTALL_NOTE) from None
    return llguidance


def tokenizer_size(tokenizer_json: str) -> int:
    """Ids the tokenizer knows: one past the largest id of its model vocabulary and its added tokens."""
    spec = json.loads(tokenizer_json)
    vocab = spec.get("model", {}).get("vocab", {})
    ids = list(vocab.values()) if isinstance(vocab, dict) else range(len(vocab))  # BPE: dict; Unigram: list
    return max([*ids, *(t["id"] for t in spec.get("added_tokens", []))], default=-1) + 1


@dataclass(frozen=True, eq=False)
class GrammarVocab:
    """The engine's tokenizer, the mask width (the model's vocab size) and the end tokens."""

    tokenizer: Any  # llguidance.LLTokenizer
    vocab_size: int  # mask width: the model's logits
    text_size: int  # ids the tokenizer knows; text_size..vocab_size-1 are padding, always refused
    end_ids: tuple[int, ...]

    @property
    def mask_words(self) -> int:
        """int32 words of one bitmask row (bit t of word t // 32 allows token t)."""
        return (self.vocab_size + 31) // 32


def vocab_from_json(tokenizer_json: str, vocab_size: int, end_ids: list[int] | tuple[int, ...]) -> GrammarVocab:
    """A GrammarVocab from tokenizer.json's text; `vocab_size` is the model's (config.json's `vocab_size`)."""
    size = tokenizer_size(tokenizer_json)
    if vocab_size < size:
        raise CloverError("grammar", f"vocab_size {vocab_size} is smaller than the tokenizer's {size} ids",
                          "the mask must cover every id the tokenizer can produce")
    ends = tuple(sorted(set(end_ids)))
    if not ends or not all(0 <= e < size for e in ends):
        raise CloverError("grammar", f"end token ids {list(end_ids)} must be tokenizer ids (0..{size - 1})")
    tokenizer = engine().LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=list(ends))
    return GrammarVocab(tokenizer, vocab_size, size, ends)


def tokenizer_info(model_dir: str | Path, vocab_size: int, end_ids: list[int] | tuple[int, ...]) -> GrammarVocab:
    """The GrammarVocab of a model folder (its tokenizer.json)."""
    path = Path(model_dir) / "tokenizer.json"
    if not path.is_file():
        raise CloverError("grammar", f"{path}: file not found", "the model folder must hold tokenizer.json")
    return vocab_from_json(path.read_text(encoding="utf-8"), vocab_size, end_ids)
