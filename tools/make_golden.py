#!/usr/bin/env python
"""Write a golden file from any model folder that `transformers` can run.

For a user holding the official Clover implementation: its outputs become a
golden file that `clover-export compare GOLDEN MODEL` checks our [assumed]
parts against (format: clover_export/runtime/golden.py).

    python tools/make_golden.py MODEL_DIR --prompt "What is 2 + 3?" --out golden.json \\
        [--chat] [--max-new-tokens 64] [--trust-remote-code] [--npy] [--gen-kwarg threshold=0.95 ...]

- prompt logits: `AutoModelForCausalLM(MODEL_DIR)(input_ids).logits` in fp32;
- expected response ids (unless --max-new-tokens 0): the model's own
  `generate(input_ids, max_new_tokens=..., do_sample=False, **gen_kwargs)`
  (for Clover's remote code, its block-diffusion generate), prompt removed.
Remote code runs only with --trust-remote-code.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def parse_kwargs(items: list[str]) -> dict:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"--gen-kwarg expects key=value, got {item!r}")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model_dir", type=Path)
    ap.add_argument("--out", type=Path, required=True, help="golden JSON to write")
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--prompt-ids", help="comma-separated prompt token ids")
    ap.add_argument("--chat", action="store_true", help="apply the chat template to --prompt")
    ap.add_argument("--no-think", action="store_true", help="enable_thinking=False in the chat template")
    ap.add_argument("--max-new-tokens", type=int, default=0, help="response length to generate (0: logits only)")
    ap.add_argument("--gen-kwarg", action="append", default=[], help="extra generate() argument key=value (JSON value)")
    ap.add_argument("--param", action="append", default=[],
                    help="generation parameter recorded for our side key=value (threshold, block_size, ...)")
    ap.add_argument("--trust-remote-code", action="store_true", help="allow the folder's own modelling code to run")
    ap.add_argument("--npy", action="store_true", help="store the logits as an .npy beside the JSON")
    ap.add_argument("--no-logits", action="store_true", help="do not store prompt logits")
    ap.add_argument("--atol", type=float, default=None, help="logit tolerance recorded in the file")
    args = ap.parse_args(argv)

    import torch
    import transformers

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from clover_export.runtime.golden import write_golden

    trust = args.trust_remote_code
    if args.prompt_ids:
        ids = [int(x) for x in args.prompt_ids.split(",") if x.strip()]
    else:
        tok = transformers.AutoTokenizer.from_pretrained(args.model_dir, trust_remote_code=trust)
        if args.chat:
            ids = tok.apply_chat_template([{"role": "user", "content": args.prompt}], add_generation_prompt=True,
                                          enable_thinking=not args.no_think, tokenize=True)
            ids = list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
        else:
            ids = tok(args.prompt, add_special_tokens=False)["input_ids"]
    model = transformers.AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32,
                                                              trust_remote_code=trust).eval()
    x = torch.tensor([ids])
    logits = None
    with torch.no_grad():
        if not args.no_logits:
            logits = model(input_ids=x).logits[0].float().numpy()
        expected = None
        if args.max_new_tokens > 0:
            gen_kwargs = parse_kwargs(args.gen_kwarg)
            out = model.generate(x, max_new_tokens=args.max_new_tokens, do_sample=False, **gen_kwargs)
            expected = [int(t) for t in out[0, len(ids):]]
    params = {"max_new_tokens": max(args.max_new_tokens, 1), "do_sample": False, **parse_kwargs(args.param)}
    source = (f"{args.model_dir.resolve()} via transformers {transformers.__version__} "
              f"{type(model).__name__} (trust_remote_code={trust})")
    write_golden(args.out, ids, params, expected, logits, npy=args.npy, source=source, logits_atol=args.atol)
    print(f"wrote {args.out}: {len(ids)} prompt ids, "
          f"{'no' if expected is None else len(expected)} expected ids, logits {'no' if logits is None else 'yes'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
