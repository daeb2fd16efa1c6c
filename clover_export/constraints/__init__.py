"""Structured output: grammars from JSON schemas and tool lists, and the per-request token masks they give
(docs/structured_output.md). The engine is llguidance (the `cpu` and `gpu` extras install it)."""

from clover_export.constraints.compiler import CompileLimits, Grammar, GrammarCompiler, compile
from clover_export.constraints.matcher import (
    Matcher,
    allocate_bitmask,
    apply_bitmask_,
    apply_masks_,
    unpack_bitmask,
)
from clover_export.constraints.specs import GrammarError, is_raw_text
from clover_export.constraints.vocab import GrammarVocab, tokenizer_info, vocab_from_json

__all__ = ["CompileLimits", "Grammar", "GrammarCompiler", "GrammarError", "GrammarVocab", "Matcher",
           "allocate_bitmask", "apply_bitmask_", "apply_masks_", "compile", "is_raw_text", "tokenizer_info",
           "unpack_bitmask", "vocab_from_json"]
