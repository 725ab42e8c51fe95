"""A batch of token sequences as every forward pass takes it, `[left-padded prompt | right-padded
response]`: `B` sequences, `P` prompt columns and `T` response columns; `response_mask` (B, T) is 1
on generated tokens (and, with loss masks, only on those the loss counts)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from .padding import pad_left, pad_right


@dataclass
class TokenBatch:
    """Prompt + response tokens of `B` sequences, padded into one rectangle.

    input_ids, attention_mask, position_ids: (B, P + T); response_mask: (B, T).
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    position_ids: torch.Tensor
    response_mask: torch.Tensor
    prompt_width: int

    @property
    def responses(self) -> torch.Tensor:
        return self.input_ids[:, self.prompt_width :]

    def to(self, device) -> "TokenBatch":
        return TokenBatch(
            self.input_ids.to(device),
            self.attention_mask.to(device),
            self.position_ids.to(device),
            self.response_mask.to(device),
            self.prompt_width,
        )

    def select(self, idx: torch.Tensor | Sequence[int]) -> "TokenBatch":
        idx = torch.as_tensor(idx, dtype=torch.long, device=self.input_ids.device)
        return TokenBatch(
            self.input_ids[idx],
            self.attention_mask[idx],
            self.position_ids[idx],
            self.response_mask[idx],
            self.prompt_width,
        )

    def trimmed(self) -> "TokenBatch":
        """The same sequences without the columns that are padding in every row: leading prompt
        columns and trailing response columns (at least one of each stays). Positions are kept,
        so every forward gives the same numbers; outputs are (B, T') with T' <= T, the first T'
        response columns of the untrimmed batch."""
        P = self.prompt_width
        used = self.attention_mask[:, :P].any(0).nonzero()
        first = min(int(used[0]) if len(used) else P - 1, P - 1)
        answered = self.response_mask.any(0).nonzero()
        T = int(answered[-1]) + 1 if len(answered) else 1
        end = P + T
        return TokenBatch(
            self.input_ids[:, first:end],
            self.attention_mask[:, first:end],
            self.position_ids[:, first:end],
            self.response_mask[:, :T],
            P - first,
        )


def widen(t: torch.Tensor, width: int) -> torch.Tensor:
    """A (B, T', ...) result of a `TokenBatch.trimmed` batch zero-padded back to (B, width, ...)."""
    if t.shape[1] == width:
        return t
    pad = [0, 0] * (t.dim() - 2) + [0, width - t.shape[1]]
    return torch.nn.functional.pad(t, pad)


def build_token_batch(
    prompts: Sequence[Sequence[int]],
    responses: Sequence[Sequence[int]],
    pad_id: int,
    response_width: int | None = None,
    loss_masks: Sequence[Sequence[int]] | None = None,
) -> TokenBatch:
    """Left-pad prompts and right-pad responses into one rectangle (see `TokenBatch`). With
    `loss_masks` (multi-turn trajectories: 0 where the environment put a token in context),
    `response_mask` is 0 on those tokens too: they stay in context (attention), but no loss, KL,
    entropy, value or advantage is taken on them."""
    if len(prompts) != len(responses):
        raise ValueError(f"{len(prompts)} prompts but {len(responses)} responses")
    T = max(max((len(r) for r in responses), default=0), 1)
    if response_width is not None:
        T = max(T, response_width)
    prompt_ids, prompt_attn = pad_left(prompts, pad_id)
    response_ids = pad_right(responses, T, pad_id, torch.long)
    response_attn = pad_right([[1] * len(r) for r in responses], T, 0, torch.long)
    ids = torch.cat([prompt_ids, response_ids], dim=1)
    attn = torch.cat([prompt_attn, response_attn], dim=1)
    P = prompt_ids.shape[1]
    response_mask = response_attn.float()
    if loss_masks is not None:
        if [len(m) for m in loss_masks] != [len(r) for r in responses]:
            raise ValueError("loss_masks: one entry per response token of each response")
        response_mask = response_mask * pad_right(loss_masks, T, 0, torch.float32)
    position_ids = (attn.cumsum(-1) - 1).clamp(min=0)
    return TokenBatch(ids, attn, position_ids, response_mask, P)
