"""The Python API: load once, then generate, stream or batch (DECODING.md 1-4).

    from clover_export.runtime import Generator

    gen = Generator.load("path/to/model")                 # or an ORT artifact with backend="ort"
    res = gen.generate("What is 2 + 3?", max_new_tokens=64, threshold=0.9)
    print(res.text, res.tokens_per_forward)

    for chunk in gen.stream(messages=[{"role": "user", "content": "Hi"}], enable_thinking=False):
        print(chunk.text, end="", flush=True)              # one committed block at a time

    handles = [gen.submit(p, seed=i, do_sample=True) for i, p in enumerate(prompts)]
    results = gen.wait(handles)                            # requests step together in one batch
    handles[0].cancel()                                    # frees the slot

The runtime's settings (slots, context, prefix cache, backend, device, dtype,
threads, ...) are one `RuntimeConfig` (config.py). Per-request parameters
are the fields of `GenerationSettings`, made from the table
`generation.PARAMETERS` (defaults from the model's generation_config.json),
plus `block_size` (must be the engine's). A request that cannot fit the
context, or with an out-of-range parameter, raises CloverError before any
compute. A request that fails later
(an exception in its step, see loop.py) leaves the batch alone: its handle's
`error` is set, iterating or waiting on it raises that CloverError, and the
other requests go on. A Generator is driven from one thread: every `next()`
on a stream (or `wait`) steps all queued requests.

Prefix reuse (docs/prefix_cache.md) is on by default: a request whose prompt
starts like an earlier or running request's sequence resumes from its caches
(`Result.cached_tokens`). RuntimeConfig.prefix_cache: True (on, with
DEFAULT_BUDGET_GB GiB of GDN state snapshots), a number (on, with that many
GiB; 0 keeps none), or False (off).
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from pathlib import Path
from typing import Any, Iterable

from clover_export.backends import Backend, open_backend
from clover_export.core.errors import CloverError
from clover_export.runtime import decoding
from clover_export.runtime.config import RuntimeConfig
from clover_export.runtime.decoding.grammar import RequestGrammar
from clover_export.runtime.frontend import Frontend, context_needed
from clover_export.runtime.loop import BlockEvent, Loop
from clover_export.runtime.output import Result, StreamChunk, TextTracker
from clover_export.runtime.prefix_cache import DEFAULT_BUDGET_GB, PrefixCache
from clover_export.runtime.request import Request
from clover_export.runtime.runner import Runner
from clover_export.runtime.scheduler import Scheduler


def prefix_cache_for(option: bool | float, runner: Runner, block_size: int, turn_end_id: int | None
                     ) -> PrefixCache | None:
    """The `prefix_cache` setting (checked by RuntimeConfig): True (the default budget), a budget in GiB, or False."""
    if option is False:
        return None
    gb = DEFAULT_BUDGET_GB if option is True else option
    return PrefixCache(runner.states, int(gb * 2**30), block_size, turn_end_id=turn_end_id)


class Stream:
    """Handle of one submitted request: iterate for its blocks; `result` once finished."""

    def __init__(self, gen: "Generator", req: Request, tracker: TextTracker):
        self.gen, self.request, self.tracker = gen, req, tracker
        self.request_id = req.request_id
        self.chunks: deque[StreamChunk] = deque()
        self.result: Result | None = None
        self.started = time.perf_counter()
        self.blocks_sent = 0

    @property
    def done(self) -> bool:
        return self.result is not None

    def __iter__(self):
        return self

    @property
    def error(self) -> CloverError | None:
        """Why the request failed (its blocks so far were delivered), else None."""
        err = self.request.error
        if err is None:
            return None
        return CloverError("runtime", f"request {self.request_id} failed: {type(err).__name__}: {err}",
                           "the other requests went on; its slot is free")

    def __next__(self) -> StreamChunk:
        while not self.chunks and not self.done:
            self.gen.step()
        if self.chunks:
            return self.chunks.popleft()
        if self.request.error is not None:
            raise self.error from self.request.error
        raise StopIteration

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.cancel()

    def cancel(self) -> None:
        """Stop now and free the slot (no effect once finished)."""
        if not self.done:
            self.gen.loop.cancel(self.request)
            self._finish()

    def wait(self) -> Result:
        for _ in self:
            pass
        return self.result

    def _on_block(self, event: BlockEvent) -> None:
        if event.error is not None:
            self._finish()
            return
        delta, ids = self.tracker.push(event.new_tokens, event.finished)
        if self.tracker.stopped and not event.finished:
            self.gen.loop.finish(self.request, "stop_string")
        elif self.tracker.stopped:
            self.request.finish_reason = "stop_string"
        chunk = StreamChunk(self.request_id, delta, ids, self.request.finished,
                            logprobs=self._logprobs_of(len(self.tracker.token_ids) - len(ids), len(ids)),
                            prompt_logprobs=[] if self.blocks_sent else list(self.request.prompt_logprobs))
        self.blocks_sent += 1
        if self.request.finished:
            chunk.result = self._finish()
        self.chunks.append(chunk)

    def _logprobs_of(self, start: int, count: int) -> list:
        """The `TokenLogprob`s of response tokens [start, start + count) (none unless the request asked)."""
        return self.request.logprobs[start:start + count]

    def _finish(self) -> Result:
        req, ids = self.request, self.tracker.token_ids
        s = req.stats()
        self.result = Result(
            request_id=req.request_id, token_ids=list(ids), text=self.tracker.text,
            finish_reason=req.finish_reason or "cancelled", prompt_tokens=req.prompt_len,
            response_tokens=len(ids), denoise_steps=req.denoise_steps, blocks=req.blocks,
            tokens_per_forward=len(ids) / s["forwards"] if s["forwards"] else 0.0,
            forwards_per_block=s["forwards_per_block"], distinct_experts_per_block=s["distinct_experts_per_block"],
            wall_time_s=time.perf_counter() - self.started, prompt_ids=list(req.prompt_ids),
            cached_tokens=req.cached_tokens, decoding=req.decoding, forwards=s["forwards"],
            accepted_per_forward=s["accepted_per_forward"], logprobs=self._logprobs_of(0, len(ids)),
            prompt_logprobs=list(req.prompt_logprobs),
            error=str(self.error) if req.error is not None else None,
        )
        self.gen.handles.pop(self.request_id, None)
        return self.result


class Generator(Frontend):
    """A loaded backend plus tokenizer, generation defaults, scheduler and runner."""

    def __init__(self, backend: Backend, source_dir: str | Path, config: RuntimeConfig | None = None,
                 **settings: Any):
        """`backend` opened from `source_dir`; `config`'s batch and cache settings, `settings` (its field names)
        changing some (`Generator(backend, folder, max_slots=2)`)."""
        self.config = config = dataclasses.replace(config or RuntimeConfig(), **settings)
        cfg = backend.cfg
        self.backend = backend
        self.mask_id = cfg.require_mask_token()
        limits = [cfg.max_context, backend.max_context] + ([config.max_context] if config.max_context else [])
        super().__init__(cfg, source_dir, backend.block_size, min(limits))
        im_end = self.tokenizer.im_end_id
        self.runner = Runner(backend, config.max_slots, self.max_context, self.mask_id, self.tokenizer.think_end_id)
        self.prefix_cache = prefix_cache_for(config.prefix_cache, self.runner, self.block_size, im_end)
        scheduler = Scheduler(config.max_slots, self.block_size, config.prefill_chunk, config.fold_commit,
                              config.early_stop, shapes=getattr(backend, "step_shapes", None), cache=self.prefix_cache)
        self.loop = Loop(scheduler, self.runner)
        self.handles: dict[int, Stream] = {}

    @classmethod
    def load(cls, model_or_artifact: str | Path | None = None, backend: str | None = None, *,
             config: RuntimeConfig | None = None, **options: Any) -> "Generator":
        """Open a model folder (torch), an exported artifact (ort) or an engine (trt) once, as `config` says
        (runtime/config.py). `backend` and `options` change it: a RuntimeConfig field by its name
        (max_slots, prefix_cache, dtype, device, threads, ...), anything else goes to the backend's load
        (triton: fp8_experts, cuda_graphs, graph_batch_sizes, graph_causal_rows, eager_fallback; ort:
        providers). The backend left out: `backends.default_backend` (ort for an artifact, triton on a CUDA
        GPU without TensorRT, else torch). CPU threads follow backends/threads.py; the caller's
        torch.get_num_threads() is left as it was.
        """
        config = RuntimeConfig.of(config, **options, **({"backend": backend} if backend else {}))
        name = config.backend_for(model_or_artifact)
        be = open_backend(name, model_or_artifact, **config.load_options(name))
        return cls(be, be.source_dir, dataclasses.replace(config, backend=name))

    # --- requests ----------------------------------------------------------------
    def submit(self, prompt: str | None = None, *, messages: list[dict] | None = None,
               prompt_ids: list[int] | None = None, raw: bool = False, grammar: Any = None,
               **params: Any) -> Stream:
        """Queue one request (checked up front, no compute yet); returns its handle. `grammar`: a compiled
        `constraints.Grammar` (for `grammar_vocab()`) the response keeps to (docs/structured_output.md)."""
        settings = self.settings(**params)
        if grammar is not None:
            settings = self.constrained(settings, grammar)
        ids = self.prompt_ids(prompt, messages, prompt_ids, raw, settings.enable_thinking)
        strategy = decoding.strategy(settings.decoding)
        alignment = strategy.alignment(self.cfg.block_alignment)
        need = context_needed(len(ids), settings.max_new_tokens, self.block_size, alignment)
        if need > self.max_context:
            raise CloverError(
                "generate",
                f"request needs {need} positions (prompt {len(ids)} + max_new_tokens {settings.max_new_tokens} "
                f"rounded up to blocks of {self.block_size}), over the context limit of {self.max_context}; "
                "shorten the prompt or lower max_new_tokens")
        end_ids = frozenset() if settings.ignore_eos else frozenset(settings.eos_token_id) | self.extra_end_ids
        req = Request(ids, settings.max_new_tokens, end_ids, self.block_size, self.mask_id,
                      alignment, params=settings, strategy=strategy)
        if grammar is not None:
            req.grammar = RequestGrammar.start(grammar, self.block_size)
        hidden = frozenset(settings.eos_token_id) | self.extra_end_ids if settings.ignore_eos else frozenset()
        handle = Stream(self, req, TextTracker(self.tokenizer.decode, end_ids, settings.stop, hidden))
        self.loop.add(req)
        self.handles[req.request_id] = handle
        return handle

    def stream(self, prompt: str | None = None, **kwargs: Any) -> Stream:
        """Like `generate`, yielding one StreamChunk per committed block; `.cancel()` stops it."""
        return self.submit(prompt, **kwargs)

    def generate(self, prompt: str | None = None, **kwargs: Any) -> Result:
        return self.submit(prompt, **kwargs).wait()

    def generate_batch(self, prompts: Iterable[str | list[dict]], **params: Any) -> list[Result]:
        """Several prompts (strings, or message lists) stepping together."""
        handles = [self.submit(messages=p, **params) if isinstance(p, list) else self.submit(p, **params)
                   for p in prompts]
        return self.wait(handles)

    def wait(self, handles: list[Stream], raise_errors: bool = True) -> list[Result]:
        """Step until every handle is done. A failed request raises its error once all are done (the
        others' results stay on their handles), or with raise_errors=False is a Result with
        finish_reason "error" and `error` set."""
        while not all(h.done for h in handles):
            self.step()
        failed = next((h for h in handles if h.request.error is not None), None)
        if failed is not None and raise_errors:
            raise failed.error from failed.request.error
        return [h.result for h in handles]

    def cancel(self, request_id: int) -> None:
        if request_id in self.handles:
            self.handles[request_id].cancel()

    def step(self) -> None:
        """One loop step for every queued request; blocks go to their handles."""
        if not self.loop.has_work():
            for h in list(self.handles.values()):  # nothing can progress any more
                h._finish()
            return
        for event in self.loop.step():
            handle = self.handles.get(event.request.request_id)
            if handle is None:
                continue
            try:
                handle._on_block(event)
            except Exception as e:  # noqa: BLE001 - e.g. decoding its ids: fails this request only
                if not handle.done:
                    self.loop.fail(event.request, e)
                    handle._finish()
