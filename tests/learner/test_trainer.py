"""The learner step's contracts: weights it pushes are the weights it trains, LoRA stays LoRA,
rollout_is (rollout_correction) weights the loss by the sampler/learner importance ratio."""

import math

import pytest
import torch

from services.common.config import config_from_dict
from services.common.types import Rollout, SamplingParams
from services.generation.backend import HFBackend
from services.learner.trainer import PolicyTrainer


def _rollout(backend, n=8, seed=0):
    prompts = [backend.tokenizer(s)["input_ids"] for s in ["abc=", "hgfe=", "dada=", "bbcah="]]
    gen = backend.generate(prompts, SamplingParams(n=2, max_new_tokens=8, seed=seed))
    p, r, lp, idx = [], [], [], []
    for i, (prompt, comps) in enumerate(zip(prompts, gen.completions)):
        for c in comps:
            p.append(prompt)
            r.append(c.token_ids)
            lp.append(c.log_probs)
            idx.append(i)
    scores = [float(len(x) % 3) for x in r]
    return Rollout(p, r, scores, idx, lp, None, [gen.policy_version] * len(r))


def _cfg(model_dir, **kw):
    return config_from_dict(
        {
            "model": {"path": model_dir, "device": "cpu"},
            "adv_estimator": "grpo",
            "num_return_sequences_in_group": 2,
            "actor_lr": 1e-3,
            "response_length": 8,
            "prompt_length": 16,
            **kw,
        }
    )


def test_sampler_log_probs_match_recomputed_old_log_probs(tiny_model_dir):
    backend = HFBackend(tiny_model_dir, "cpu")
    learner = PolicyTrainer(_cfg(tiny_model_dir, fuse_old_log_probs=False))
    ro = _rollout(backend)
    exp = learner.make_experience(ro)
    for i, lp in enumerate(ro.gen_log_probs):
        assert torch.allclose(exp.old_log_probs[i, : len(lp)], torch.tensor(lp), atol=1e-4)


def test_pushed_weights_make_the_backend_generate_what_the_learner_would(tiny_model_dir):
    backend = HFBackend(tiny_model_dir, "cpu")
    learner = PolicyTrainer(_cfg(tiny_model_dir))
    ro = _rollout(backend)
    learner.step(ro)
    assert learner.policy_version == 0  # the step does not number versions: the loop's weight sink does
    prompts = [backend.tokenizer("abcd=")["input_ids"]]
    backend.update_weights(learner.policy_state_dict(), 1)
    after = backend.generate(prompts, SamplingParams(temperature=0, max_new_tokens=8))
    assert after.policy_version == 1
    out = learner.policy.generate(
        torch.tensor(prompts),
        max_new_tokens=8,
        do_sample=False,
        eos_token_id=backend.eos_token_id,
        pad_token_id=backend.pad_token_id,
    )
    expected = out[0, len(prompts[0]) :].tolist()
    assert after.completions[0][0].token_ids == expected[: len(after.completions[0][0].token_ids)]
    with pytest.raises(ValueError, match="not newer"):
        backend.update_weights(learner.policy_state_dict(), 1)


def test_lora_trains_only_adapters_and_pushes_merged_weights(tiny_model_dir):
    learner = PolicyTrainer(
        _cfg(tiny_model_dir, model={"path": tiny_model_dir, "device": "cpu", "lora": {"rank": 4}}, use_kl_loss=True)
    )
    backend = HFBackend(tiny_model_dir, "cpu")
    base = {k: v.clone() for k, v in backend.model.state_dict().items()}
    learner.step(_rollout(backend))
    sd = learner.policy_state_dict()
    assert set(sd) == set(base)
    changed = [k for k in sd if not torch.equal(sd[k], base[k])]
    assert changed and all(any(m in k for m in ("q_proj", "k_proj", "v_proj", "o_proj")) for k in changed)
    # the base weights inside the peft model are untouched (adapters are unmerged again)
    for k, v in learner.policy.get_base_model().state_dict().items():
        if "lora_" not in k and "q_proj" in k and "weight" in k:
            assert torch.equal(v, base[k.replace(".base_layer", "")])


def test_update_with_an_unknown_tensor_changes_nothing(tiny_model_dir):
    backend = HFBackend(tiny_model_dir, "cpu")
    sd = {k: v.clone() + 1 for k, v in backend.model.state_dict().items()}
    sd["nope.weight"] = torch.zeros(1)
    before = {k: v.clone() for k, v in backend.model.state_dict().items()}
    with pytest.raises(ValueError, match="unknown tensor 'nope.weight'"):  # BadRequest: INVALID_ARGUMENT
        backend.update_weights(sd, 1)
    bad_shape = {"model.norm.weight": torch.zeros(3)}
    with pytest.raises(ValueError, match="shape"):
        backend.update_weights(bad_shape, 1)
    assert backend.policy_version == 0
    for k, v in backend.model.state_dict().items():
        assert torch.equal(v, before[k])


def test_lora_merged_push_reproduces_the_adapted_policy(tiny_model_dir):
    learner = PolicyTrainer(_cfg(tiny_model_dir, model={"path": tiny_model_dir, "device": "cpu", "lora": {"rank": 4}}))
    backend = HFBackend(tiny_model_dir, "cpu")
    learner.step(_rollout(backend))
    backend.update_weights(learner.policy_state_dict(), 1)
    ids = torch.tensor([backend.tokenizer("abcdh=dc")["input_ids"]])
    # merged weights (W + s*B@A, rounded to float32) against the unmerged adapter (W@x + s*B@(A@x)):
    # another order of float32 operations; 3e-6 measured on logits of magnitude ~8, while the
    # adapter moves them by ~0.2, so 1e-4 still tells the adapted policy from the base one
    with torch.no_grad():
        assert torch.allclose(backend.model(ids).logits, learner.policy(ids).logits, atol=1e-4)


def _shifted(ro, old_log_probs, shifts):
    """`ro` with the sampler's log-probs set to the learner's minus shifts[i] on sequence i, so the
    importance ratio pi_old / mu of every token of sequence i is exp(shifts[i])."""
    gen = [(old_log_probs[i, : len(r)] - shifts[i]).tolist() for i, r in enumerate(ro.response_ids)]
    return Rollout(ro.prompt_ids, ro.response_ids, ro.scores, ro.index, gen, None, ro.policy_versions)


def test_rollout_is_reports_the_ratio_between_sampler_and_learner(tiny_model_dir):
    backend = HFBackend(tiny_model_dir, "cpu")
    ro = _rollout(backend)
    old = PolicyTrainer(_cfg(tiny_model_dir, fuse_old_log_probs=False)).make_experience(ro).old_log_probs
    assert "ppo/is_ratio_mean" not in PolicyTrainer(_cfg(tiny_model_dir)).make_experience(ro).metrics
    learner = PolicyTrainer(_cfg(tiny_model_dir, rollout_is=True, rollout_is_threshold=2.0))
    # even sequences: ratio exp(0.5) = 1.65, under the cap; odd ones: exp(1) = 2.72, truncated to 2
    shifts = [0.5 if i % 2 == 0 else 1.0 for i in range(len(ro.response_ids))]
    exp = learner.make_experience(_shifted(ro, old, shifts))
    lengths = torch.tensor([len(r) for r in ro.response_ids], dtype=torch.float)
    ratio = torch.exp(torch.tensor(shifts))
    odd = torch.tensor([i % 2 == 1 for i in range(len(shifts))])
    assert lengths[odd].sum() > 0 and lengths[~odd].sum() > 0
    m = exp.metrics
    assert m["ppo/is_ratio_mean"] == pytest.approx(((ratio * lengths).sum() / lengths.sum()).item(), rel=1e-4)
    assert m["ppo/is_ratio_max"] == pytest.approx(math.exp(1.0), rel=1e-4)
    assert m["ppo/is_clipped_frac"] == pytest.approx((lengths[odd].sum() / lengths.sum()).item())
    weights = ratio.clamp(max=2.0)
    assert m["ppo/is_weight_mean"] == pytest.approx(((weights * lengths).sum() / lengths.sum()).item(), rel=1e-4)
    mask = exp.batch.response_mask
    expected = weights.unsqueeze(-1) * mask
    assert torch.allclose(exp.rollout_is_weights, expected, rtol=1e-4, atol=0)
    # the learner's old log-probs are still its own (recompute_old_log_probs), not the sampler's
    assert torch.equal(exp.old_log_probs, old)


def test_rollout_is_weights_scale_the_policy_loss(tiny_model_dir):
    backend = HFBackend(tiny_model_dir, "cpu")
    ro = _rollout(backend)
    old = PolicyTrainer(_cfg(tiny_model_dir, fuse_old_log_probs=False)).make_experience(ro).old_log_probs
    shifted = _shifted(ro, old, [0.25] * len(ro.response_ids))  # every weight exp(0.25), under the cap
    plain = PolicyTrainer(_cfg(tiny_model_dir)).step(shifted)
    weighted = PolicyTrainer(_cfg(tiny_model_dir, rollout_is=True)).step(shifted)
    assert abs(plain["ppo/pg_loss"]) > 1e-4
    assert weighted["ppo/pg_loss"] == pytest.approx(math.exp(0.25) * plain["ppo/pg_loss"], rel=1e-3)
    assert weighted["ppo/is_clipped_frac"] == 0.0
    # with the sampler's log-probs as the old ones, the weights are all 1
    same = PolicyTrainer(_cfg(tiny_model_dir, rollout_is=True, recompute_old_log_probs=False)).make_experience(shifted)
    assert torch.equal(same.rollout_is_weights, same.batch.response_mask.float())
    assert same.metrics["ppo/is_ratio_mean"] == 1.0


def test_rollout_is_without_sampler_log_probs_raises(tiny_model_dir):
    ro = _rollout(HFBackend(tiny_model_dir, "cpu"))
    no_lp = Rollout(ro.prompt_ids, ro.response_ids, ro.scores, ro.index, None, None, ro.policy_versions)
    learner = PolicyTrainer(_cfg(tiny_model_dir, rollout_is=True))
    with pytest.raises(ValueError, match="rollout_correction token_tis .* needs the sampler's log-probs"):
        learner.make_experience(no_lp)
    PolicyTrainer(_cfg(tiny_model_dir)).make_experience(no_lp)  # without rollout_is it is fine


def test_seq_mask_drops_the_sequences_the_sampler_drifted_on(tiny_model_dir):
    """rollout_correction: seq_mask on sequences whose every token's ratio is exp(shift): shift 0
    is kept (weight 1 on each token), shift 0.5 dropped (weight 0); the drift metrics are those of
    the shifts (k1 KL = -mean shift over the tokens)."""
    backend = HFBackend(tiny_model_dir, "cpu")
    ro = _rollout(backend)
    old = PolicyTrainer(_cfg(tiny_model_dir, fuse_old_log_probs=False)).make_experience(ro).old_log_probs
    shifts = [0.0 if i % 2 == 0 else 0.5 for i in range(len(ro.response_ids))]
    learner = PolicyTrainer(_cfg(tiny_model_dir, rollout_correction="seq_mask"))
    exp = learner.make_experience(_shifted(ro, old, shifts))
    mask = exp.batch.response_mask
    keep = torch.tensor([s == 0.0 for s in shifts], dtype=torch.float)
    assert torch.allclose(exp.rollout_is_weights, keep.unsqueeze(-1) * mask)
    m = exp.metrics
    lengths = mask.sum(-1)
    dropped = lengths[keep == 0].sum() / lengths.sum()
    assert m["rollout_correction/masked_seq_frac"] == pytest.approx(0.5)
    assert m["rollout_correction/masked_token_frac"] == pytest.approx(dropped.item(), rel=1e-5)
    mean_shift = (torch.tensor(shifts) * lengths).sum() / lengths.sum()
    assert m["rollout_correction/kl_k1"] == pytest.approx(-mean_shift.item(), rel=1e-3)
    assert "ppo/is_ratio_mean" not in m  # the older names are token_tis's


def test_the_drift_metrics_alone_leave_the_loss_unweighted(tiny_model_dir):
    """rollout_correction_metrics with rollout_correction none: the metrics, no weights."""
    backend = HFBackend(tiny_model_dir, "cpu")
    ro = _rollout(backend)
    old = PolicyTrainer(_cfg(tiny_model_dir, fuse_old_log_probs=False)).make_experience(ro).old_log_probs
    shifted = _shifted(ro, old, [0.25] * len(ro.response_ids))
    assert "rollout_correction/kl" not in PolicyTrainer(_cfg(tiny_model_dir)).make_experience(shifted).metrics
    exp = PolicyTrainer(_cfg(tiny_model_dir, rollout_correction_metrics=True)).make_experience(shifted)
    assert exp.rollout_is_weights is None
    assert exp.metrics["rollout_correction/kl_k1"] == pytest.approx(-0.25, rel=1e-3)
    assert exp.metrics["rollout_correction/chi2_token"] == pytest.approx(math.exp(0.5) - 1, rel=1e-3)
    assert exp.metrics["rollout_correction/weight_mean"] == pytest.approx(1.0)


def test_lora_final_holds_the_merged_model_and_the_peft_adapter(tiny_model_dir, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    learner = PolicyTrainer(_cfg(tiny_model_dir, model={"path": tiny_model_dir, "device": "cpu", "lora": {"rank": 4}}))
    backend = HFBackend(tiny_model_dir, "cpu")
    learner.step(_rollout(backend))
    learner.save_policy(tmp_path / "final", backend.tokenizer)
    assert (tmp_path / "final" / "adapter" / "adapter_config.json").is_file()
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "final")
    assert not any("lora_" in k for k in merged.state_dict())
    # what a PEFT user does: the base model plus the run's adapter
    adapted = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(tiny_model_dir), tmp_path / "final" / "adapter"
    )
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    ids = torch.tensor([backend.tokenizer("abcdh=dc")["input_ids"]])
    with torch.no_grad():
        want = learner.policy(ids).logits
        # merged vs unmerged: another order of float32 operations (see the merged-push test above)
        assert torch.allclose(merged(ids).logits, want, atol=1e-4)
        # the same unmerged PEFT forward on the same weights and input: equal but for float noise
        assert torch.allclose(adapted(ids).logits, want, atol=1e-5)
        assert not torch.allclose(base(ids).logits, want, atol=1e-4)  # the adapter is trained, not a no-op


def _two_versions(ro, split=2, old=0, new=5):
    """`ro` with each response's first `split` tokens from version `old`, the rest from `new`."""
    versions = [[old] * min(split, len(r)) + [new] * max(len(r) - split, 0) for r in ro.response_ids]
    ro.token_versions = versions
    ro.policy_versions = [old] * len(versions)
    return ro


def test_the_staleness_bound_is_judged_token_by_token(tiny_model_dir):
    """A response whose decoding crossed weight updates (versions 0 then 5) for a learner at 6
    with max_staleness 2: its version-0 tokens are out of the loss (weight 0), its version-5 ones
    in. One version per sample (the first, or the last) would drop or keep the whole row."""
    backend = HFBackend(tiny_model_dir, "cpu")
    ro = _two_versions(_rollout(backend))
    assert all(len(r) > 2 for r in ro.response_ids)
    for rollout_is in (False, True):
        learner = PolicyTrainer(_cfg(tiny_model_dir, max_staleness=2, rollout_is=rollout_is))
        learner.policy_version = 6
        exp = learner.make_experience(ro)
        w, mask = exp.rollout_is_weights, exp.batch.response_mask
        assert torch.all(w[:, :2] == 0)  # sampled 6 versions ago
        assert torch.all(w[:, 2:][mask[:, 2:].bool()] > 0)  # 1 version ago: trained
        m = exp.metrics
        lengths = mask.sum(-1)
        assert m["rollout/stale_token_frac"] == pytest.approx((2 * len(lengths) / lengths.sum()).item())
        assert m["rollout/staleness_max"] == 6
    # within the bound, every token counts as before (weight 1 without rollout_is)
    learner = PolicyTrainer(_cfg(tiny_model_dir, max_staleness=6))
    learner.policy_version = 6
    exp = learner.make_experience(ro)
    assert torch.equal(exp.rollout_is_weights, exp.batch.response_mask.float())
    assert exp.metrics["rollout/stale_token_frac"] == 0.0


def test_a_step_on_stale_tokens_only_changes_nothing_they_carry(tiny_model_dir):
    """Every token beyond the bound: the policy loss is 0 (no token trained), not the loss of the
    stale tokens."""
    backend = HFBackend(tiny_model_dir, "cpu")
    ro = _two_versions(_rollout(backend), split=100)  # every token from version 0
    learner = PolicyTrainer(_cfg(tiny_model_dir, max_staleness=2))
    learner.policy_version = 6
    assert learner.step(ro)["ppo/pg_loss"] == 0.0
