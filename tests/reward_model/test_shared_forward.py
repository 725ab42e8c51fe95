"""`rlhf train-rm` scores each distinct answer once per step: the k(n - k) pairs of a prompt's n
answers share n forwards, and the loss and its gradient built from those shared scores equal the
per-pair loss (each pair's two texts scored on their own), up to float tolerance."""

import random

import torch

from services.reward_model.preferences import Preference
from services.reward_model.train import (
    RewardModel,
    distinct_texts,
    epoch_order,
    micro_batches,
    pair_scores,
    pairwise_loss,
)


def _prompt_pairs() -> list[Preference]:
    """Two prompts, each with 2 right answers and 3 wrong ones: 2 x 3 = 6 pairs a prompt."""
    pairs = []
    for q, right, wrong in (
        ("12 + 5 = ", ["17", "It is 17."], ["16", "18", "7"]),
        ("3 + 4 = ", ["7", "7."], ["8", "6", "1"]),
    ):
        pairs += [Preference(q, q, c, r, hard=True) for c in right for r in wrong]
    return pairs


def test_each_distinct_answer_is_one_sequence():
    pairs = _prompt_pairs()
    texts, index = distinct_texts(pairs)
    assert len(pairs) == 12 and len(texts) == 10  # 2 x (2 + 3) answers, not 24 sequences
    for p, (c, r) in zip(pairs, index.tolist()):
        assert (texts[c], texts[r]) == p.texts


def test_micro_batches_hold_at_most_their_texts_and_keep_the_order():
    pairs = _prompt_pairs()
    chunks = micro_batches(pairs, 6)
    assert [p for c in chunks for p in c] == pairs
    assert all(len(distinct_texts(c)[0]) <= 6 for c in chunks)
    assert len(chunks) < len(pairs) // 3  # 6 texts hold more than 3 pairs where answers repeat


def test_an_epoch_by_prompt_keeps_each_prompts_pairs_together():
    pairs = _prompt_pairs()
    order = epoch_order(pairs, random.Random(0), by_prompt=True)
    assert sorted(order) == list(range(len(pairs)))
    prompts = [pairs[i].prompt for i in order]
    assert prompts == sorted(prompts, key=prompts.index)  # one run of each prompt
    assert sorted(epoch_order(pairs, random.Random(0), by_prompt=False)) == list(range(len(pairs)))


def test_the_shared_forward_loss_and_gradient_equal_the_per_pair_ones(untrained_model_dir):
    pairs = _prompt_pairs()
    rm = RewardModel(untrained_model_dir, seed=0)
    rm.model.eval()  # no dropout: both passes see the same function

    def loss_and_grad(per_pair: bool):
        rm.model.zero_grad(set_to_none=True)
        if per_pair:
            both = [rm.scores(list(p.texts)) for p in pairs]
            c, r = torch.stack([s[0] for s in both]), torch.stack([s[1] for s in both])
        else:
            c, r = pair_scores(rm, pairs)
        loss = pairwise_loss(c, r)
        loss.backward()
        grads = torch.cat([p.grad.flatten() for p in rm.model.parameters() if p.grad is not None])
        return loss.detach(), grads, c.detach()

    shared, per_pair = loss_and_grad(False), loss_and_grad(True)
    torch.testing.assert_close(shared[2], per_pair[2], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(shared[0], per_pair[0], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(shared[1], per_pair[1], rtol=1e-3, atol=1e-5)
    assert shared[1].abs().max() > 0  # a gradient that could have differed
