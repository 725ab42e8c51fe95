"""Memory that does not grow with the batch, numbers that do not change: the chunked output
layer gives the full-logits log-probs, entropy and gradients; trimmed padding changes nothing;
micro-batched no-grad passes, policy updates and critic steps equal one pass (float tolerance:
a micro-batch of other rows is a matmul of another shape, summed in another order) in every
`loss_agg_mode`."""

import pytest
import torch

from services.common import modeling
from services.common.modeling import response_log_probs, response_logits
from services.common.token_batch import build_token_batch
from services.critic.critic import Critic
from services.generation.backend import HFBackend
from services.learner.trainer import PolicyTrainer
from services.ppo import LOSS_AGG_MODES, AggNorm, agg_loss, entropy_from_logits, logprobs_from_logits
from tests.learner.test_trainer import _cfg, _rollout

# float32 through a 2-layer model in other batch shapes and reduction orders: differences of a
# few 1e-7 per op; 1e-5 absolute on log-probs, values and weights after a step is ample and far
# below any real change (one optimiser step moves weights by ~lr = 1e-3)
TOL = dict(rtol=1e-4, atol=1e-5)


@pytest.fixture(scope="module")
def rollout(tiny_model_dir):
    return _rollout(HFBackend(tiny_model_dir, "cpu"), seed=3)


def _batch(model, rollout):
    return build_token_batch(rollout.prompt_ids, rollout.response_ids, model.config.pad_token_id or 0)


@pytest.mark.parametrize("grad", [False, True])
def test_chunked_head_equals_full_logits(tiny_model_dir, rollout, monkeypatch, grad):
    learner = PolicyTrainer(_cfg(tiny_model_dir))
    model, batch = learner.policy, _batch(learner.policy, rollout)
    weights = torch.randn(batch.response_mask.shape)

    def run(fn):
        model.zero_grad(set_to_none=True)
        with torch.set_grad_enabled(grad):
            lp, ent = fn()
            if grad:
                ((lp * weights).sum() + ent.sum()).backward()
        return lp.detach(), ent.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if grad}

    def full():
        logits = response_logits(model, batch, temperature=0.7)
        return logprobs_from_logits(logits, batch.responses), entropy_from_logits(logits)

    def chunked():
        out = response_log_probs(model, batch, temperature=0.7, with_entropy=True)
        return out["log_probs"], out["entropy"]

    monkeypatch.setattr(modeling, "LOGIT_CHUNK_ELEMENTS", 5 * model.config.vocab_size)  # 5 positions a chunk
    (lp1, e1, g1), (lp2, e2, g2) = run(full), run(chunked)
    assert torch.allclose(lp1, lp2, **TOL) and torch.allclose(e1, e2, **TOL)
    for name in g1:
        assert torch.allclose(g1[name], g2[name], **TOL), name


def test_trimmed_batch_gives_the_same_log_probs(tiny_model_dir, rollout):
    learner = PolicyTrainer(_cfg(tiny_model_dir))
    batch = _batch(learner.policy, rollout)
    sub = batch.select([1, 3])  # rows of a short prompt and short responses: padding to trim
    trimmed = sub.trimmed()
    assert trimmed.input_ids.shape[1] < sub.input_ids.shape[1]
    with torch.no_grad():
        a = response_log_probs(learner.policy, sub)["log_probs"]
        b = response_log_probs(learner.policy, trimmed)["log_probs"]
    t = b.shape[1]
    assert torch.allclose(a[:, :t] * sub.response_mask[:, :t], b * trimmed.response_mask, **TOL)
    assert not sub.response_mask[:, t:].any()


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_agg_norm_scales_micro_batches_to_the_whole(mode):
    g = torch.Generator().manual_seed(0)
    loss = torch.randn(7, 6, generator=g)
    mask = (torch.rand(7, 6, generator=g) > 0.4).float()
    mask[2] = 0  # a sequence with no token
    mask[3:5, 4:] = 0  # the second micro-batch is trimmed to 4 columns
    norm = AggNorm(mask)
    parts = [(slice(0, 3), 6), (slice(3, 5), 4), (slice(5, 7), 6)]
    total = sum(agg_loss(loss[s, :w], mask[s, :w], mode) * norm.scale(mask[s, :w], mode) for s, w in parts)
    assert float(total) == pytest.approx(float(agg_loss(loss, mask, mode)), rel=1e-6, abs=1e-7)


def _gradients_at_each_step(optimizer, model) -> list:
    """Record the gradients the optimiser steps on (weights after an Adam step are no measure:
    Adam turns a near-zero gradient's float noise into a step of +-lr)."""
    seen, step = [], optimizer.step

    def recording_step(*args, **kwargs):
        seen.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
        return step(*args, **kwargs)

    optimizer.step = recording_step
    return seen


def _close(a: dict, b: dict):
    assert a.keys() == b.keys()
    for name in a:
        assert torch.allclose(a[name], b[name], **TOL), name


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_micro_batched_learner_step_equals_one_pass(tiny_model_dir, rollout, mode):
    def cfg(micro):
        return _cfg(
            tiny_model_dir,
            loss_agg_mode=mode,
            micro_batch_size=micro,
            log_prob_micro_batch_size=micro,
            fuse_old_log_probs=False,
            entropy_coef=0.01,
            use_kl_loss=True,
            kl_loss_coef=0.1,
        )

    torch.manual_seed(0)
    first = PolicyTrainer(cfg(None))
    first.step(rollout)  # away from the reference: the KL terms are not zero
    results = []
    for micro in (None, 3):  # 8 rows: micro-batches of 3, 3 and 2
        learner = PolicyTrainer(cfg(micro))
        learner.policy.load_state_dict(first.policy.state_dict())
        grads = _gradients_at_each_step(learner.optimizer, learner.policy)
        exp = learner.make_experience(rollout)
        results.append((exp, learner.update(exp), grads))
    (e1, m1, g1), (e2, m2, g2) = results
    mask = e1.batch.response_mask.bool()  # a trimmed micro-batch leaves its padding columns 0
    assert torch.allclose(e1.old_log_probs[mask], e2.old_log_probs[mask], **TOL)
    assert torch.allclose(e1.ref_log_probs[mask], e2.ref_log_probs[mask], **TOL)
    for key in ("ppo/pg_loss", "ppo/kl_loss", "ppo/entropy", "ppo/entropy_loss", "ppo/grad_norm", "ppo/approx_kl"):
        assert m1[key] == pytest.approx(m2[key], rel=1e-4, abs=1e-5), key
    assert len(g1) == len(g2) == 1
    _close(g1[0], g2[0])


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_micro_batched_critic_step_equals_one_pass(tiny_model_dir, rollout, mode):
    batch = build_token_batch(rollout.prompt_ids, rollout.response_ids, 0)
    g = torch.Generator().manual_seed(1)
    returns = torch.randn(batch.response_mask.shape, generator=g) * batch.response_mask
    old = torch.randn(batch.response_mask.shape, generator=g) * 0.1 * batch.response_mask
    out = []
    for micro in (None, 3):
        critic = Critic(
            tiny_model_dir, lr=1e-2, value_clip=0.05, loss_agg_mode=mode, device="cpu", micro_batch_size=micro
        )
        torch.nn.init.normal_(critic.model.value_head.weight, std=0.1, generator=torch.Generator().manual_seed(2))
        grads = _gradients_at_each_step(critic.optimizer, critic.model)
        values = critic.values(batch)
        out.append((values, critic.train_step(batch, returns, old), grads))
    (v1, m1, g1), (v2, m2, g2) = out
    assert torch.allclose(v1, v2, **TOL)
    for key in m1:
        assert m1[key] == pytest.approx(m2[key], rel=1e-4, abs=1e-5), key
    _close(g1[0], g2[0])


def test_critic_bf16_and_checkpointing_train(tiny_model_dir, rollout):
    """model.bf16 runs the critic under bf16 autocast (the value head in float32), with gradient
    checkpointing: a step is taken and its loss is within 5% of the float32 one's."""
    batch = build_token_batch(rollout.prompt_ids, rollout.response_ids, 0)
    returns = torch.ones(batch.response_mask.shape) * batch.response_mask
    losses = []
    for bf16 in (False, True):
        critic = Critic(
            tiny_model_dir, lr=1e-2, device="cpu", micro_batch_size=4, bf16=bf16, gradient_checkpointing=bf16
        )
        assert critic.model.backbone.is_gradient_checkpointing == bf16
        losses.append(critic.train_step(batch, returns, torch.zeros_like(returns))["critic/vf_loss"])
        assert critic.steps == 1
        # the value head's output, the weights and Adam's moments stay float32 under bf16 autocast
        assert critic.values(batch).dtype == torch.float32
        assert {p.dtype for p in critic.model.parameters()} == {torch.float32}
        state = [t for s in critic.optimizer.state.values() for t in s.values() if torch.is_tensor(t) and t.numel() > 1]
        assert state and {t.dtype for t in state} == {torch.float32}
    assert losses[1] == pytest.approx(losses[0], rel=0.05)


def test_bf16_learner_step_agrees_with_float32_and_keeps_float32_where_it_must(tiny_model_dir, rollout, monkeypatch):
    """model.bf16: the backbone runs under bf16 autocast, but the output layer's logits, the
    log-probs, the loss and the optimiser's state stay float32 (each would fail this test in
    bf16), and one step agrees with the float32 step: log-probs within 0.05 (bf16 keeps 8 bits of
    mantissa: ~0.4% per op through 2 layers), the losses within 5%, the gradient's direction
    within cosine 0.99."""
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(tiny_model_dir).vocab_size
    head_logits: list[torch.dtype] = []
    linear = torch.nn.functional.linear

    def spy(x, w, b=None):
        out = linear(x, w, b)
        if w.shape[0] == vocab:  # the output layer (vocabulary rows)
            head_logits.append(out.dtype)
        return out

    monkeypatch.setattr(torch.nn.functional, "linear", spy)

    def cfg(bf16):
        return _cfg(
            tiny_model_dir,
            micro_batch_size=4,
            fuse_old_log_probs=False,
            entropy_coef=0.01,
            use_kl_loss=True,
            kl_loss_coef=0.1,
            model={"path": tiny_model_dir, "device": "cpu", "bf16": bf16},
        )

    runs = []
    for bf16 in (False, True):
        torch.manual_seed(0)
        learner = PolicyTrainer(cfg(bf16))
        grads = _gradients_at_each_step(learner.optimizer, learner.policy)
        head_logits.clear()
        exp = learner.make_experience(rollout)
        metrics = learner.update(exp)
        assert head_logits and set(head_logits) == {torch.float32}, (bf16, set(head_logits))
        assert exp.old_log_probs.dtype == torch.float32
        assert {p.dtype for p in learner.policy.parameters()} == {torch.float32}
        state = [
            t for s in learner.optimizer.state.values() for t in s.values() if torch.is_tensor(t) and t.numel() > 1
        ]
        assert state and {t.dtype for t in state} == {torch.float32}
        runs.append((exp, metrics, grads[0]))
    (e32, m32, g32), (e16, m16, g16) = runs
    mask = e32.batch.response_mask.bool()
    assert (e32.old_log_probs[mask] - e16.old_log_probs[mask]).abs().max() < 0.05
    assert (e32.old_log_probs[mask] != e16.old_log_probs[mask]).any()  # bf16 did run
    for key in ("ppo/pg_loss", "ppo/kl_loss", "ppo/entropy"):
        assert m16[key] == pytest.approx(m32[key], rel=0.05, abs=1e-3), key
    flat32 = torch.cat([g.flatten() for g in g32.values()])
    flat16 = torch.cat([g16[n].flatten() for n in g32])
    assert torch.nn.functional.cosine_similarity(flat32, flat16, dim=0) > 0.99
