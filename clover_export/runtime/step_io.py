"""The step's one upload and one read-back, by name (docs/runtime.md "The step contract").

`upload` packs named int lists into one int32 tensor, moves it to the device once and hands back the named
views; `read_back` concatenates named per-row int columns, reads them to the host once (the step's only
device-to-host sync) and cuts each row back into its named parts. Adding a per-row input or output is one
named entry, never an offset.
"""

from __future__ import annotations

import torch

Fields = dict[str, tuple[list[int], tuple[int, ...]]]  # name -> (values, shape on the device)


def upload(fields: Fields, device: torch.device) -> dict[str, torch.Tensor]:
    """One host-to-device copy of every field; each comes back as an int32 view of its shape."""
    flat = torch.tensor([v for values, _ in fields.values() for v in values], dtype=torch.int32)
    flat = flat.to(device, non_blocking=True)
    parts = flat.split([len(values) for values, _ in fields.values()])
    return {name: part.view(shape) for (name, (_, shape)), part in zip(fields.items(), parts)}


def read_back(columns: dict[str, torch.Tensor]) -> list[dict[str, list[int]]]:
    """One device-to-host read of named per-row columns ([B, width] each): per row, name -> its ints."""
    widths = [t.shape[1] for t in columns.values()]
    table = torch.cat([t.to(torch.int32) for t in columns.values()], 1).tolist()
    rows = []
    for values in table:
        row, at = {}, 0
        for name, w in zip(columns, widths):
            row[name] = values[at:at + w]
            at += w
        rows.append(row)
    return rows
