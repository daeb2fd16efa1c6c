"""OpenAI schema <-> runtime: the server's only knowledge of generation (SERVING.md 1, 2, 5).

`chat_submission` / `completion_submission` turn a validated request into
runtime parameters and a prompt; `prepare` (run off the batch-loop thread, before
the request is handed over) renders the chat template, checks the prompt's
size cheaply, tokenises and checks the context, so the engine receives token
ids that cannot fail to admit. `api_error` turns the runtime's CloverError
into an OpenAI error; the response builders turn `StreamChunk`/`Result`
into OpenAI bodies. Decoding itself stays in the runtime.
"""

from __future__ import annotations

import functools
import json
import re
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from clover_export.core.errors import CloverError
from clover_export.runtime import decoding as modes
from clover_export.runtime.frontend import context_needed
from clover_export.serve import tool_calls
from clover_export.serve.protocol import (
    BODY_PARAMETERS,
    MAX_TOOL_CHARS,
    ApiError,
    ChatRequest,
    CommonParams,
    CompletionRequest,
    refuse,
    show,
)
from clover_export.serve.tool_calls import ToolUse

THINK_END = "</think>"
FINISH_REASONS = {"stop": "stop", "stop_string": "stop", "length": "length", "cancelled": "abort", "error": "error"}
# runtime parameter name -> the OpenAI name a client sent (the table's, generation.PARAMETERS)
OPENAI_NAMES = {p.name: p.openai for p in BODY_PARAMETERS if p.openai != p.name}
OPENAI_NAMES["prompt_logprobs"] = "echo"  # completions ask for the prompt's logprobs with echo + logprobs
# how many characters a tokenizer's normalizer may fold into one (NFC/NFKC compose up to 3 code points into
# one, NFKC maps one 4-byte letter to one ASCII letter): the cheap prompt bound divides by it when one is set
NORMALIZER_FOLD = 4


@dataclass
class Submission:
    """A request's runtime parameters and prompt (one of messages, text, ids), and how the answer is shaped."""

    params: dict[str, Any]  # Generator.submit keyword arguments other than the prompt
    chat: bool
    thinking: bool  # split reasoning_content off (chat with thinking on)
    messages: list[dict[str, Any]] | None = None
    text: str | None = None  # raw completion prompt
    ids: list[int] | None = None  # completion prompt as token ids
    stream: bool = False
    include_usage: bool = False
    logit_bias: dict[str, float] | None = None  # checked against the vocabulary by prepare
    decoding: str | None = None  # the decoding mode it runs with (the request's or the model's default), set by prepare
    tools: ToolUse | None = None  # chat with tools: shown to the template, calls read from the answer
    grammar_spec: dict[str, Any] | None = None  # constraints' spec the answer keeps to, compiled by prepare
    n: int = 1  # choices, each its own engine request (docs/serving.md, Choices)
    logprobs: int | None = None  # alternatives per token when logprobs are asked for (docs/serving.md, Logprobs)
    token_text: Any = None  # token id -> its text (the engine's tokenizer), set by prepare
    echo: bool = False  # completions: the prompt before the completion (docs/serving.md, Echo)
    echo_text: str | None = None  # the prompt's text when echoed, set by prepare
    echo_ids: list[int] = field(default_factory=list)  # and its token ids
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def prompt_field(self) -> str:
        return "messages" if self.chat else "prompt"


def _sampling(req: CommonParams) -> dict[str, Any]:
    if req.stream_options is not None and not req.stream:  # OpenAI and vLLM refuse it too
        raise refuse("stream_options", "is only allowed when 'stream' is true")
    kw: dict[str, Any] = {p.name: getattr(req, p.openai) for p in BODY_PARAMETERS}
    kw["block_size"] = req.block_size
    if req.temperature is not None:  # OpenAI: 0 is greedy; any other value samples at that temperature
        kw["do_sample"] = req.temperature > 0
        kw["temperature"] = req.temperature if req.temperature > 0 else None
    if req.stop is not None:
        kw["stop"] = [req.stop] if isinstance(req.stop, str) else list(req.stop)
    return kw


def _include_usage(req: CommonParams) -> bool:
    return bool(req.stream_options and req.stream_options.include_usage)


def chat_submission(req: ChatRequest, default_thinking: bool,
                    tool_parser: type[tool_calls.StreamParser] | None = None) -> Submission:
    """`tool_parser`: the model's tool-call format (tool_calls.parser_for), None when it has none."""
    if req.top_logprobs is not None and not req.logprobs:
        raise refuse("top_logprobs", "needs 'logprobs': true")
    spec = _response_format(req.response_format)
    tools = _tool_use(req, tool_parser)
    if tools is not None and tools.forced is not None and tools.parser is tool_calls.XmlToolCalls:
        if spec is not None:
            raise refuse("response_format", "cannot be combined with a tool_choice that forces a call")
        spec, tools.constrained = tools.grammar_spec(), True
    kw = _sampling(req)
    if req.max_completion_tokens is not None:
        kw["max_new_tokens"] = req.max_completion_tokens
    thinking = default_thinking
    if req.chat_template_kwargs and req.chat_template_kwargs.enable_thinking is not None:
        thinking = kw["enable_thinking"] = req.chat_template_kwargs.enable_thinking
    if tools is not None and tools.forced is not None:  # the call opens the turn: no reasoning before it
        if req.chat_template_kwargs and req.chat_template_kwargs.enable_thinking:
            raise refuse("tool_choice", "forces a call, which opens the assistant's turn, so it cannot be combined "
                                        "with enable_thinking: true (that needs constrained decoding)")
        thinking = kw["enable_thinking"] = False
    if spec is not None:  # the grammar is the whole answer: no reasoning before it (docs/structured_output.md)
        if req.chat_template_kwargs and req.chat_template_kwargs.enable_thinking:
            raise refuse("response_format", "cannot be combined with enable_thinking: true (the grammar applies "
                                            "to the whole answer)")
        thinking = kw["enable_thinking"] = False
    messages = [_message(m.model_dump(exclude_none=True), i) for i, m in enumerate(req.messages)]
    if req.logprobs:
        kw["logprobs"] = req.top_logprobs or 0
    return Submission(_drop_none(kw), chat=True, thinking=thinking, messages=messages, stream=bool(req.stream),
                      include_usage=_include_usage(req), logit_bias=req.logit_bias, tools=tools,
                      grammar_spec=spec, n=req.n or 1, logprobs=kw.get("logprobs"))


def _response_format(given: dict[str, Any] | None) -> dict[str, Any] | None:
    """The constraints spec of `response_format` (None: plain text): the object itself, checked (a 400 naming
    the field) when `prepare` compiles it (docs/structured_output.md, Specs)."""
    return None if (given or {}).get("type", "text") == "text" else given


def _tool_use(req: ChatRequest, parser: type[tool_calls.StreamParser] | None) -> ToolUse | None:
    """The request's tools and tool_choice (docs/serving.md, Tool calls), or None without tools. A 400 naming
    the field: a tool's JSON over MAX_TOOL_CHARS, two tools of one name, a tool_choice naming no tool or
    asking for a call without tools, tools (other than with "none") on a model whose template has none."""
    choice = req.tool_choice
    named = choice.function.name if not isinstance(choice, str) and choice is not None else None
    if not req.tools:
        if choice in ("required",) or named is not None:
            raise refuse("tool_choice", f"is {show(named or choice)}, but the request has no tools")
        return None
    tools = [t.model_dump(exclude_none=True) for t in req.tools]
    names = set()
    for i, tool in enumerate(tools):
        size = len(json.dumps(tool, ensure_ascii=False))
        if size > MAX_TOOL_CHARS:
            raise refuse(f"tools[{i}]", f"is {size} characters of JSON, more than {MAX_TOOL_CHARS}")
        name = tool["function"]["name"]
        if name in names:
            raise refuse(f"tools[{i}].function.name", f"repeats the name {show(name)} of an earlier tool")
        names.add(name)
    if named is not None and named not in names:
        raise refuse("tool_choice", f"names the function {show(named)}, which is not among the tools "
                                    f"({', '.join(sorted(names))})")
    if choice == "none":
        return ToolUse(tools, None)
    if parser is None:
        raise refuse("tools", "cannot be used: this model's chat template has no tool calls (serve it with "
                              "--tool-call-parser to read calls in a known format)")
    forced = named if named is not None else "" if choice == "required" else None
    return ToolUse(tools, parser, forced, req.parallel_tool_calls is not False)


def _message(m: dict[str, Any], i: int) -> dict[str, Any]:
    content = m.get("content")
    if isinstance(content, list):  # content parts: text only
        if any(p.get("type") != "text" or not isinstance(p.get("text"), str) for p in content):
            raise refuse(f"messages[{i}].content", "may only hold text parts ({\"type\": \"text\", \"text\": ...})")
        m["content"] = "".join(p["text"] for p in content)
    m.setdefault("content", "")
    if "tool_calls" in m:
        m["tool_calls"] = _history_calls(m["tool_calls"], f"messages[{i}].tool_calls")
    return m


def _history_calls(calls: Any, where: str) -> list[dict[str, Any]]:
    """An assistant message's earlier calls, for the chat template: OpenAI's `arguments` (a JSON object as
    text) as the object itself, as Qwen's templates iterate it (vLLM does the same)."""
    if not isinstance(calls, list):
        raise refuse(where, "must be a list of tool calls")
    out = []
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise refuse(f"{where}[{j}].function.name", "must be the called function's name (a string)")
        args = fn.get("arguments", "{}")
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except (ValueError, RecursionError):
                args = None
        if not isinstance(args, dict):
            raise refuse(f"{where}[{j}].function.arguments", "must be a JSON object written as a string")
        out.append({**call, "function": {**fn, "arguments": args}})
    return out


def completion_submission(req: CompletionRequest) -> Submission:
    if req.suffix is not None or req.best_of not in (None, 1):
        raise refuse("suffix" if req.suffix is not None else "best_of", "is not supported")
    kw = _sampling(req)
    kw["logprobs"] = req.logprobs
    if req.echo and req.logprobs is not None:
        kw["prompt_logprobs"] = req.logprobs
    sub = Submission(_drop_none(kw), chat=False, thinking=False, stream=bool(req.stream),
                     include_usage=_include_usage(req), logit_bias=req.logit_bias, n=req.n or 1, logprobs=req.logprobs,
                     echo=bool(req.echo))
    prompt = req.prompt
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one prompt (lm-evaluation-harness sends [[ids]])
    if isinstance(prompt, str):
        sub.text = prompt
    elif isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
        sub.ids = prompt
    elif isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, str) for p in prompt):
        raise refuse("prompt", f"must be one prompt per request, got {len(prompt)}")
    else:
        raise refuse("prompt", f"must be a string, a list of one string, a non-empty list of token ids or a "
                               f"list of one such list, got {show(prompt)}")
    return sub


def _drop_none(kw: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in kw.items() if v is not None}


# --- before the engine: the prompt as token ids ---------------------------------------------------------------
@functools.lru_cache(maxsize=4)
def chars_per_token(tokenizer) -> int:
    """The most characters one token can stand for: the longest vocabulary entry (byte-level and
    metaspace entries spell at least one character a byte or character they cover), times the
    normalizer's fold. A prompt of C characters is at least C / this many tokens."""
    longest = max(map(len, tokenizer.tok.get_vocab(with_added_tokens=True)))
    return longest * (NORMALIZER_FOLD if tokenizer.tok.normalizer is not None else 1)


def prepare(gen, sub: Submission) -> dict[str, Any]:
    """The engine's `Generator.submit` keyword arguments for `sub`: {"prompt_ids": [...], **parameters}.

    Runs off the batch-loop thread (the tokenizer releases the GIL). Everything the
    request brings is checked here, so admitting it cannot fail: parameters
    against the model's defaults and the engine (block_size), the rendered
    prompt's length against the context before tokenising it, then the token
    count. A refusal is a 400 naming the field.
    """
    check_logit_bias(sub.logit_bias, gen.cfg.vocab_size)
    try:
        settings = gen.settings(**sub.params)
    except CloverError as e:
        raise api_error(e, sub.chat) from None
    grammar = _grammar(gen, sub)
    if grammar is not None:
        try:
            settings = gen.constrained(settings, grammar)
        except CloverError as e:
            raise api_error(e, sub.chat) from None
    sub.decoding = settings.decoding
    sub.token_text = lambda i: gen.tokenizer.decode([i])
    if sub.ids is None:
        text = sub.text if sub.text is not None else _render(gen, sub, settings.enable_thinking)
        limit = gen.max_context * chars_per_token(gen.tokenizer)
        if len(text) > limit:
            raise ApiError(400, f"the prompt has {len(text)} characters, more than a context of {gen.max_context} "
                                f"tokens can hold (at most {limit} characters); shorten it",
                           param=sub.prompt_field, code="context_length_exceeded")
    try:  # the runtime's own tokenisation and checks (empty prompt, ids outside the vocabulary)
        if sub.messages is not None and sub.tools is not None:
            ids = gen.prompt_ids(prompt_ids=gen.tokenizer.apply_chat_template(
                sub.messages, settings.enable_thinking, tools=sub.tools.tools, assistant_prefix=sub.tools.opening))
        else:
            ids = gen.prompt_ids(sub.text, sub.messages, sub.ids, raw=sub.text is not None,
                                 enable_thinking=settings.enable_thinking)
    except CloverError as e:
        raise ApiError(400, f"{sub.prompt_field}: {e.message}", param=sub.prompt_field) from None
    need = context_needed(len(ids), settings.max_new_tokens, gen.block_size, gen.cfg.block_alignment)
    if need > gen.max_context:
        raise _too_long(gen, sub, len(ids), settings.max_new_tokens, need)
    if sub.echo:
        sub.echo_text, sub.echo_ids = sub.text if sub.text is not None else gen.tokenizer.decode(ids), ids
    return {"prompt_ids": ids, **sub.params, **({"grammar": grammar} if grammar is not None else {})}


def _grammar(gen, sub: Submission):
    """The request's compiled grammar (None without one): compiled on the constraints compiler's worker
    threads within its time and size limits, cached per spec; a refusal is a 400 naming the field."""
    if sub.grammar_spec is None:
        return None
    from clover_export.constraints import GrammarError, compile  # torch: imported once an engine exists

    try:
        return compile(sub.grammar_spec, gen.grammar_vocab())
    except GrammarError as e:
        raise refuse(e.field, e.why) from None


def check_logit_bias(bias: dict[str, float] | None, vocab_size: int) -> None:
    """A 400 naming `logit_bias` unless empty: a key that is no token id of the model (its id and the
    vocabulary's size named), a bias outside OpenAI's [-100, 100], else that biases are not supported."""
    for key, value in (bias or {}).items():
        if not re.fullmatch(r"-?[0-9]{1,20}", key):
            raise refuse("logit_bias", f"has the key {show(key)}, which is not a token id (keys are token ids "
                                       f"written as strings, such as \"42\")")
        if not 0 <= int(key) < vocab_size:
            raise refuse("logit_bias", f"has the token id {key}, outside the vocabulary of {vocab_size} tokens "
                                       f"(ids 0 to {vocab_size - 1})")
        if not -100 <= value <= 100:
            raise refuse("logit_bias", f"gives token {key} the bias {show(value)}, outside [-100, 100]")
    if bias:
        raise refuse("logit_bias", "is not supported (only {} or null)")


def _render(gen, sub: Submission, enable_thinking: bool) -> str:
    """The chat template on the client's messages (and tools), with a forced call's opening after it; any
    failure is the messages' (400 naming them)."""
    tools = sub.tools.tools if sub.tools is not None else None
    text = _template(gen, sub.messages, enable_thinking, tools)
    if sub.tools is not None and sub.tools.opening:
        _check_opening(gen, sub, enable_thinking, text)
        text += sub.tools.opening
    return text


def _template(gen, messages: list[dict[str, Any]], enable_thinking: bool, tools: list | None) -> str:
    try:
        return gen.tokenizer.render(messages, enable_thinking, tools=tools)
    except CloverError as e:
        raise refuse("messages", f"cannot be rendered by the chat template: {e.message}") from None
    except Exception as e:  # noqa: BLE001 - a template meeting values it did not expect (extra fields)
        raise refuse("messages", f"cannot be rendered by the chat template: {type(e).__name__}: {e}") from None


def _check_opening(gen, sub: Submission, enable_thinking: bool, prompt: str) -> None:
    """A forced call starts the assistant's turn with the opening the template itself writes for such a call
    (rendered: the same messages and one more assistant turn calling the function), else a 400: forcing it
    would show the model a turn its template never writes; that needs constrained decoding."""
    use = sub.tools
    name = use.forced or use.tools[0]["function"]["name"]
    call = {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_0", "type": "function", "function": {"name": name, "arguments": {}}}]}
    try:
        written = gen.tokenizer.render(sub.messages + [call], enable_thinking, tools=use.tools)
    except Exception:  # noqa: BLE001 - a template that cannot write the call cannot be forced into one either
        written = ""
    if written.count(use.opening) <= prompt.count(use.opening):
        raise refuse("tool_choice", f"forces a call, but this model's chat template does not write calls as the "
                                    f"{use.parser.name} format opens them; forcing one needs constrained "
                                    "decoding, which this server does not do yet")


def _too_long(gen, sub: Submission, prompt_tokens: int, max_tokens: int, need: int) -> ApiError:
    what = f"needs {need} positions (prompt {prompt_tokens} tokens + max_tokens {max_tokens} rounded up to blocks " \
           f"of {gen.block_size})"
    return ApiError(400, f"this request {what}, over the model's context of {gen.max_context}; shorten the "
                         f"{sub.prompt_field} or lower max_tokens", param=sub.prompt_field,
                    code="context_length_exceeded")


def api_error(e: CloverError, chat: bool = True) -> ApiError:
    """A request the runtime refused -> 400 naming the public parameter (context_length_exceeded when it cannot fit)."""
    text = e.message
    for inner, public in OPENAI_NAMES.items():
        text = text.replace(inner, public)
    if "over the context limit" in text:
        return ApiError(400, text, param="messages" if chat else "prompt", code="context_length_exceeded")
    m = re.search(r"parameter(?:\(s\))? '?(\w+)", text)
    return ApiError(400, text, param=m.group(1) if m else None)


# --- responses ------------------------------------------------------------------
class TextSplit:
    """Reasoning and content deltas of a growing response; their sums equal `final_parts` of the whole text.

    With thinking on, text before `</think>` is reasoning (all of it while no
    `</think>` came); each part is stripped, so leading whitespace is dropped
    and trailing whitespace held back until more text follows.
    """

    def __init__(self, thinking: bool, strip: bool = True):
        self.thinking, self.strip = thinking, strip
        self.text = ""
        self.sent = ["", ""]

    def push(self, delta: str, final: bool) -> tuple[str, str]:
        self.text += delta
        target = self.parts(self.text, final)
        out = tuple(t[len(s):] for t, s in zip(target, self.sent))
        self.sent = list(target)
        return out

    def parts(self, text: str, final: bool = True) -> tuple[str, str]:
        if not self.strip:
            return "", text
        if not self.thinking:
            return "", _clip(text, final)
        head, sep, tail = text.partition(THINK_END)
        if sep:
            return head.strip(), _clip(tail, final)
        if not final:  # hold back what may be the start of `</think>`
            head = head[:len(head) - _partial_suffix(head, THINK_END)]
        return _clip(head, final), ""


def _clip(s: str, final: bool) -> str:
    return s.strip() if final else s.lstrip().rstrip()


def _partial_suffix(s: str, marker: str) -> int:
    """Length of the longest suffix of s that is a proper prefix of marker."""
    for n in range(min(len(s), len(marker) - 1), 0, -1):
        if s.endswith(marker[:n]):
            return n
    return 0


def usage(results: list) -> dict[str, Any]:
    """OpenAI usage over a request's choices: the prompt once (as OpenAI counts it), the choices' tokens summed;
    `prompt_tokens_details.cached_tokens`: the first choice's prompt tokens resumed from the prefix cache."""
    first, completion = results[0], sum(r.response_tokens for r in results)
    return {"prompt_tokens": first.prompt_tokens, "completion_tokens": completion,
            "total_tokens": first.prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": first.cached_tokens}}


def clover_stats(res, decoding: str | None = None, logprobs: bool = False) -> dict[str, Any]:
    """The `clover` object: the request's decoding mode and the runtime's figures (DECODING.md 4, 5); with
    logprobs, which distribution they are (`Strategy.logprobs_source`: docs/serving.md, Logprobs)."""
    mode = getattr(res, "decoding", None) or decoding
    stats = {"decoding": mode, "denoise_steps": res.denoise_steps,
             "forwards": forwards(res), "tokens_per_forward": res.tokens_per_forward,
             "accepted_per_forward": getattr(res, "accepted_per_forward", 0.0),
             "distinct_experts_per_block": res.distinct_experts_per_block}
    if logprobs:
        stats["logprobs"] = modes.strategy(mode).logprobs_source
    return stats


# --- logprobs in OpenAI's shapes (docs/serving.md, Logprobs) --------------------------------------------------
LOGPROB_FLOOR = -9999.0  # vLLM's stand-in for -inf (JSON has no infinities)


def _lp(value: float) -> float:
    return max(value, LOGPROB_FLOOR) if value == value else LOGPROB_FLOOR


def chat_logprobs(sub: Submission, lps: list) -> dict[str, Any] | None:
    """A chat choice's `logprobs`: {"content": [{token, logprob, bytes, top_logprobs}], "refusal": null}."""
    if sub.logprobs is None:
        return None

    def one(token: int, lp: float) -> dict[str, Any]:
        text = sub.token_text(token)
        return {"token": text, "logprob": _lp(lp), "bytes": list(text.encode())}

    return {"content": [{**one(t.token, t.logprob), "top_logprobs": [one(i, v) for i, v in t.top[:sub.logprobs]]}
                        for t in lps], "refusal": None}


class CompletionLogprobs:
    """A completions choice's `logprobs` ({tokens, token_logprobs, top_logprobs, text_offset}), its text offsets
    counted across the stream's chunks."""

    def __init__(self, sub: Submission):
        self.sub, self.offset = sub, 0

    def of(self, lps: list, prompt_ids: list[int] = (), prompt_lps: list = ()) -> dict[str, Any] | None:
        """The tokens' logprobs; with `prompt_ids` (echo) the prompt's first, from `prompt_lps` (None for the
        first token, which follows nothing)."""
        if self.sub.logprobs is None:
            return None
        out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for token, t in zip(prompt_ids, prompt_lps):
            text = self.sub.token_text(token)
            out["tokens"].append(text)
            out["token_logprobs"].append(None if t is None else _lp(t.logprob))
            out["top_logprobs"].append(None if t is None else
                                       {self.sub.token_text(i): _lp(v) for i, v in t.top[:self.sub.logprobs]})
            out["text_offset"].append(self.offset)
            self.offset += len(text)
        for t in lps:
            text = self.sub.token_text(t.token)
            out["tokens"].append(text)
            out["token_logprobs"].append(_lp(t.logprob))
            out["top_logprobs"].append({self.sub.token_text(i): _lp(v) for i, v in t.top[:self.sub.logprobs]})
            out["text_offset"].append(self.offset)
            self.offset += len(text)
        return out


def choice_logprobs(sub: Submission, lps: list) -> dict[str, Any] | None:
    return chat_logprobs(sub, lps) if sub.chat else CompletionLogprobs(sub).of(lps)


def forwards(res) -> int:
    """Forwards the request took part in after its prompt (DECODING.md 5): the Result's, else (low_confidence)
    its denoise steps."""
    given = getattr(res, "forwards", None)
    return int(given) if given is not None else res.denoise_steps


class Reply:
    """The deltas of a growing response (reasoning, content, OpenAI tool-call deltas); joined, they are
    `parts` of the whole text (docs/serving.md, Tool calls).

    The content (after the reasoning, stripped as TextSplit strips it) goes through the request's tool-call
    parser, a forced call's opening first; the content outside the calls is stripped once more."""

    def __init__(self, sub: Submission):
        self.split = TextSplit(sub.thinking, strip=sub.chat)
        use = sub.tools if sub.tools is not None and sub.tools.parser is not None else None
        self.use, self.parser = use, use.parser(use.tools) if use else None
        self.clip = TextSplit(False)
        self.pending = use.opening if use else ""
        self.calls = 0  # calls shown so far

    def push(self, delta: str, final: bool) -> list[tuple[str, str, dict[str, Any] | None]]:
        """The deltas `delta` decides, in order: (reasoning, content, None) and ("", "", a tool-call delta)
        items; at least one item (the first carries the reasoning)."""
        reasoning, content = self.split.push(delta, final)
        if self.parser is None:
            return [(reasoning, content, None)]
        events = self.parser.feed(self.pending + content) + (self.parser.finish() if final else [])
        self.pending = ""
        out, text = [], ""
        for ev in filter(self.use.keeps, events):
            if isinstance(ev, tool_calls.TextDelta):
                text += ev.text
                continue
            out += self._text(text, False)
            text = ""
            out.append(("", "", self._call_delta(ev)))
        out += self._text(text, final)
        if not out or out[0][2] is not None:
            out.insert(0, ("", "", None))
        return [(reasoning, *out[0][1:])] + out[1:]

    def _text(self, text: str, final: bool) -> list[tuple[str, str, None]]:
        shown = self.clip.push(text, final)[1]
        return [("", shown, None)] if shown else []

    def _call_delta(self, ev) -> dict[str, Any]:
        """OpenAI's streamed tool call: index, id, type and name first (arguments ""), then argument pieces."""
        if isinstance(ev, tool_calls.CallStart):
            self.calls += 1
            return {"index": ev.index, "id": ev.id, "type": "function",
                    "function": {"name": ev.name, "arguments": ""}}
        return {"index": ev.index, "function": {"arguments": ev.fragment}}

    def parts(self, text: str) -> tuple[str, str, list[dict[str, Any]]]:
        """The whole response: (reasoning, content, tool calls in OpenAI's shape)."""
        reasoning, content = self.split.parts(text)
        if self.parser is None:
            return reasoning, content, []
        content, calls = self.parser.parse(self.use.opening + content, self.use.tools)
        calls = calls if self.use.parallel else calls[:1]
        self.calls = len(calls)
        return reasoning, content.strip(), [c.openai() for c in calls]

    def finish_reason(self, reason: str) -> str:
        """OpenAI's finish_reason: "tool_calls" when the model stopped after calling tools."""
        finish = FINISH_REASONS.get(reason, reason)
        return "tool_calls" if self.calls and finish == "stop" else finish


def response(sub: Submission, model: str, results: list) -> dict[str, Any]:
    """The non-streaming body of a finished request: one choice per Result, in order."""
    choices = [_choice(sub, i, res) for i, res in enumerate(results)]
    kind, prefix = ("chat.completion", "chatcmpl-") if sub.chat else ("text_completion", "cmpl-")
    return {"id": prefix + sub.id, "object": kind, "created": sub.created, "model": model, "choices": choices,
            "usage": usage(results), "clover": clover_stats(results[0], sub.decoding, sub.logprobs is not None)}


def _choice(sub: Submission, index: int, res) -> dict[str, Any]:
    reply = Reply(sub)
    reasoning, content, calls = reply.parts(res.text)
    finish = reply.finish_reason(res.finish_reason)
    if sub.chat:
        message = {"role": "assistant", "content": content if content or not calls else None}
        if calls:
            message["tool_calls"] = calls
        if sub.thinking:
            message["reasoning_content"] = reasoning
        return {"index": index, "message": message, "finish_reason": finish,
                "logprobs": choice_logprobs(sub, res.logprobs)}
    if sub.echo:  # the prompt first, its tokens' logprobs too (the first token's null)
        return {"index": index, "text": sub.echo_text + content, "finish_reason": finish,
                "logprobs": CompletionLogprobs(sub).of(res.logprobs, sub.echo_ids, res.prompt_logprobs)}
    return {"index": index, "text": content, "finish_reason": finish, "logprobs": choice_logprobs(sub, res.logprobs)}


class At(NamedTuple):
    """Where a streaming chunk stands: its choice's index, whether it is that choice's first chunk, and its
    tokens' logprobs in the choice's shape (None: not asked, or none in this chunk)."""

    index: int = 0
    first: bool = False
    logprobs: dict[str, Any] | None = None


def chunk(sub: Submission, model: str, reasoning: str = "", content: str = "", finish: str | None = None,
          at: At = At(), res=None, tool_call: dict[str, Any] | None = None) -> dict[str, Any]:
    """One streaming chunk of choice `at.index`: a block's deltas, one tool-call delta, the finishing chunk, or
    (res: the choices' Results) the usage chunk."""
    index, first, logprobs = at
    if sub.chat:
        delta: dict[str, Any] = {"role": "assistant"} if first else {}
        if content or first:
            delta["content"] = content
        if reasoning:
            delta["reasoning_content"] = reasoning
        if tool_call is not None:
            delta["tool_calls"] = [tool_call]
        choices = [{"index": index, "delta": delta, "finish_reason": finish, "logprobs": logprobs}]
        kind, prefix = "chat.completion.chunk", "chatcmpl-"
    else:
        choices = [{"index": index, "text": content, "finish_reason": finish, "logprobs": logprobs}]
        kind, prefix = "text_completion", "cmpl-"
    body = {"id": prefix + sub.id, "object": kind, "created": sub.created, "model": model,
            "choices": [] if res is not None else choices}
    if res is not None:
        body["usage"] = usage(res)
        body["clover"] = clover_stats(res[0], sub.decoding, sub.logprobs is not None)
    elif sub.include_usage:  # OpenAI: every chunk carries usage, null until the usage chunk
        body["usage"] = None
    return body
