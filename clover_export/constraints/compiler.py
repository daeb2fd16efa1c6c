"""Compile each spec once, off the calling thread, within a size and time limit (docs/structured_output.md,
Compiling).

A compile runs on a worker thread of a small pool (the engine drops the GIL while it builds a grammar, so
the batch-loop thread and other compiles go on). The caller waits at most `CompileLimits.seconds`; a compile
that takes longer is refused with a GrammarError naming the field. A thread cannot be stopped, so the
abandoned compile finishes in its worker (the engine's own limits on grammar size and lexer work bound it)
and its result stays in the cache: the same spec again waits on that one compile, it does not start
another. The cache is a bounded LRU of futures keyed by the spec's JSON text (property order kept: it is
the order the output takes).
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from weakref import WeakKeyDictionary

from clover_export.constraints.specs import GrammarError, Source, grammar_source, spec_field
from clover_export.constraints.vocab import GrammarVocab, engine

if TYPE_CHECKING:
    from clover_export.constraints.matcher import Matcher


@dataclass(frozen=True)
class CompileLimits:
    seconds: float = 5.0  # a caller's wait for one compile
    spec_bytes: int = 64 * 1024  # a spec's JSON text
    tools: int = 128  # functions in one tool list (OpenAI's limit)
    grammar_size: int = 200_000  # the engine's grammar symbols


class Grammar:
    """A compiled spec, shared by every request that asks for it and never changed: `matcher()` gives a
    request its own state, a copy of the compiled start state. `spec`: what it was compiled from (another
    process compiles it again from that: serve/engine_process.py)."""

    def __init__(self, prototype, vocab: GrammarVocab, source: Source, spec: Any = None):
        self._prototype, self._lock = prototype, threading.Lock()
        self.vocab, self.source, self.spec = vocab, source, spec

    def matcher(self) -> Matcher:
        from clover_export.constraints.matcher import Matcher  # torch: only where masks are made

        with self._lock:  # the engine's objects are not shared between threads
            return Matcher(self._prototype.deep_copy(), self.vocab)


def engine_limits(limits: CompileLimits):
    return engine().LLParserLimits(max_grammar_size=limits.grammar_size, verbose_errors=False)


def engine_message(text: str) -> str:
    """The engine's error as one short line (its panics carry a backtrace)."""
    line = text.strip().splitlines()[0] if text.strip() else "the grammar engine refused it"
    return line.removeprefix("panic: ")[:200]


def blame(source: Source, vocab: GrammarVocab, limits: CompileLimits, message: str) -> GrammarError:
    """The error naming the first part of `source` that fails alone, else the whole source's field."""
    for field, grammar in source.parts:
        alone = engine().LLMatcher.validate_grammar(grammar, vocab.tokenizer, limits=engine_limits(limits))
        if alone:
            return GrammarError(field, engine_message(alone))
    return GrammarError(source.field, engine_message(message))


def build(spec: Any, vocab: GrammarVocab, limits: CompileLimits) -> Grammar:
    """Compile on the calling thread: the grammar text, the engine's matcher and its first mask."""
    source = grammar_source(spec)
    m = engine().LLMatcher(vocab.tokenizer, source.grammar, log_level=0, limits=engine_limits(limits))
    if not m.is_error():
        m.compute_bitmask()  # builds the lexer's start state: a limit it hits shows now, not mid-request
    if m.is_error():
        raise blame(source, vocab, limits, m.get_error())
    return Grammar(m, vocab, source, spec)


def spec_key(spec: Any, limits: CompileLimits) -> str:
    """The spec's JSON text (the cache key), checked against the size limits."""
    field = spec_field(spec)
    try:
        text = json.dumps(spec, ensure_ascii=False, separators=(",", ":"))
    except (TypeError, ValueError, RecursionError) as e:
        raise GrammarError(field, f"is not JSON ({str(e)[:100]})") from None
    if len(text.encode()) > limits.spec_bytes:
        raise GrammarError(field, f"is {len(text.encode())} bytes of JSON, more than the limit of "
                                  f"{limits.spec_bytes}")
    tools = spec.get("tools") if isinstance(spec, dict) else None
    if isinstance(tools, list) and len(tools) > limits.tools:
        raise GrammarError("tools", f"{len(tools)} functions, more than the limit of {limits.tools}")
    return text


class GrammarCompiler:
    """Specs -> Grammars for one vocabulary: cached, compiled on worker threads, limited (module docstring)."""

    def __init__(self, vocab: GrammarVocab, limits: CompileLimits | None = None, cache_size: int = 128,
                 workers: int = 2):
        self.vocab, self.limits, self.cache_size = vocab, limits or CompileLimits(), cache_size
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="grammar-compile")
        self._cache: OrderedDict[str, Future] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = self.misses = 0

    def _future(self, key: str, spec: Any) -> Future:
        with self._lock:
            future = self._cache.get(key)
            if future is not None:
                self.hits += 1
                self._cache.move_to_end(key)
                return future
            self.misses += 1
            future = self._cache[key] = self._pool.submit(build, spec, self.vocab, self.limits)
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
            return future

    def compile(self, spec: Any) -> Grammar:
        """The Grammar of `spec`, from the cache when it was compiled before; GrammarError names the field
        when the spec is refused, too large or takes longer than the limit."""
        future = self._future(spec_key(spec, self.limits), spec)
        try:
            return future.result(timeout=self.limits.seconds)
        except GrammarError as e:  # a fresh one: re-raising the cached instance would grow its traceback
            raise GrammarError(e.field, e.why) from None
        except FutureTimeout:
            raise GrammarError(spec_field(spec), f"did not compile within {self.limits.seconds:g} s "
                                                 "(simplify the schema)") from None

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


_COMPILERS: WeakKeyDictionary[GrammarVocab, GrammarCompiler] = WeakKeyDictionary()
_COMPILERS_LOCK = threading.Lock()


def compile(spec: Any, tokenizer_info: GrammarVocab) -> Grammar:  # noqa: A001 (shadows the builtin inside this module only)
    """`GrammarCompiler(tokenizer_info).compile(spec)` with one compiler (and cache) per vocabulary."""
    with _COMPILERS_LOCK:
        compiler = _COMPILERS.get(tokenizer_info)
        if compiler is None:
            compiler = _COMPILERS[tokenizer_info] = GrammarCompiler(tokenizer_info)
    return compiler.compile(spec)
