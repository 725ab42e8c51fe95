"""On-policy distillation on the sampling side (services/training/distill.py): the hint reaches
the teacher's context and never the student's; each sample's teacher log-probs travel through the
replay record and into the learner's rollout; the configurations that cannot teach are refused."""

import numpy as np
import pytest

from services.common.config import ConfigError, config_from_dict
from services.common.replay.records import group_from_proto, group_to_proto
from services.common.rpc.gen import replay_pb2 as rpb
from services.common.types import (
    Completion,
    GenerationResult,
    PromptRecord,
    Rollout,
    SampleGroup,
    SamplingParams,
    ScoreResult,
    TeacherScores,
)
from services.training.distill import Distillation, Hint
from services.training.sampling import Prompt, ReplySampler

RECORD = PromptRecord("r1", "What is 12 + 30?", "42", {"source": "unit"})


class RecordingBackend:
    """A stand-in generation backend: two fixed replies per prompt; records the prompts it got."""

    def __init__(self):
        self.prompts = []

    def generate(self, prompts, params):
        self.prompts.extend(list(p) for p in prompts)
        comps = [[Completion([5, 6, 7], [-1.0, -2.0, -3.0], "length") for _ in range(params.n)] for _ in prompts]
        return GenerationResult(comps, 3, 3 * params.n * len(prompts), 0.0)


class RecordingTeacher:
    """A stand-in teacher: -0.5 per token, its top-1 the sampled token on even positions."""

    def __init__(self):
        self.contexts = []

    def score(self, prompts, responses, top_k=0):
        self.contexts.extend(list(p) for p in prompts)
        lp = [[-0.5] * len(r) for r in responses]
        top = [[[t if i % 2 == 0 else t + 1] for i, t in enumerate(r)] for r in responses] if top_k else None
        return TeacherScores(lp, top, [[[-0.5]] * len(r) for r in responses] if top_k else None)


class Rewards:
    def score(self, samples):
        return [ScoreResult(1.0) for _ in samples]


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from services.common.model_files import load_tokenizer

    return load_tokenizer(tiny_model_dir)


def test_the_hint_reaches_the_teachers_context_and_never_the_students(tokenizer):
    tok = tokenizer
    backend, teacher = RecordingBackend(), RecordingTeacher()
    distill = Distillation(teacher, tok, Hint("so {label}", tok), top_k=1)
    sampler = ReplySampler(backend, Rewards(), tok, SamplingParams(n=2, max_new_tokens=3), distill=distill)
    out = sampler.sample([Prompt(RECORD, "0:r1")])
    student = tok(RECORD.prompt)["input_ids"]
    assert backend.prompts == [student]
    hint = tok.decode(teacher.contexts[0], skip_special_tokens=True)
    assert teacher.contexts == [teacher.contexts[0]] * 2 and "so 42" in hint
    assert "42" not in tok.decode(backend.prompts[0], skip_special_tokens=True)
    (group,) = out.groups
    assert group.teacher_log_probs == [[-0.5] * 3] * 2
    # sampler minus teacher over 6 tokens: ((-1 + 0.5) + (-2 + 0.5) + (-3 + 0.5)) * 2 / 6
    assert out.metrics["distill/reverse_kl_sampler"] == pytest.approx(-1.5)
    assert out.metrics["distill/teacher_top1_agree"] == pytest.approx(4 / 6)
    assert "time/teacher_s" in out.metrics


def test_the_hint_goes_inside_the_last_user_message_of_a_chat_prompt(tokenizer):
    tok = tokenizer
    hint = Hint("so {label}", tok)
    assert hint.turn_end  # the tiny tokenizer has a chat template
    rendered = tok.apply_chat_template([{"role": "user", "content": "12="}], tokenize=False, add_generation_prompt=True)
    context = tok.decode(hint.context(tok(rendered)["input_ids"], RECORD), skip_special_tokens=False)
    assert context.endswith(hint.turn_end) and "so 42" in context
    assert context.index("12=") < context.index("so 42") < context.rindex(hint.turn_end)


def test_a_hint_that_names_a_field_the_record_lacks_says_which(tokenizer):
    with pytest.raises(ValueError, match=r"record 'r1' cannot fill it .*'solution'.*\['source'\]"):
        Hint("{solution}", tokenizer).text(RECORD)
    assert Hint("{source}: {label}", tokenizer).text(RECORD) == "unit: 42"


def test_the_policy_as_teacher_scores_on_the_backend_that_sampled(tokenizer):
    class ScoringBackend(RecordingBackend):
        def score(self, sequences, starts):
            from services.common.types import TokenScores

            self.scored = (sequences, starts)
            return TokenScores([[-0.25] * (len(s) - st) for s, st in zip(sequences, starts)], 3, "float32")

    tok = tokenizer
    cfg = config_from_dict({"distill": {"enabled": True, "teacher": "policy", "hint": "so {label}"}})
    backend = ScoringBackend()
    distill = Distillation.for_training(cfg, tok, teacher=None)
    sampler = ReplySampler(backend, Rewards(), tok, SamplingParams(n=2, max_new_tokens=3), distill=distill)
    (group,) = sampler.sample([Prompt(RECORD, "0:r1")]).groups
    sequences, starts = backend.scored
    assert [s[st:] for s, st in zip(sequences, starts)] == [[5, 6, 7]] * 2
    assert starts[0] > len(tok(RECORD.prompt)["input_ids"])  # the hint is in the scored context
    assert group.teacher_log_probs == [[-0.25] * 3] * 2


def _group(teacher):
    comps = [Completion([5, 6], [-0.5, -0.7], "stop"), Completion([8], [-0.1], "stop")]
    return SampleGroup("0:r1", RECORD, [1, 2], comps, [ScoreResult(1.0), ScoreResult(0.0)], None, 4, teacher)


def test_teacher_log_probs_travel_through_the_replay_record_into_the_rollout():
    task = rpb.PromptTask(uid="0:r1", record_id="r1", prompt=RECORD.prompt, label="42")
    back = group_from_proto(group_to_proto(_group([[-1.5, -2.5], [-0.25]]), task, worker="w", server="s"))
    assert back.teacher_log_probs == [[-1.5, -2.5], [-0.25]]
    assert group_from_proto(group_to_proto(_group(None), task, worker="w", server="s")).teacher_log_probs is None
    assert Rollout.from_groups([back, back]).teacher_log_probs == [[-1.5, -2.5], [-0.25]] * 2
    assert Rollout.from_groups([back, _group(None)]).teacher_log_probs is None  # only when every group has them


@pytest.mark.parametrize(
    "bad, says",
    [([[-1.5], [-0.25]], "1 teacher log-probs for 2 tokens"), ([[-1.5, np.nan], [-0.25]], "not finite")],
)
def test_a_record_with_broken_teacher_log_probs_is_refused(bad, says):
    task = rpb.PromptTask(uid="0:r1", record_id="r1", prompt=RECORD.prompt)
    msg = group_to_proto(_group([[-1.5, -2.5], [-0.25]]), task, worker="w", server="s")
    msg.samples[0].teacher_log_probs = np.asarray(bad[0], np.float32).tobytes()
    with pytest.raises(ValueError, match=says):
        group_from_proto(msg)


@pytest.mark.parametrize(
    "settings, says",
    [
        ({"distill": {"enabled": True, "teacher": "policy"}}, "without distill.hint"),
        (
            {"distill": {"enabled": True}, "num_return_sequences_in_group": 2, "rollout": {"dynamic_sampling": True}},
            "every sampled token carries the teacher's signal",
        ),
    ],
)
def test_a_distillation_that_cannot_teach_is_refused(settings, says):
    with pytest.raises(ConfigError, match=says):
        config_from_dict(settings)


def _one_distilled_iteration(tiny_model_dir, tmp_path, hint):
    """One iteration of `train --local` on the tiny model, pure distillation from the frozen
    initial model (with `hint` in its context, or none), nothing else in the loss; its metrics."""
    import json

    from services.local import run_local

    cfg = config_from_dict(
        {
            "model": {"path": tiny_model_dir, "device": "cpu"},
            "prompt_length": 16,
            "response_length": 8,
            "rollout_batch_size": 16,
            "ppo_mini_batch_size": 32,  # one step on the whole batch: old log-probs fused, the sampler's stand in
            "ppo_epochs": 1,
            "adv_estimator": "grpo",
            "num_return_sequences_in_group": 2,
            "use_kl_loss": False,
            "whiten_advantages": False,
            "distill": {"enabled": True, "hint": hint, "reward_weight": 0.0},
            "data": {"train": "synthetic:reverse", "eval": "synthetic:reverse", "eval_size": 4},
            "run": {"iterations": 1, "eval_interval": 0, "checkpoint_interval": 0, "seed": 0},
        }
    )
    run_local(cfg, tmp_path / ("hint" if hint else "same"))
    rows = [json.loads(x) for x in (tmp_path / ("hint" if hint else "same") / "metrics.jsonl").read_text().splitlines()]
    return next(r for r in rows if "distill/reverse_kl" in r)


def test_a_teacher_identical_to_the_student_leaves_the_policy_where_it_is(tiny_model_dir, tmp_path):
    """The frozen initial model without a hint is the student at the first step: every advantage is
    0 up to float noise (its forward and the learner's batch the tokens differently), so the loss
    has no gradient; the same teacher shown the answer gives one."""
    same = _one_distilled_iteration(tiny_model_dir, tmp_path, None)
    hinted = _one_distilled_iteration(tiny_model_dir, tmp_path, "so {label}")
    assert abs(same["distill/reverse_kl"]) < 1e-4 and abs(same["distill/advantage_mean"]) < 1e-4
    assert same["ppo/grad_norm"] < 1e-3
    assert hinted["distill/reverse_kl"] > 0.1 and hinted["ppo/grad_norm"] > 1.0


def test_the_teachers_top_k_travels_through_the_replay_record_into_the_rollout():
    task = rpb.PromptTask(uid="0:r1", record_id="r1", prompt=RECORD.prompt, label="42")
    g = _group([[-1.5, -2.5], [-0.25]])
    g.teacher_top_ids = [[[5, 9], [6, 2]], [[8, 1]]]
    g.teacher_top_log_probs = [[[-0.5, -1.5], [-0.25, -3.0]], [[-0.125, -2.5]]]
    back = group_from_proto(group_to_proto(g, task, worker="w", server="s"))
    assert back.teacher_top_ids == g.teacher_top_ids and back.teacher_top_log_probs == g.teacher_top_log_probs
    rollout = Rollout.from_groups([back, back])
    assert rollout.teacher_top_ids == g.teacher_top_ids * 2
    assert Rollout.from_groups([back, _group(None)]).teacher_top_ids is None


@pytest.mark.parametrize(
    "field, value, says",
    [
        ("teacher_top_k", 3, "k=3"),
        ("teacher_top_ids", np.asarray([[5, -9], [6, 2]], "<i4").tobytes(), "below 0"),
        ("teacher_top_log_probs", np.asarray([[-0.5, np.inf], [-0.25, -3.0]], "<f4").tobytes(), "not finite"),
        ("teacher_top_ids", b"", "with 0 ids"),
    ],
)
def test_a_record_with_a_broken_top_k_is_refused(field, value, says):
    task = rpb.PromptTask(uid="0:r1", record_id="r1", prompt=RECORD.prompt)
    g = _group([[-1.5, -2.5], [-0.25]])
    g.teacher_top_ids = [[[5, 9], [6, 2]], [[8, 1]]]
    g.teacher_top_log_probs = [[[-0.5, -1.5], [-0.25, -3.0]], [[-0.125, -2.5]]]
    msg = group_to_proto(g, task, worker="w", server="s")
    setattr(msg.samples[0], field, value)
    with pytest.raises(ValueError, match=says):
        group_from_proto(msg)


def test_the_sampler_keeps_the_top_k_only_for_the_forward_kl():
    for coef, kept in ((0.0, False), (0.5, True)):
        cfg = config_from_dict({"distill": {"enabled": True, "top_k": 2, "forward_kl_coef": coef}})
        d = Distillation.for_training(cfg, None, RecordingTeacher())
        g = _group(None)
        d.read([g])
        assert (g.teacher_top_ids is not None) is kept
        if kept:
            assert g.teacher_top_ids == [[[5], [7]], [[8]]]  # the stand-in's top-1: the token, or one past it


def test_a_forward_kl_without_a_top_k_is_refused():
    with pytest.raises(ConfigError, match="needs the teacher's top-k"):
        config_from_dict({"distill": {"enabled": True, "forward_kl_coef": 1.0}})
    with pytest.raises(ConfigError, match="needs the teacher's top-k"):
        config_from_dict(
            {"distill": {"enabled": True, "forward_kl_coef": 1.0, "top_k": 4, "teacher": "policy", "hint": "{label}"}}
        )


def test_train_local_with_the_forward_kl_trains_on_the_teachers_top_k(tiny_model_dir, tmp_path):
    """One iteration of `train --local` on the tiny model, the frozen initial model shown a hint as
    the teacher, the top-k forward KL the only term (reverse KL and task weights 0): the loss is
    positive and has a gradient, and the metric is logged."""
    import json

    from services.local import run_local

    cfg = config_from_dict(
        {
            "model": {"path": tiny_model_dir, "device": "cpu"},
            "prompt_length": 16,
            "response_length": 8,
            "rollout_batch_size": 8,
            "ppo_mini_batch_size": 16,
            "ppo_epochs": 1,
            "adv_estimator": "grpo",
            "num_return_sequences_in_group": 2,
            "use_kl_loss": False,
            "distill": {
                "enabled": True,
                "hint": "so {label}",
                "reward_weight": 0.0,
                "kl_coef": 0.0,
                "top_k": 4,
                "forward_kl_coef": 1.0,
            },
            "data": {"train": "synthetic:reverse", "eval": "synthetic:reverse", "eval_size": 4},
            "run": {"iterations": 1, "eval_interval": 0, "checkpoint_interval": 0, "seed": 0},
        }
    )
    run_local(cfg, tmp_path / "fkl")
    rows = [json.loads(x) for x in (tmp_path / "fkl" / "metrics.jsonl").read_text().splitlines()]
    row = next(r for r in rows if "distill/forward_kl_topk" in r)
    assert row["distill/forward_kl_topk"] > 1e-3 and row["ppo/grad_norm"] > 1e-3
