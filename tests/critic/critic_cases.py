"""The batches the sharded-critic tests train on, in one process and in two."""

import torch

from services.common.token_batch import build_token_batch


def critic_kwargs() -> dict:
    return {"lr": 1e-2, "value_clip": 0.2, "loss_agg_mode": "seq-mean-token-sum", "device": "cpu"}


def steps(n: int = 7, vocab: int = 32) -> list:
    """Three (batch, returns, old values) triples of `n` rows (odd: the processes split it 4/3)."""
    out = []
    for seed in (1, 2, 3):
        g = torch.Generator().manual_seed(seed)
        prompts = [
            torch.randint(3, vocab, (int(torch.randint(2, 7, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)
        ]
        responses = [
            torch.randint(3, vocab, (int(torch.randint(1, 9, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)
        ]
        batch = build_token_batch(prompts, responses, 0)
        mask = batch.response_mask.float()
        out.append(
            (batch, torch.randn(mask.shape, generator=g) * mask, 0.1 * torch.randn(mask.shape, generator=g) * mask)
        )
    return out
