"""Structured output: grammars from JSON schemas and tool lists, and the per-request token masks they give
(docs/structured_output.md). The engine is llguidance (the `cpu` and `gpu` extras install it).

Compiling a grammar imports no torch (a server's HTTP process checks requests' grammars and loads no model);
the masks do: the matcher's names are imported from `matcher` when first used."""

from clover_export.constraints.compiler import CompileLimits, Grammar, GrammarCompiler, compile
from clover_export.constraints.specs import GrammarError, is_raw_text
from clover_export.constraints.vocab import GrammarVocab, tokenizer_info, vocab_from_json

MATCHER_NAMES = ("Matcher", "allocate_bitmask", "apply_bitmask_", "apply_masks_", "unpack_bitmask")

__all__ = ["CompileLimits", "Grammar", "GrammarCompiler", "GrammarError", "GrammarVocab", "Matcher",
           "allocate_bitmask", "apply_bitmask_", "apply_masks_", "compile", "is_raw_text", "tokenizer_info",
           "unpack_bitmask", "vocab_from_json"]


def __getattr__(name: str):
    if name in MATCHER_NAMES:
        from clover_export.constraints import matcher

        return getattr(matcher, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
