"""Deterministic tokenizer assets for the embedded tiny demo model.

Tokenization, BPE training and (de)serialisation are done by the Hugging Face
``tokenizers`` library; the chat template is plain Jinja.  The only hand-written
parts are the ones no library provides: the small synthetic training corpus,
the ``tokenizer_config.json`` contents and the ChatML template text.

Digits are split into single characters before byte-level BPE runs, so every
digit 0-9 is always exactly one token (keeps arithmetic learnable).
"""

from __future__ import annotations

import json
import pathlib
import random

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>", "<|mask|>"]
MASK_TOKEN = "<|mask|>"
END_TOKENS = ["<|im_end|>", "<|endoftext|>"]
THINK_END = "</think>"
VOCAB_SIZE = 512
MODEL_MAX_LENGTH = 2048

# Qwen3-style ChatML with Qwen3.6's tool format: `tools` listed in a system turn before the messages (the first
# system message's text after them), an assistant's `tool_calls` written as `<tool_call>` / `<function=NAME>` /
# `<parameter=KEY>` XML after its content, `tool` messages as `<tool_response>` blocks of one user turn.
# The tool list is short, one `NAME(KEY, ...)` line a tool between `<tools>` tags, where Qwen3.6 writes each
# tool's JSON and ~700 tokens of instructions: in this 512-token vocabulary that preamble would be ~850 tokens,
# more than everything else the demo model is trained on together (docs/serving.md, Tool calls).
# Without tools and tool messages it renders plain ChatML. Only `{%- -%}` tags and expressions, so the output
# is the same with or without trim_blocks/lstrip_blocks (Hugging Face enables both).
CHAT_TEMPLATE = r"""{%- if tools -%}
{{- '<|im_start|>system\n<tools>' -}}
{%- for tool in tools -%}
{%- set fn = tool['function'] if tool['function'] is defined else tool -%}
{%- set params = (fn['parameters'] or {})['properties'] -%}
{{- '\n' + fn['name'] + '(' + ((params if params is mapping else {}) | list | join(', ')) + ')' -}}
{%- endfor -%}
{{- '\n</tools>' -}}
{%- if messages[0]['role'] == 'system' and messages[0]['content'] | trim -%}
{{- '\n\n' + messages[0]['content'] | trim -}}
{%- endif -%}
{{- '<|im_end|>\n' -}}
{%- endif -%}
{%- for message in messages -%}
{%- if message['role'] == 'tool' -%}
{%- if loop.first or loop.previtem['role'] != 'tool' -%}
{{- '<|im_start|>user' -}}
{%- endif -%}
{{- '\n<tool_response>\n' + message['content'] + '\n</tool_response>' -}}
{%- if loop.last or loop.nextitem['role'] != 'tool' -%}
{{- '<|im_end|>\n' -}}
{%- endif -%}
{%- elif not (tools and loop.first and message['role'] == 'system') -%}
{{- '<|im_start|>' + message['role'] + '\n' + message['content'] -}}
{%- if message['role'] == 'assistant' and message['tool_calls'] is defined and message['tool_calls'] -%}
{%- for tool_call in message['tool_calls'] -%}
{%- set call = tool_call['function'] if tool_call['function'] is defined else tool_call -%}
{%- if not loop.first -%}
{{- '\n' -}}
{%- elif message['content'] | trim -%}
{{- '\n\n' -}}
{%- endif -%}
{{- '<tool_call>\n<function=' + call['name'] + '>\n' -}}
{%- if call['arguments'] is mapping -%}
{%- for name in call['arguments'] -%}
{%- set value = call['arguments'][name] -%}
{{- '<parameter=' + name + '>\n' -}}
{{- (value | tojson) if value is mapping or (value is sequence and value is not string) else (value | string) -}}
{{- '\n</parameter>\n' -}}
{%- endfor -%}
{%- endif -%}
{{- '</function>\n</tool_call>' -}}
{%- endfor -%}
{%- endif -%}
{{- '<|im_end|>\n' -}}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
{{- '<|im_start|>assistant\n' -}}
{%- if enable_thinking is defined and enable_thinking is false -%}
{{- '<think>\n\n</think>\n\n' -}}
{%- else -%}
{{- '<think>\n' -}}
{%- endif -%}
{%- endif -%}
"""

_WORDS = ("cat dog tree house river stone light water apple music green table "
          "paper robot model token number answer list word order small").split()
_CHAT = [
    "Hello! How can I help you today?", "Thanks, that was really helpful.",
    "Can you explain how this works?", "Sure, here is a short answer.",
    "I think the answer is correct.", "Let me think about it step by step.",
    "Please sort the list in ascending order.", "What is the capital of France?",
    "The capital of France is Paris.", "Could you reverse this word for me?",
    "You are a helpful assistant.", "Good morning, the weather is nice today.",
]


def corpus_lines(seed: int = 0) -> list[str]:
    """The deterministic training corpus: chat text plus the demo's synthetic tasks."""
    rng = random.Random(seed)
    lines: list[str] = []
    for _ in range(400):
        a, b = rng.randint(0, 999), rng.randint(0, 999)
        lines += [f"What is {a} + {b}?", f"{a} + {b} = {a + b}", f"The answer is {a + b}."]
        nums = [rng.randint(0, 20) for _ in range(rng.randint(3, 6))]
        lines += [f"Sort: {' '.join(map(str, nums))}",
                  f"Sorted: {' '.join(map(str, sorted(nums)))}",
                  f"Sort the list {nums} in ascending order."]
        word = rng.choice(_WORDS)
        lines += [f"Reverse the word: {word}", f"Reversed: {word[::-1]}",
                  f"The word {word} reversed is {word[::-1]}."]
        role = rng.choice(["system", "user", "assistant"])
        lines.append(f"{role}\n{rng.choice(_CHAT)} {rng.choice(_CHAT)}")
    return lines


def _train() -> Tokenizer:
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus_lines(0), trainer=trainer)
    return tok


def special_token_ids() -> dict[str, int]:
    """Ids of the special tokens; they are added first, so they are 0..5."""
    return {token: i for i, token in enumerate(SPECIAL_TOKENS)}


def _tokenizer_config() -> dict:
    added = {
        str(i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                 "single_word": False, "special": True}
        for t, i in special_token_ids().items()
    }
    return {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": added,
        "additional_special_tokens": [t for t in SPECIAL_TOKENS if t != MASK_TOKEN and t not in END_TOKENS],
        "bos_token": None,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "mask_token": MASK_TOKEN,
        "model_max_length": MODEL_MAX_LENGTH,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": None,
    }


def build_tokenizer_files(out_dir: pathlib.Path) -> None:
    """Write tokenizer.json, tokenizer_config.json and chat_template.jinja into out_dir."""
    out_dir = pathlib.Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok = _train()
    got = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    if got != special_token_ids():
        raise RuntimeError(f"special token ids not stable: {got}")
    (out_dir / "tokenizer.json").write_text(tok.to_str(pretty=True) + "\n", encoding="utf-8")
    (out_dir / "tokenizer_config.json").write_text(
        json.dumps(_tokenizer_config(), indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    (out_dir / "chat_template.jinja").write_text(CHAT_TEMPLATE, encoding="utf-8")
