"""What plain `torch.onnx.export` does with the upstream model (bench/README.md, "upstream_onnx_export").

Builds a tiny random `transformers.Qwen3_5MoeForCausalLM` (4 layers, 6
experts) and tries `torch.onnx.export(dynamo=True)` three ways: with the
cache, without it (grouped expert matmul, the default), and with the eager
expert loop. Prints where each attempt stops. Needs transformers (test extra).

    python bench/upstream_onnx_export.py
"""

from __future__ import annotations

import argparse
import contextlib
import io
import logging
import time
import warnings


def main() -> None:
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args()
    import torch
    import transformers

    cfg = transformers.Qwen3_5MoeTextConfig(
        vocab_size=128, hidden_size=48, num_hidden_layers=4, layer_types=["linear_attention"] * 3 + ["full_attention"],
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4, num_experts=6,
        num_experts_per_tok=2, moe_intermediate_size=24, shared_expert_intermediate_size=16, tie_word_embeddings=False,
    )
    ids = torch.randint(0, 128, (1, 8))
    for name in list(logging.root.manager.loggerDict):  # torch.export logs the whole FX graph on failure
        if name.startswith("torch"):
            logging.getLogger(name).setLevel(logging.CRITICAL)
    print(f"transformers {transformers.__version__}, torch {torch.__version__}")
    for label, experts, kwargs in [
        ("use_cache=True", None, {"use_cache": True}),
        ("use_cache=False, grouped experts (default)", None, {"use_cache": False}),
        ("use_cache=False, eager expert loop", "eager", {"use_cache": False}),
    ]:
        model = transformers.Qwen3_5MoeForCausalLM(cfg).eval()
        if experts:
            model.set_experts_implementation(experts)
        t = time.perf_counter()
        sink = io.StringIO()  # torch prints the FX graph when export fails
        with warnings.catch_warnings(), contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
            warnings.simplefilter("ignore")
            try:
                torch.onnx.export(model, (ids,), kwargs=kwargs, dynamo=True, report=False, verbose=False)
                outcome = "exported"
            except Exception as e:  # report where it stops
                summary = [ln for ln in str(e).splitlines() if ln.startswith("<class")]
                outcome = "FAILED: " + (summary[0] if summary else str(e).splitlines()[0])[:300]
        print(f"- {label}: {outcome} ({time.perf_counter() - t:.1f} s)")


if __name__ == "__main__":
    main()
