"""Per-step cost of a grammar (docs/structured_output.md): what a constrained request adds to each decoding
step on the CPU, measured on random walks through the mask.

    python bench/grammar_cost.py                        # the embedded default's tokenizer (512 ids)
    python bench/grammar_cost.py --model-dir DIR --vocab-size N --end-ids 151645,151643
    python bench/grammar_cost.py --synthetic 151669 --vocab-size 151936   # a Qwen-sized vocabulary
    python bench/grammar_cost.py --json out.json

`--synthetic N` stands in for a full-size tokenizer where none is at hand: a byte-level BPE vocabulary of N
pieces (the 256 bytes, then random letter, digit, space and punctuation pieces of 2-10 characters, the tiny
tokenizer's special tokens), so mask sizes and the engine's token trie have the real model's scale.

For each spec (a JSON object, a nested JSON schema, two tools in the Qwen3.6 XML format): compile time (cold,
then a cache hit), a request's matcher (a copy of the compiled start state), and per step: the mask fill,
accepting the sampled token, and masking one row of logits in place (unpack + -inf); then the whole
`apply_masks_` for a batch of 8 constrained rows. Medians over every step of 20 seeded walks; the walk picks a
random allowed token, half the time one that closes a value, so walks end.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

from clover_export.constraints import GrammarCompiler, allocate_bitmask, apply_bitmask_, apply_masks_, tokenizer_info
from clover_export.tiny import TRAINED_DIR
from clover_export.tiny.tokenizer_assets import END_TOKENS, VOCAB_SIZE, special_token_ids

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                         "days": {"type": "integer", "minimum": 1, "maximum": 7}},
        "required": ["city"]}}},
    {"type": "function", "function": {"name": "sort_digits", "parameters": {
        "type": "object", "properties": {"digits": {"type": "array", "items": {"type": "integer"}, "maxItems": 8},
                                         "reverse": {"type": "boolean"}}, "required": ["digits"]}}},
]
NESTED = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 16}, "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 4},
    "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16},
                                                 "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                "required": ["city", "zip"], "additionalProperties": False}},
    "required": ["name", "age", "tags", "address"], "additionalProperties": False}
SPECS = {
    "json_object": {"type": "json_object"},
    "json_schema (nested)": {"type": "json_schema", "json_schema": {"name": "person", "schema": NESTED}},
    "tool_calls (2 tools)": {"type": "tool_calls", "tools": TOOLS, "tool_choice": "required"},
}
STRUCTURE = set('"{}[],:') | {"\n</"}


def synthetic_model_dir(size: int, seed: int = 0) -> Path:
    """A folder with a byte-level BPE tokenizer.json of `size` ids (module docstring)."""
    import string
    import tempfile

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    specials = list(special_token_ids())
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    pieces, rng = dict.fromkeys(sorted(alphabet)), random.Random(seed)
    chars = string.ascii_letters + string.digits + "Ġ" * 8 + "{}[]\":,.-_'"
    while len(pieces) < size - len(specials):
        pieces.setdefault("".join(rng.choice(chars) for _ in range(rng.randint(2, 10))))
    vocab = {t: i for i, t in enumerate([*specials, *pieces])}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(specials)
    out = Path(tempfile.mkdtemp(prefix="grammar-cost-"))
    tok.save(str(out / "tokenizer.json"))
    return out


def ms(seconds: list[float]) -> float:
    return statistics.median(seconds) * 1e3


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def closing_ids(vocab) -> torch.Tensor:
    """[vocab_size] bool: the end tokens and the tokens that hold a character closing a JSON or XML value."""
    out = torch.zeros(vocab.vocab_size, dtype=torch.bool)
    for t in range(vocab.text_size):
        out[t] = t in vocab.end_ids or any(s in vocab.tokenizer.decode_str([t]) for s in STRUCTURE)
    return out


def walk_costs(grammar, seed: int, costs: dict[str, list[float]], closing_mask: torch.Tensor) -> int:
    """One random walk (at most 400 steps); appends each step's fill, accept and one-row mask times."""
    vocab, rng, max_steps = grammar.vocab, random.Random(seed), 400
    matcher, row = grammar.matcher(), allocate_bitmask(1, grammar.vocab)
    logits = torch.randn(1, vocab.vocab_size)
    steps = 0
    while not matcher.is_terminated() and steps < max_steps:
        costs["fill mask"].append(timed(lambda: matcher.fill_mask(row[0])))
        costs["mask logits (1 row)"].append(timed(lambda: apply_bitmask_(logits, row, [0])))
        allowed = torch.isfinite(logits[0])
        logits.normal_()
        closing = (allowed & closing_mask).nonzero().flatten().tolist()
        token = rng.choice(closing if closing and rng.random() < 0.5 else allowed.nonzero().flatten().tolist())
        costs["accept"].append(timed(lambda: matcher.accept(token)))
        steps += 1
    return steps


def batch_cost(grammar, rows: int = 8, repeats: int = 50) -> float:
    """apply_masks_ for `rows` constrained rows at their start state (fill + unpack + -inf), median ms."""
    matchers = [grammar.matcher() for _ in range(rows)]
    logits, bitmask = torch.randn(rows, grammar.vocab.vocab_size), allocate_bitmask(rows, grammar.vocab)
    return ms([timed(lambda: apply_masks_(logits, matchers, bitmask)) for _ in range(repeats)])


def measure(compiler: GrammarCompiler, spec: dict, closing_mask: torch.Tensor) -> dict:
    cold = timed(lambda: compiler.compile(spec))
    hit = timed(lambda: compiler.compile(spec))
    grammar = compiler.compile(spec)
    costs = {"fill mask": [], "accept": [], "mask logits (1 row)": []}
    steps = sum(walk_costs(grammar, seed, costs, closing_mask) for seed in range(20))
    out = {"compile cold ms": cold * 1e3, "compile cache hit ms": hit * 1e3,
           "new matcher ms": ms([timed(grammar.matcher) for _ in range(50)]), "steps": steps}
    out.update({f"{k} ms": ms(v) for k, v in costs.items()})
    out["per step ms (fill + accept + mask)"] = sum(out[f"{k} ms"] for k in costs)
    out["apply_masks_ 8 rows ms"] = batch_cost(grammar)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-dir", type=Path, default=TRAINED_DIR, help="a folder with tokenizer.json")
    ap.add_argument("--vocab-size", type=int, default=VOCAB_SIZE, help="the model's vocab size (mask width)")
    ap.add_argument("--end-ids", default=",".join(str(special_token_ids()[t]) for t in END_TOKENS))
    ap.add_argument("--synthetic", type=int, help="a synthetic byte-level vocabulary of this many ids instead")
    ap.add_argument("--json", type=Path, help="also write the numbers here")
    args = ap.parse_args()
    torch.set_num_threads(1)
    model_dir = synthetic_model_dir(args.synthetic) if args.synthetic else args.model_dir
    vocab = tokenizer_info(model_dir, args.vocab_size, [int(x) for x in args.end_ids.split(",")])
    compiler = GrammarCompiler(vocab)
    closing_mask = closing_ids(vocab)
    results = {name: measure(compiler, spec, closing_mask) for name, spec in SPECS.items()}
    compiler.close()
    print(f"vocab {args.vocab_size} ids ({vocab.text_size} in the tokenizer), torch {torch.__version__}, "
          f"1 torch thread, {sys.platform}")
    for name, r in results.items():
        print(f"\n{name}  ({r['steps']} steps)")
        for k, v in r.items():
            if k != "steps":
                print(f"  {k:38s} {v:8.3f}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
