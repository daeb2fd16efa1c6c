"""Training the embedded default: a tiny Clover taught block diffusion and next-token decoding on synthetic tasks.

`tasks` makes the checkable prompts, `data` renders them through the chat
template into block-diffusion batches (MODEL.md 5.1) and teacher-forced
next-token batches, `trainer` runs the masked-block objective plus the
next-token one on causal rows through the reference model with autograd, and
`evaluate` scores a model on held-out prompts with the runtime's greedy
LowConfidence loop (DECODING.md 2), on the in-memory model, and in the
autoregressive mode with a plain greedy loop. Run `python -m clover_export.train --help`.
"""
