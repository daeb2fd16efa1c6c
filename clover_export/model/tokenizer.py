"""Tokenizer and chat template from the model folder, without transformers (DECODING.md 1.1).

`tokenizer.json` through the `tokenizers` library; the chat template
(`chat_template.jinja`, else `tokenizer_config.json`'s `chat_template`)
rendered in Jinja's immutable sandbox, since templates come with downloaded
models: any access to an unsafe attribute (`__class__`, `append`, ...) is
refused with a CloverError instead of rendering as empty.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

from jinja2 import TemplateError
from jinja2.exceptions import SecurityError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from clover_export.core.errors import CloverError

IM_END = "<|im_end|>"
THINK_END = "</think>"


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
    def render(self, messages: list[dict[str, Any]], enable_thinking: bool = True, **extra: Any) -> str:
        if self.template is None:
            raise CloverError("tokenizer", "this model folder has no chat template",
                              "pass raw text (--raw) or prompt ids, or add chat_template.jinja")
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            raise CloverError("generate", "messages must be a list of {'role': ..., 'content': ...} objects")
        context = {
            "messages": messages, "add_generation_prompt": True, "enable_thinking": enable_thinking,
            "bos_token": _token_text(self.config.get("bos_token")) or "",
            "eos_token": _token_text(self.config.get("eos_token")) or "",
            **extra,
        }
        try:
            return self.template.render(**context)
        except SecurityError as e:
            raise CloverError("tokenizer", f"chat template refused: {e}",
                              "the template tried to reach Python internals; it is not run") from None
        except TemplateError as e:
            raise CloverError("tokenizer", f"chat template failed: {e}") from None

    def apply_chat_template(self, messages: list[dict[str, Any]], enable_thinking: bool = True, **extra) -> list[int]:
        return self.encode(self.render(messages, enable_thinking, **extra))
