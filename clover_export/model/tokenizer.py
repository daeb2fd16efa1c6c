"""Tokenizer and chat template from the model folder, without transformers (DECODING.md 1.1).

`tokenizer.json` through the `tokenizers` library; the chat template
(`chat_template.jinja`, else `tokenizer_config.json`'s `chat_template`)
rendered in Jinja's immutable sandbox, since templates come with downloaded
models: any access to an unsafe attribute (`__class__`, `append`, ...) is
refused with a CloverError instead of rendering as empty.

Message text is text: a control-token string in a message or a tool
definition (`<|im_end|>`, `<think>`, any added token) is tokenised as the
characters it is, while the template's own markers stay tokens
(`apply_chat_template`; docs/serving.md, Message text and control tokens).
`tools` reach the template as Hugging Face's `apply_chat_template` passes them.
"""

from __future__ import annotations

import functools
import json
import re
from datetime import datetime
from pathlib import Path
from typing import Any

from jinja2 import TemplateError
from jinja2.exceptions import SecurityError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from clover_export.core.errors import CloverError

IM_END = "<|im_end|>"
THINK_END = "</think>"
# Unicode's private-use characters of the basic plane: stand-ins for the control strings of message text while
# the template renders (one per distinct string, each absent from every message string and from the template)
PRIVATE_USE = range(0xE000, 0xF900)
_PRIVATE_USE_CHAR = re.compile("[\ue000-\uf8ff]")


class StrictSandbox(ImmutableSandboxedEnvironment):
    """The immutable sandbox, raising on unsafe attribute access rather than yielding Undefined."""

    def unsafe_undefined(self, obj: Any, attribute: str):
        raise SecurityError(f"access to attribute {attribute!r} of {type(obj).__name__!r} object is unsafe")


def _raise(message: str):
    raise TemplateError(message)


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value


def _strings(value: Any):
    """Every string in a JSON-like value (dict keys and values, list items, at any depth)."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from _strings(k)
            yield from _strings(v)
    elif isinstance(value, list):
        for v in value:
            yield from _strings(v)


def _map_strings(value: Any, fn) -> Any:
    """A copy of a JSON-like value with `fn` applied to every string in it, dict keys too (a tool call's
    argument names are written into the prompt)."""
    if isinstance(value, str):
        return fn(value)
    if isinstance(value, dict):
        return {_map_strings(k, fn): _map_strings(v, fn) for k, v in value.items()}
    if isinstance(value, list):
        return [_map_strings(v, fn) for v in value]
    return value


def _alternation(words: list[str]) -> re.Pattern | None:
    """A pattern matching any of `words`, the longest first where several start at one place."""
    return re.compile("|".join(map(re.escape, sorted(words, key=len, reverse=True)))) if words else None


class ChatTokenizer:
    """Encode, decode and apply the chat template."""

    def __init__(self, model_dir: str | Path):
        from tokenizers import Tokenizer

        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise CloverError("tokenizer", f"{path}: file not found", "the model folder must hold tokenizer.json")
        try:
            self.tok = Tokenizer.from_file(str(path))
        except Exception as e:  # the library raises a bare Exception on bad files
            raise CloverError("tokenizer", f"{path}: cannot be read ({e})") from None
        cfg_path = model_dir / "tokenizer_config.json"
        self.config = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
        self.template_source = self._find_template(model_dir)
        self.template = None
        if self.template_source is not None:
            env = StrictSandbox(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
            env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False, **kw: json.dumps(
                x, indent=indent, ensure_ascii=ensure_ascii, **kw)
            env.globals["raise_exception"] = _raise
            env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
            try:
                self.template = env.from_string(self.template_source)
            except TemplateError as e:
                raise CloverError("tokenizer", f"{model_dir}: chat template does not parse ({e})") from None
        added = self.tok.get_added_tokens_decoder()
        self.added_ids = frozenset(added)
        self._control = _alternation([t.content for t in added.values()])
        # added tokens the library matches after its normalizer: found in a message's normalized text only
        self._folded = _alternation([t.content for t in added.values() if t.normalized]) \
            if self.tok.normalizer is not None else None

    def _find_template(self, model_dir: Path) -> str | None:
        jinja = model_dir / "chat_template.jinja"
        if jinja.is_file():
            return jinja.read_text()
        t = self.config.get("chat_template")
        if isinstance(t, list):  # [{"name": ..., "template": ...}]
            t = next((x["template"] for x in t if x.get("name") == "default"), None)
        return t

    # --- ids ---------------------------------------------------------------
    def token_id(self, token: str) -> int | None:
        return self.tok.token_to_id(token)

    @property
    def im_end_id(self) -> int | None:
        return self.token_id(IM_END)

    @property
    def think_end_id(self) -> int | None:
        return self.token_id(THINK_END)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self.tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=False)

    # --- chat template --------------------------------------------------------
    def render(self, messages: list[dict[str, Any]], enable_thinking: bool = True,
               tools: list[dict[str, Any]] | None = None, **extra: Any) -> str:
        """The chat template's text for `messages` with the generation prompt; `tools` as Hugging Face passes
        them (the template sees `tools`, None when there are none)."""
        if self.template is None:
            raise CloverError("tokenizer", "this model folder has no chat template",
                              "pass raw text (--raw) or prompt ids, or add chat_template.jinja")
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            raise CloverError("generate", "messages must be a list of {'role': ..., 'content': ...} objects")
        context = {
            "messages": messages, "add_generation_prompt": True, "enable_thinking": enable_thinking,
            "bos_token": _token_text(self.config.get("bos_token")) or "",
            "eos_token": _token_text(self.config.get("eos_token")) or "",
            "tools": tools,
            **extra,
        }
        try:
            return self.template.render(**context)
        except SecurityError as e:
            raise CloverError("tokenizer", f"chat template refused: {e}",
                              "the template tried to reach Python internals; it is not run") from None
        except TemplateError as e:
            raise CloverError("tokenizer", f"chat template failed: {e}") from None

    def apply_chat_template(self, messages: list[dict[str, Any]], enable_thinking: bool = True,
                            tools: list[dict[str, Any]] | None = None, assistant_prefix: str = "",
                            **extra) -> list[int]:
        """The chat prompt's token ids, every string of `messages` and `tools` as text (docs/serving.md,
        Message text and control tokens). `assistant_prefix`: the server's own text that starts the
        assistant's turn (a forced tool call's opening), appended to the rendered prompt before tokenising.
        Without a control-token string the ids are the rendered text's tokens, as the library encodes it.
        Otherwise each such string is swapped for a private-use stand-in character while the template
        renders, so the template's own markers are the only control tokens left in the text; those become
        their tokens, and the text between them, the strings put back, goes through the tokenizer without
        its added tokens, where no string is a control token."""
        stand_ins = self._stand_ins([messages, tools])
        if not stand_ins:
            return self.encode(self.render(messages, enable_thinking, tools, **extra) + assistant_prefix)
        guard = lambda s: self._control.sub(lambda m: stand_ins[m.group()], s)  # noqa: E731
        text = self.render(_map_strings(messages, guard), enable_thinking, _map_strings(tools, guard), **extra)
        text += assistant_prefix
        restore = str.maketrans({c: t for t, c in stand_ins.items()})
        ids, start = [], 0
        enc = self.tok.encode(text, add_special_tokens=False)
        for tid, (a, b) in zip(enc.ids, enc.offsets):
            if tid in self.added_ids:  # a marker of the template's own text
                ids += self._text_ids(text[start:a].translate(restore))
                ids.append(tid)
                start = b
        return ids + self._text_ids(text[start:].translate(restore))

    def _stand_ins(self, messages: Any) -> dict[str, str]:
        """{control string: its stand-in character} for the control strings in the messages' strings."""
        strings = list(_strings(messages))
        found = sorted({m.group() for s in strings for m in self._control.finditer(s)}) if self._control else []
        if self._folded is not None:
            for s in strings:
                if len(self._folded.findall(self.tok.normalizer.normalize_str(s))) > len(self._folded.findall(s)):
                    raise CloverError("tokenizer", f"the message text {s[:40]!r} becomes a control token once "
                                                   "the tokenizer normalizes it")
        if not found:
            return {}
        taken = {c for s in (self.template_source or "", *strings) for c in _PRIVATE_USE_CHAR.findall(s)}
        free = (chr(c) for c in PRIVATE_USE if chr(c) not in taken)
        stand_ins = dict(zip(found, free))
        if len(stand_ins) < len(found):
            raise CloverError("tokenizer", "the messages use every private-use character; no stand-in is left "
                                           "for their control-token strings")
        return stand_ins

    @functools.cached_property
    def _without_added_tokens(self):
        """This tokenizer less its added tokens: normalizer, pre-tokenizer and model only."""
        from tokenizers import Tokenizer

        spec = json.loads(self.tok.to_str())
        spec["added_tokens"] = []
        return Tokenizer.from_str(json.dumps(spec))

    def _text_ids(self, text: str) -> list[int]:
        """`text` as text: no string in it becomes an added token."""
        ids = self._without_added_tokens.encode(text, add_special_tokens=False).ids if text else []
        if self.added_ids.intersection(ids):  # a model vocabulary that spells a control token from plain text
            raise CloverError("tokenizer", f"the text {text[:40]!r} tokenises to a control token")
        return ids
