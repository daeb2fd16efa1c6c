import json
import pathlib

import pytest
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from clover_export.tiny.tokenizer_assets import (
    END_TOKENS,
    MASK_TOKEN,
    SPECIAL_TOKENS,
    THINK_END,
    build_tokenizer_files,
    corpus_lines,
    special_token_ids,
)

FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
EXPECTED_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>", "<|mask|>"]
MESSAGES = [{"role": "user", "content": "What is 12 + 34?"}]
PROMPT = "<|im_start|>user\nWhat is 12 + 34?<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def out_dir(tmp_path_factory) -> pathlib.Path:
    d = tmp_path_factory.mktemp("tok")
    build_tokenizer_files(d)
    return d


@pytest.fixture(scope="module")
def tok(out_dir) -> Tokenizer:
    return Tokenizer.from_file(str(out_dir / "tokenizer.json"))


def _render(out_dir, **kwargs) -> str:
    env = ImmutableSandboxedEnvironment()
    template = env.from_string((out_dir / "chat_template.jinja").read_text(encoding="utf-8"))
    return template.render(messages=MESSAGES, **kwargs)


def test_files_written(out_dir):
    for name in FILES:
        assert (out_dir / name).is_file() and (out_dir / name).stat().st_size > 0


def test_build_is_deterministic(out_dir, tmp_path):
    build_tokenizer_files(tmp_path)
    for name in FILES:
        assert (tmp_path / name).read_bytes() == (out_dir / name).read_bytes(), name
    assert corpus_lines(0) == corpus_lines(0)
    assert corpus_lines(0) != corpus_lines(1)


def test_constants():
    assert SPECIAL_TOKENS == EXPECTED_SPECIALS
    assert MASK_TOKEN == "<|mask|>"
    assert END_TOKENS == ["<|im_end|>", "<|endoftext|>"]
    assert THINK_END == "</think>"
    assert special_token_ids() == {t: i for i, t in enumerate(EXPECTED_SPECIALS)}


def test_special_token_ids(tok):
    for i, t in enumerate(EXPECTED_SPECIALS):
        assert tok.token_to_id(t) == i
        assert tok.id_to_token(i) == t
        assert tok.encode(t).ids == [i]
    added = {a.content: a for a in tok.get_added_tokens_decoder().values()}
    assert all(added[t].special for t in EXPECTED_SPECIALS)


def test_specials_in_text_encode_to_single_id(tok):
    ids = special_token_ids()
    enc = tok.encode(f"hi{MASK_TOKEN}there<think>x</think><|im_end|>")
    for t in (MASK_TOKEN, "<think>", "</think>", "<|im_end|>"):
        assert enc.ids.count(ids[t]) == 1
    assert "<" not in "".join(tok.id_to_token(i) for i in enc.ids if i >= len(EXPECTED_SPECIALS))


def test_vocab_size(tok):
    assert len(EXPECTED_SPECIALS) + 256 < tok.get_vocab_size() <= 512


def test_digits_are_single_tokens(tok):
    for d in "0123456789":
        assert len(tok.encode(d).ids) == 1
    assert tok.encode("12345").tokens == list("12345")
    assert all(len(t.lstrip("Ġ")) <= 1 for t in tok.encode("482 + 39 = 521").tokens if any(c.isdigit() for c in t))


@pytest.mark.parametrize("text", [
    "Hello, world!",
    "  leading and trailing spaces  \n\ttabs",
    "naïve café — 日本語 テキスト, emoji 🦀🎉, Ελληνικά, e\u0301",
    "What is 482 + 39?\n482 + 39 = 521",
    "",
])
def test_round_trip_text(tok, text):
    assert tok.decode(tok.encode(text).ids, skip_special_tokens=False) == text


def test_chat_template_files(out_dir):
    cfg = json.loads((out_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
    assert cfg["bos_token"] is None
    assert cfg["eos_token"] == "<|im_end|>"
    assert cfg["pad_token"] == "<|endoftext|>"
    assert cfg["mask_token"] == "<|mask|>"
    assert cfg["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert isinstance(cfg["model_max_length"], int) and cfg["model_max_length"] > 0
    assert "chat_template" not in cfg
    assert {int(k): v["content"] for k, v in cfg["added_tokens_decoder"].items()} == dict(enumerate(EXPECTED_SPECIALS))
    assert all(v["special"] and not v["normalized"] for v in cfg["added_tokens_decoder"].values())


@pytest.mark.parametrize("kwargs, suffix", [
    ({"enable_thinking": False}, "<think>\n\n</think>\n\n"),
    ({"enable_thinking": True}, "<think>\n"),
    ({}, "<think>\n"),
])
def test_chat_template_render_and_round_trip(out_dir, tok, kwargs, suffix):
    text = _render(out_dir, add_generation_prompt=True, **kwargs)
    assert text == PROMPT + suffix
    enc = tok.encode(text)
    assert tok.decode(enc.ids, skip_special_tokens=False) == text
    ids = special_token_ids()
    assert enc.ids[0] == ids["<|im_start|>"]
    assert enc.ids.count(ids["<|im_end|>"]) == 1
    assert enc.ids.count(ids[THINK_END]) == (1 if kwargs.get("enable_thinking") is False else 0)


def test_chat_template_without_generation_prompt(out_dir):
    assert _render(out_dir) == "<|im_start|>user\nWhat is 12 + 34?<|im_end|>\n"
