"""A block whose coreset boundary rests on fp32 rounding (assumed.coreset_mask's rule), for every implementation.

One batch row, 4 block rows, 8 experts, top-2, router weights the identity
(logits = x exactly). Block row j puts logit 0 on expert 0, -17 on expert
j + 1 and -200 elsewhere, so its top-2 masses are ~1 (expert 0) and
e^-17 ~ 4.1e-8 (expert j + 1). A_0 ~ 4 - 2^-22 has an ulp of 2^-22 ~ 2.4e-7:
the fp32 running sum absorbs each tiny mass (one at a time), so at top_p < 1
only expert 0 is kept, and at top_p = 1 the rule keeps every expert with mass:
experts 0-4, each block row routing to expert 0 and its own tiny expert.
"""

from __future__ import annotations

import torch

E, D, I, K, N = 8, 8, 6, 2, 4
TOP_P_BELOW_1 = 1 - 2.0**-24  # the fp32 number just below 1
KEPT = {1.0: 5, TOP_P_BELOW_1: 1, 0.9: 1}  # top_p -> coreset_size


def tie_case(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.full((1, N, D), -200.0)
    x[0, :, 0] = 0.0
    for j in range(N):
        x[0, j, j + 1] = -17.0
    return dict(x=x, router_w=torch.eye(E, D), gate_up=torch.randn(E, 2 * I, D, generator=g) * 0.3,
                down=torch.randn(E, D, I, generator=g) * 0.3)
