"""Deterministic top-k and argsort: ties go to the lower index (MODEL.md 4, 5.3).

torch.topk does not promise an order among equal values; a stable sort does.
"""

import torch


def stable_argsort_desc(x: torch.Tensor) -> torch.Tensor:
    """Descending argsort along the last dim, ties broken by lower index."""
    return torch.sort(x, dim=-1, descending=True, stable=True).indices


def stable_topk(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k along the last dim, ties broken by lower index: (values, indices)."""
    idx = stable_argsort_desc(x)[..., :k]
    return torch.gather(x, -1, idx), idx
