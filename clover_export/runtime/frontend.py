"""What checks and tokenizes requests for a model without loading it: its config, tokenizer and generation
defaults (DECODING.md 1.2). `Generator` is one with a backend; a server whose engine runs in another process
checks requests against one of these (serve/engine_process.py), so this module imports no torch."""

from __future__ import annotations

import dataclasses
import numbers
import threading
from pathlib import Path
from typing import Any

from clover_export.core.errors import CloverError
from clover_export.core.generation import GenerationSettings, load_generation_settings
from clover_export.model.tokenizer import ChatTokenizer
from clover_export.runtime import decoding


def context_needed(prompt_len: int, max_new_tokens: int, block_size: int, alignment: str) -> int:
    """Positions a request may occupy, counting its final full block (DECODING.md 1.2).

    prompt_end: prompt_len + ceil(max_new_tokens / block_size) * block_size.
    absolute: blocks sit on multiples of block_size from 0 and the first one
    holds the prompt tail, so the need is the end of the last such block.
    """
    blocks = -(-max_new_tokens // block_size)
    if alignment == "absolute":
        start = prompt_len // block_size * block_size
        tail = prompt_len - start
        return start + -(-(tail + max_new_tokens) // block_size) * block_size
    return prompt_len + blocks * block_size


class Frontend:
    """What checks and tokenizes requests for a model, without its backend: the model's config, tokenizer and
    generation defaults, the engine's block size and context. A Generator is one; a server whose engine runs
    in another process checks its requests against one of these (serve/engine_process.py)."""

    def __init__(self, cfg, source_dir: str | Path, block_size: int, max_context: int):
        self.cfg, self.source_dir, self.block_size, self.max_context = cfg, source_dir, block_size, max_context
        self.tokenizer = ChatTokenizer(source_dir)
        self.defaults = load_generation_settings(source_dir, eos_fallback=cfg.eos_token_id)
        try:
            decoding.strategy(self.defaults.validate(cfg.vocab_size).decoding)
        except CloverError as e:
            raise CloverError("generation_config", f"{Path(source_dir) / 'generation_config.json'}: {e}") from None
        im_end = self.tokenizer.im_end_id
        self.extra_end_ids = frozenset([im_end] if im_end is not None else [])
        self._grammar_vocab = None
        self._grammar_vocab_lock = threading.Lock()  # requests are prepared on several threads at once

    # --- checking requests --------------------------------------------------------
    def settings(self, **params: Any) -> GenerationSettings:
        """The model's defaults with per-request overrides, validated (DECODING.md 1.2)."""
        block_size = params.pop("block_size", None)
        if block_size is not None and (isinstance(block_size, bool) or block_size != self.block_size):
            raise CloverError("generate",
                              f"parameter 'block_size' is {block_size!r}, the engine's is {self.block_size}",
                              "block_size is fixed when the model or engine is loaded")
        settings = self.defaults.override(**params).validate(self.cfg.vocab_size)
        strategy = decoding.strategy(settings.decoding)  # a registered mode
        if settings.prompt_logprobs is not None and strategy.alignment(self.cfg.block_alignment) == "absolute":
            raise CloverError("generate", f"parameter 'prompt_logprobs' needs the prompt prefilled whole: the model's "
                                          f"block_alignment 'absolute' puts its tail in the first block under "
                                          f"{settings.decoding}; use decoding 'ar' or 'self_spec'")
        return settings

    def grammar_vocab(self):
        """The vocabulary grammars for this model are compiled for (`constraints.compile(spec, vocab)`): its
        tokenizer, the logits' width, the end tokens of a request that keeps the default `eos_token_id`."""
        with self._grammar_vocab_lock:  # one object: a grammar is checked against it by identity
            if self._grammar_vocab is None:
                from clover_export.constraints import tokenizer_info

                end_ids = sorted(frozenset(self.defaults.eos_token_id) | self.extra_end_ids)
                self._grammar_vocab = tokenizer_info(self.source_dir, self.cfg.vocab_size, end_ids)
            return self._grammar_vocab

    def constrained(self, settings: GenerationSettings, grammar: Any) -> GenerationSettings:
        """A constrained request's settings: `low_confidence` runs as `self_spec` (a left-to-right grammar
        cannot mask positions filled out of order), thinking off (the grammar is the whole answer); a
        grammar of another vocabulary, or `ignore_eos` (the grammar ends with an end token), is refused."""
        if grammar.vocab is not self.grammar_vocab():
            raise CloverError("generate", "parameter 'grammar' was not compiled for this model's grammar_vocab()")
        if settings.ignore_eos:
            raise CloverError("generate", "parameter 'ignore_eos' cannot be true with a grammar: the grammar's "
                                          "output ends with an end token")
        mode = decoding.strategy(settings.decoding).grammar_mode
        return dataclasses.replace(settings, decoding=mode, enable_thinking=False)

    def prompt_ids(self, prompt: str | None = None, messages: list[dict] | None = None,
                   prompt_ids: list[int] | None = None, raw: bool = False, enable_thinking: bool = True) -> list[int]:
        given = [x is not None for x in (prompt, messages, prompt_ids)]
        if sum(given) != 1:
            raise CloverError("generate", "give exactly one of prompt, messages or prompt_ids")
        if prompt_ids is not None:
            if isinstance(prompt_ids, (str, bytes)) or not all(
                    isinstance(i, numbers.Integral) and not isinstance(i, bool) for i in prompt_ids):
                raise CloverError("generate", "parameter 'prompt_ids' must be a list of integer token ids")
            ids = [int(i) for i in prompt_ids]
        elif raw:
            ids = self.tokenizer.encode(prompt, add_special_tokens=True)
        else:
            if prompt is not None:
                messages = [{"role": "user", "content": prompt}]
            ids = self.tokenizer.apply_chat_template(messages, enable_thinking=enable_thinking)
        if not ids:
            raise CloverError("generate", "the prompt is empty")
        bad = [i for i in ids if not 0 <= i < self.cfg.vocab_size]
        if bad:
            raise CloverError("generate",
                              f"prompt token id {bad[0]} is outside the vocabulary (size {self.cfg.vocab_size})")
        return ids
