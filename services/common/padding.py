"""Ragged per-token rows into rectangles: the one place anything is padded.

Prompts are left-padded (they end where generation starts) and responses right-padded (they
start at the same column), so `[prompt | response]` rows line up on the response columns.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch


def pad_right(
    rows: Sequence[Sequence[float]], width: int | None = None, value: float = 0, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """(len(rows), width): each row's entries from column 0, then `value`. Width defaults to the
    longest row; a row longer than `width` is cut."""
    width = max((len(r) for r in rows), default=0) if width is None else width
    np_dtype = torch.empty((), dtype=dtype).numpy().dtype
    out = np.full((len(rows), width), value, dtype=np_dtype)
    for i, r in enumerate(rows):
        n = min(len(r), width)
        out[i, :n] = r[:n]
    return torch.from_numpy(out)


def pad_left(rows: Sequence[Sequence[int]], value: int, width: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids (len(rows), width) with each row ending at the last column, and the attention
    mask (1 on real tokens). Width defaults to the longest row."""
    width = max((len(r) for r in rows), default=0) if width is None else width
    ids = np.full((len(rows), width), value, dtype=np.int64)
    mask = np.zeros((len(rows), width), dtype=np.int64)
    for i, r in enumerate(rows):
        if len(r) > width:
            raise ValueError(f"row {i} has {len(r)} tokens, more than the width {width}")
        if len(r):
            ids[i, width - len(r) :] = r
            mask[i, width - len(r) :] = 1
    return torch.from_numpy(ids), torch.from_numpy(mask)
