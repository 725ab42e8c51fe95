"""Multi-turn trajectories with holes: the environment's tokens (a tool's result, a user's turn) are
in context but get no policy gradient, no KL and no entropy term, in every `loss_agg_mode`; the
reward lands on the policy's last token; the loss mask survives the replay buffer."""

import pytest

from services.common.replay.records import group_from_proto, group_to_proto, make_task
from services.common.token_batch import build_token_batch
from services.common.types import Completion, PromptRecord, Rollout, SampleGroup, ScoreResult
from services.generation.backend import HFBackend
from services.learner.trainer import PolicyTrainer
from services.ppo import LOSS_AGG_MODES
from tests.learner.test_trainer import _cfg

ENV = [5, 6, 7]  # the environment's turn in the middle of each response


def _rollout(backend) -> Rollout:
    """Two groups of two: each response is sampled tokens, the environment's turn, sampled tokens."""
    tok = backend.tokenizer
    prompts = [tok("abc=")["input_ids"], tok("hgfe=")["input_ids"]]
    p, r, lp, masks, idx = [], [], [], [], []
    for i, prompt in enumerate(prompts):
        for j in range(2):
            a = [10 + i + j, 11, 12]
            b = [13, 14 + j]
            p.append(prompt)
            r.append(a + ENV + b)
            lp.append([-1.0] * len(a) + [0.0] * len(ENV) + [-1.5] * len(b))
            masks.append([1] * len(a) + [0] * len(ENV) + [1] * len(b))
            idx.append(i)
    ro = Rollout(p, r, [1.0, 0.0, 0.5, 2.0], idx, lp, None, [0] * 4)
    ro.loss_masks = masks
    return ro


def test_the_token_batch_keeps_environment_tokens_in_context_but_out_of_the_loss():
    batch = build_token_batch([[1, 2]], [[3, 4, 5, 6]], 0, loss_masks=[[1, 0, 0, 1]])
    assert batch.response_mask.tolist() == [[1.0, 0.0, 0.0, 1.0]]
    assert batch.attention_mask.tolist() == [[1, 1, 1, 1, 1, 1]]
    with pytest.raises(ValueError, match="loss_masks"):
        build_token_batch([[1, 2]], [[3, 4, 5]], 0, loss_masks=[[1, 0]])


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_environment_tokens_get_no_gradient(tiny_model_dir, mode):
    """The gradient reaching the final hidden state at every position that predicts an
    environment token is exactly zero (that state feeds only that position's logits); at the
    positions that predict sampled tokens it is not. With the KL loss and the entropy bonus on."""
    backend = HFBackend(tiny_model_dir, "cpu")
    learner = PolicyTrainer(
        _cfg(
            tiny_model_dir,
            loss_agg_mode=mode,
            use_kl_loss=True,
            entropy_coef=0.01,
            fuse_old_log_probs=False,
            ppo_mini_batch_size=4,
            micro_batch_size=4,
            response_length=16,
        )
    )
    ro = _rollout(backend)
    grads = []

    def keep_grad(module, inputs, out):
        if out.requires_grad:  # the update's forward (not the no-grad ones)
            out.register_hook(grads.append)

    handle = learner.policy.model.norm.register_forward_hook(keep_grad)
    try:
        learner.step(ro)
    finally:
        handle.remove()
    assert grads, "no backward pass reached the final norm"
    g = grads[0].abs().sum(-1)  # (B, L) after the batch's own padding and trimming
    batch = build_token_batch(ro.prompt_ids, ro.response_ids, learner.pad_id, loss_masks=ro.loss_masks)
    P = batch.prompt_width
    assert g.shape[1] == batch.input_ids.shape[1]
    for row, mask in enumerate(ro.loss_masks):
        for t, m in enumerate(mask):
            pos = P + t - 1  # the hidden state that predicts response token t
            if m:
                assert g[row, pos] > 0, (row, t)
            else:
                assert g[row, pos] == 0, (row, t, g[row, pos])


def test_the_reward_lands_on_the_last_sampled_token_and_gae_skips_the_environment(tiny_model_dir):
    learner = PolicyTrainer(_cfg(tiny_model_dir, fuse_old_log_probs=False, response_length=16))
    ro = _rollout(HFBackend(tiny_model_dir, "cpu"))
    ro.loss_masks = [m[:-2] + [0, 0] for m in ro.loss_masks]  # the environment has the last word too
    exp = learner.make_experience(ro)
    mask = exp.batch.response_mask
    assert (exp.advantages * (1 - mask)).abs().sum() == 0
    for row, m in enumerate(ro.loss_masks):
        assert mask[row, : len(m)].tolist() == [float(x) for x in m]


def test_the_loss_mask_survives_the_replay_buffer():
    record = PromptRecord("p1", "abc=", "cba")
    group = SampleGroup(
        "0:p1",
        record,
        [1, 2, 3],
        [Completion([4, 5, 6, 7], [-0.5, 0.0, 0.0, -0.25], "stop", [1, 0, 0, 1]), Completion([8], [-1.0], "length")],
        [ScoreResult(1.0), ScoreResult(0.0)],
        None,
        3,
    )
    back = group_from_proto(group_to_proto(group, make_task(record, 0, 3, 0, 2)))
    assert [c.loss_mask for c in back.completions] == [[1, 0, 0, 1], None]
    rollout = Rollout.from_groups([back])
    assert rollout.loss_masks == [[1, 0, 0, 1], [1]]  # a single-turn sample of the batch: all trained
    msg = group_to_proto(group, make_task(record, 0, 3, 0, 2))
    msg.samples[0].loss_mask = bytes([1, 0, 1])  # one entry short
    with pytest.raises(ValueError, match="loss mask"):
        group_from_proto(msg)
