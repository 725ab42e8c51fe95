"""The config and batches the FSDP2 tests run on one process and on two."""

import torch

from services.common.config import config_from_dict
from services.common.types import Rollout


def learner_config(model_dir: str, overrides=()):
    raw = {
        "model": {"path": model_dir, "device": "cpu"},
        "adv_estimator": "grpo",
        "num_return_sequences_in_group": 2,
        "actor_lr": 1e-2,
        "response_length": 8,
        "prompt_length": 16,
        "entropy_coef": 0.01,
        "kl_loss_coef": 0.1,
        "ppo_mini_batch_size": 8,
    }
    return config_from_dict(raw, list(overrides))


def batches(pad_id: int, vocab: int = 32) -> tuple[Rollout, Rollout]:
    """Two rollouts of 10 sequences (5 groups of 2) with prompts and responses of mixed lengths."""
    out = []
    for seed in (1, 2):
        g = torch.Generator().manual_seed(seed)
        prompts, responses, scores, index = [], [], [], []
        for i in range(10):
            p = torch.randint(3, vocab, (int(torch.randint(2, 7, (1,), generator=g)),), generator=g).tolist()
            r = torch.randint(3, vocab, (int(torch.randint(1, 9, (1,), generator=g)),), generator=g).tolist()
            prompts.append(p)
            responses.append(r)
            scores.append(float(torch.rand(1, generator=g)))
            index.append(i // 2)
        out.append(Rollout(prompts, responses, scores, index, None, None, [0] * 10))
    return out[0], out[1]
