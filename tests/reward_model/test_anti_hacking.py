"""The settings that leave a policy less room to hack a learned reward, each changing the reward
(or the critic) as defined: an ensemble's reward is its members' mean minus `ensemble_penalty`
times their spread; the critic initialised from a reward model reads its head rescaled to the
normalised reward; `rlhf train-rm` with `reward_model.ensemble` writes the ensemble the reward
server serves, and reports the held-out measures."""

import contextlib
import io
import json

import pytest
import torch

from services.cli import main
from services.common.config import ConfigError, config_from_dict
from services.common.reward_model_dir import write_ensemble
from services.common.token_batch import build_token_batch
from services.common.types import RewardSample
from services.critic.critic import Critic
from services.reward.scorer import ModelScorer, build_scorer

TEXTS = ["ab=ba", "abc=cba", "abc=zzz", "q=", "hello=olleh", "x=y"]
SAMPLES = [RewardSample(t.split("=")[0] + "=", t.split("=")[1], None) for t in TEXTS]


def _reward_model(base: str, out, seed: int, mean: float, std: float):
    """A reward model directory made from `base` with a head drawn from `seed` and the given
    reward_stats.json (what `rlhf train-rm` writes, without the training)."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    torch.manual_seed(seed)
    model = AutoModelForSequenceClassification.from_pretrained(base, num_labels=1)
    with torch.no_grad():
        model.score.weight.normal_(0, 1.0)
    model.config.pad_token_id = 0
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(base).save_pretrained(out)
    (out / "reward_stats.json").write_text(json.dumps({"mean": mean, "std": std}))
    return out


@pytest.fixture(scope="module")
def ensemble(untrained_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("ensemble")
    for i, (mean, std) in enumerate([(0.5, 2.0), (-1.0, 0.5), (0.0, 1.0)]):
        _reward_model(untrained_model_dir, root / f"member-{i}", seed=i, mean=mean, std=std)
    write_ensemble(root, [f"member-{i}" for i in range(3)])
    return root


def _rewards(path, penalty: float) -> list:
    cfg = config_from_dict({"reward": {"type": "model", "model_path": str(path), "ensemble_penalty": penalty}})
    return build_scorer(cfg.reward, "cpu").score(SAMPLES)


def test_an_ensembles_reward_is_the_members_mean_minus_the_penalty_times_their_spread(ensemble):
    members = [ModelScorer(str(ensemble / f"member-{i}"), normalize=True) for i in range(3)]
    each = torch.tensor([[r.reward for r in m.score(SAMPLES)] for m in members])
    mean, spread = each.mean(0), each.std(0, unbiased=False)
    assert spread.min() > 1e-3  # the members disagree: the penalty has something to take away
    plain, penalised = _rewards(ensemble, 0.0), _rewards(ensemble, 2.0)
    assert [r.reward for r in plain] == pytest.approx(mean.tolist(), rel=1e-5, abs=1e-5)
    assert [r.reward for r in penalised] == pytest.approx((mean - 2.0 * spread).tolist(), rel=1e-5, abs=1e-5)
    assert all(p.reward < q.reward for p, q in zip(penalised, plain))
    assert [r.components["model_std"] for r in penalised] == pytest.approx(spread.tolist(), rel=1e-5, abs=1e-5)


def test_an_ensemble_member_without_its_statistics_is_refused_before_serving(ensemble, tmp_path):
    from services.cli.preflight import served_reward_model_errors

    assert served_reward_model_errors(ensemble) == []
    (tmp_path / "member-0").mkdir()
    write_ensemble(tmp_path, ["member-0", "member-1"])
    errors = served_reward_model_errors(tmp_path)
    assert any("member-0 (config.json missing)" in e for e in errors) and any("member-1" in e for e in errors)


def _critic_against_scorer(critic, scorer, texts):
    """The critic's value at each sequence's last token, in one padded batch of different lengths
    (prompts left-padded, responses right-padded, as the learner sends them), beside the reward
    server's score of the same text."""
    tok = scorer.tokenizer
    prompts = [tok(t.split("=")[0] + "=")["input_ids"] for t in texts]
    responses = [tok(t.split("=")[1], add_special_tokens=False)["input_ids"] for t in texts]
    batch = build_token_batch(prompts, responses, pad_id=0)
    with torch.no_grad():
        values = critic.model(batch.input_ids, batch.attention_mask, batch.position_ids)
    last = [batch.prompt_width + len(r) - 1 for r in responses]
    got = [values[i, j].item() for i, j in enumerate(last)]
    want = [r.reward for r in scorer.score([RewardSample(t.split("=")[0] + "=", t.split("=")[1], None) for t in texts])]
    return got, want


def test_the_critic_starts_from_the_reward_model_with_its_head_rescaled(untrained_model_dir, tmp_path):
    """Its value at a sequence's last token is the reward model's normalised score of the sequence."""
    rm = _reward_model(untrained_model_dir, tmp_path / "rm", seed=7, mean=0.8, std=2.5)
    cfg = config_from_dict(
        {
            "model": {"path": untrained_model_dir, "device": "cpu"},
            "reward": {"type": "model", "model_path": str(rm), "model_normalize": True},
            "critic": {"init_from_reward_model": True},
        }
    )
    critic = Critic.from_config(cfg)
    got, want = _critic_against_scorer(critic, ModelScorer(str(rm), normalize=True), TEXTS)
    assert got == pytest.approx(want, rel=1e-4, abs=1e-4)
    head = critic.model.value_head
    raw = ModelScorer(str(rm)).model.score.weight.reshape(-1)
    assert torch.allclose(head.weight.reshape(-1), raw / 2.5) and head.bias.item() == pytest.approx(-0.8 / 2.5)


def test_a_critic_from_an_ensemble_reads_its_first_member_normalised_as_served(ensemble, untrained_model_dir):
    """An ensemble's members are always normalised (whatever reward.model_normalize says), so the
    critic's head is its first member's, rescaled with that member's statistics."""
    cfg = config_from_dict(
        {
            "model": {"path": untrained_model_dir, "device": "cpu"},
            "reward": {"type": "model", "model_path": str(ensemble), "model_normalize": False},
            "critic": {"init_from_reward_model": True},
        }
    )
    got, want = _critic_against_scorer(
        Critic.from_config(cfg), ModelScorer(str(ensemble / "member-0"), normalize=True), TEXTS
    )
    assert got == pytest.approx(want, rel=1e-4, abs=1e-4)


def test_init_from_reward_model_needs_the_reward_model_and_no_other_backbone():
    with pytest.raises(ConfigError, match="needs reward.model_path"):
        config_from_dict({"critic": {"init_from_reward_model": True}})
    with pytest.raises(ConfigError, match="unset critic.model_path"):
        config_from_dict(
            {"critic": {"init_from_reward_model": True, "model_path": "x"}, "reward": {"model_path": "rm"}}
        )


def test_train_rm_writes_an_ensemble_and_reports_the_held_out_measures(untrained_model_dir, tmp_path):
    """Pairs with the judge's scores and hard ones marked (as `rlhf make-prefs` writes them): the
    reward_stats.json of each member and of the ensemble hold the accuracy on the hard pairs, the
    AUC across prompts and the calibration bins, and the ensemble is served."""
    rows = []
    for i in range(40):
        a, b = 10 + i, 20 + (i % 7)
        right, wrong = f"{a + b}", f"{a + b + 1 + i % 3}"
        rows.append({"prompt": f"{a}+{b}=", "chosen": right, "rejected": wrong, "chosen_reward": 1.0,
                     "rejected_reward": 0.0, "hard": True})  # fmt: skip
        rows.append({"prompt": f"{a}+{b}=", "chosen": right, "rejected": "zzzz", "chosen_reward": 1.0,
                     "rejected_reward": 0.0, "hard": False})  # fmt: skip
    (tmp_path / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = tmp_path / "rm.yaml"
    config.write_text(
        json.dumps(
            {
                "model": {"path": untrained_model_dir, "device": "cpu"},
                "reward_model": {
                    "train": str(tmp_path / "pairs.jsonl"),
                    "eval_fraction": 0.25,
                    "epochs": 1,
                    "batch_size": 8,
                    "micro_batch_size": 8,
                    "lr": 1e-3,
                    "ensemble": 2,
                },
            }  # fmt: skip
        )
    )
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert main(["train-rm", "-c", str(config), "--out", str(tmp_path / "rm")]) == 0
    out = printed.getvalue()
    assert "ensemble member 2 of 2 (seed 1)" in out and "on the hard ones" in out and "across prompts: AUC" in out
    stats = json.loads((tmp_path / "rm" / "reward_stats.json").read_text())
    assert stats["members"] == ["member-0", "member-1"] and stats["held_out_pairs"] == 20
    assert stats["held_out_hard_pairs"] == 10 and 0 <= stats["held_out_hard_accuracy"] <= 1
    # 10 held-out prompts, each with three answers: the right one, a near miss, "zzzz"
    assert 0 <= stats["held_out_auc"] <= 1 and sum(b["answers"] for b in stats["calibration"]) == 30
    for m in ("member-0", "member-1"):
        member = json.loads((tmp_path / "rm" / m / "reward_stats.json").read_text())
        assert member["held_out_hard_pairs"] == 10 and member["std"] > 0
    assert (tmp_path / "rm" / "calibration.png").stat().st_size > 0
    # what train-rm measured is what the reward server pays: its held-out accuracy, from the served rewards
    from services.reward_model.preferences import PreferenceKeys, load_preferences, split_held_out

    _, held = split_held_out(load_preferences(str(tmp_path / "pairs.jsonl"), "train", PreferenceKeys()), 0.25, 0)
    cfg = config_from_dict({"reward": {"type": "model", "model_path": str(tmp_path / "rm"), "ensemble_penalty": 0.0}})
    served = build_scorer(cfg.reward, "cpu").score(
        [RewardSample(p.prompt, p.chosen, None) for p in held]
        + [RewardSample(p.prompt, p.rejected, None) for p in held]
    )
    right = sum(c.reward > r.reward for c, r in zip(served[: len(held)], served[len(held) :]))
    assert right / len(held) == pytest.approx(stats["held_out_accuracy"])
    # one model trained into the same directory afterwards is what is served then, not the old ensemble
    with contextlib.redirect_stdout(io.StringIO()):
        assert (
            main(["train-rm", "-c", str(config), "--out", str(tmp_path / "rm"), "--set", "reward_model.ensemble=1"])
            == 0
        )
    assert not (tmp_path / "rm" / "ensemble.json").exists()
    assert isinstance(build_scorer(cfg.reward, "cpu"), ModelScorer)
