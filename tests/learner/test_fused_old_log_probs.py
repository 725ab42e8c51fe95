"""The old log-probs taken from the training forward (`fuse_old_log_probs`): the step it makes is
the step the recomputing learner makes, with one policy forward fewer; and every case in which
the two could differ keeps the recomputing forward."""

import pytest
import torch

from services.common.config import config_from_dict
from services.common.modeling import has_dropout
from services.generation.backend import HFBackend
from services.learner.trainer import PolicyTrainer
from tests.learner.test_trainer import _rollout


def _cfg(model_dir, **kw):
    return config_from_dict(
        {
            "model": {"path": model_dir, "device": "cpu"},
            "adv_estimator": "grpo",
            "num_return_sequences_in_group": 2,
            "actor_lr": 1e-2,
            "response_length": 8,
            "prompt_length": 16,
            "entropy_coef": 0.01,
            "kl_loss_coef": 0.1,
            "target_kl": 0.01,
            **kw,
        }
    )


def _forwards(learner) -> list:
    calls = []
    learner.policy.register_forward_hook(lambda *a: calls.append(1))
    return calls


@pytest.fixture(scope="module")
def rollout(tiny_model_dir):
    return _rollout(HFBackend(tiny_model_dir, "cpu"), seed=1)


@pytest.mark.parametrize("micro", [None, 3])
def test_fused_step_equals_the_recomputing_step(tiny_model_dir, rollout, micro):
    runs = {}
    for fuse in (True, False):
        torch.manual_seed(0)
        learner = PolicyTrainer(_cfg(tiny_model_dir, fuse_old_log_probs=fuse, micro_batch_size=micro))
        # a first step moves the policy away from the reference, so the KL terms are not zero
        learner.step(rollout)
        calls = _forwards(learner)
        exp = learner.make_experience(rollout)
        assert (exp.old_log_probs is None) == fuse
        metrics = {**exp.metrics, **learner.update(exp)}
        runs[fuse] = (metrics, learner.policy.state_dict(), len(calls), learner.kl_ctl.value)
    (fused, w_fused, n_fused, kl_fused), (plain, w_plain, n_plain, kl_plain) = runs[True], runs[False]
    # the training forwards are the same; the recomputing learner runs one more (no-grad) pass, in
    # micro-batches of log_prob_micro_batch_size (= micro_batch_size) rows
    rows = len(rollout.prompt_ids)
    assert n_plain == n_fused + -(-rows // (micro or rows))
    assert abs(plain["ppo/kl_ref"]) > 1e-6 and abs(plain["ppo/kl_loss"]) > 1e-6
    for key in (
        "ppo/pg_loss",
        "ppo/kl_loss",
        "ppo/entropy",
        "ppo/entropy_loss",
        "ppo/grad_norm",
        "ppo/kl_ref",
        "ppo/entropy_rollout",
        "ppo/approx_kl",
        "ppo/pg_clipfrac",
        "reward/score_mean",
    ):
        assert fused[key] == pytest.approx(plain[key], rel=1e-4, abs=1e-6), key
    assert kl_fused == pytest.approx(kl_plain, rel=1e-6)  # the adaptive controller saw the same KL
    for name, w in w_plain.items():
        assert torch.allclose(w_fused[name], w, rtol=1e-5, atol=1e-6), name


@pytest.mark.parametrize(
    "overrides",
    [
        {"fuse_old_log_probs": False},
        {"ppo_epochs": 2},
        {"ppo_mini_batch_size": 4},  # two optimiser steps: the second mini-batch's old log-probs predate the first
        {"add_token_level_kl": True},
        {"kl_penalty": "full"},
        {"ref_model": "mixture"},
        {"rollout_is": True},
        {"rollout_correction": "seq_mask"},
        {"rollout_correction_metrics": True},
        {"recompute_old_log_probs": False},
        {"model": {"lora": {"rank": 4, "dropout": 0.1}}},  # train-mode forwards differ from eval-mode ones
    ],
)
def test_the_recomputing_forward_stays_when_it_could_differ(tiny_model_dir, rollout, overrides):
    cfg = _cfg(tiny_model_dir, **overrides)
    if "model" in overrides:
        cfg = _cfg(tiny_model_dir, model={"path": tiny_model_dir, "device": "cpu", **overrides["model"]})
    learner = PolicyTrainer(cfg)
    exp = learner.make_experience(rollout)
    if overrides.get("recompute_old_log_probs") is False:
        assert torch.allclose(
            exp.old_log_probs[0, : len(rollout.gen_log_probs[0])], torch.tensor(rollout.gen_log_probs[0])
        )
    assert exp.old_log_probs is not None
    assert learner.forwards_saved == 0


def test_lora_without_dropout_fuses(tiny_model_dir, rollout):
    learner = PolicyTrainer(
        _cfg(tiny_model_dir, model={"path": tiny_model_dir, "device": "cpu", "lora": {"rank": 4, "dropout": 0.0}})
    )
    assert learner.make_experience(rollout).old_log_probs is None
    assert learner.forwards_saved == 1


def test_dropout_is_found_in_modules_and_in_the_config(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert not has_dropout(model)
    model.config.attention_dropout = 0.1  # a functional dropout: no module shows it
    assert has_dropout(model)
    assert has_dropout(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout(0.2)))
    assert not has_dropout(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout(0.0)))
