"""The reward-hacking watch on sequences of evaluations: it fires when the held-out reward falls
while the train reward rises, by at least the threshold across a full window, since the run's
start or since its best evaluation, and only then; it warns once per onset; its state survives a
checkpoint, but not a change of the training reward."""

import pytest

from services.training.watch import HackingWatch, judge, trend


def _feed(watch, points, per_eval=2, baseline=None):
    """points: (held-out reward, train reward) per evaluation, the train reward given on each of
    `per_eval` iterations before it; the verdict after each evaluation. `baseline` (iteration,
    held-out reward): an evaluation with no training before it (a run's or a round's first), where
    the iterations start."""
    verdicts, it = [], 0
    if baseline is not None:
        it = baseline[0]
        assert not watch.evaluated(*baseline).suspected
    for eval_reward, train_reward in points:
        for _ in range(per_eval):
            it += 1
            watch.train(train_reward)
        verdicts.append(watch.evaluated(it, eval_reward))
    return verdicts


def test_trend_is_the_fitted_change_across_the_series():
    assert trend([1.0, 2.0, 3.0]) == pytest.approx(2.0)
    assert trend([3.0, 1.0, 2.0]) == pytest.approx(-1.0)  # the line through the points, not last - first
    assert trend([0.5, 0.5, 0.5, 0.5]) == 0.0
    assert trend([4.0]) == 0.0


def test_fires_on_falling_eval_and_rising_train():
    watch = HackingWatch(window=3, min_change=0.05)
    verdicts = _feed(watch, [(0.9, 0.1), (0.8, 0.3), (0.6, 0.5)])
    assert [v.suspected for v in verdicts] == [False, False, True]
    v = verdicts[-1]
    assert v.onset and v.iterations == [2, 4, 6]
    assert v.eval_change == pytest.approx(-0.3) and v.train_change == pytest.approx(0.4)
    msg = v.message()
    assert "iterations 2..6" in msg and "fell by 0.300" in msg and "rose by 0.400" in msg
    assert watch.status() == {
        "suspected": True,
        "iterations": [2, 4, 6],
        "eval_change": pytest.approx(-0.3),
        "train_change": pytest.approx(0.4),
        "since_start": False,
        "since_best": False,
        "since_iteration": 6,
    }


def test_not_when_both_rise_or_both_fall():
    for points in (
        [(0.5, 0.1), (0.7, 0.3), (0.9, 0.5)],
        [(0.9, 0.5), (0.7, 0.3), (0.5, 0.1)],
        [(0.9, 0.5), (0.7, 0.5), (0.5, 0.5)],
    ):  # eval falls, train flat: a bad run, not hacking
        watch = HackingWatch(window=3, min_change=0.05)
        assert not any(v.suspected for v in _feed(watch, points)), points
        assert watch.status() is None


def test_not_on_noise_below_the_threshold():
    watch = HackingWatch(window=3, min_change=0.05)
    verdicts = _feed(watch, [(0.80, 0.50), (0.79, 0.52), (0.78, 0.54)])  # eval -0.02, train +0.04
    assert not any(v.suspected for v in verdicts)
    watch = HackingWatch(window=3, min_change=0.01)  # the same numbers count under a lower threshold
    assert _feed(watch, [(0.80, 0.50), (0.79, 0.52), (0.78, 0.54)])[-1].suspected


def test_not_before_the_window_is_full():
    watch = HackingWatch(window=4, min_change=0.05)
    verdicts = _feed(watch, [(0.9, 0.1), (0.6, 0.4), (0.3, 0.7), (0.1, 0.9)])
    assert [v.suspected for v in verdicts] == [False, False, False, True]


def test_the_baseline_eval_before_any_training_is_not_a_point():
    watch = HackingWatch(window=2, min_change=0.05)
    assert not watch.evaluated(0, 5.0).suspected  # the baseline: no train reward yet
    assert watch.points == []
    assert [v.suspected for v in _feed(watch, [(0.9, 0.1), (0.5, 0.5)])] == [False, True]


def test_train_reward_is_the_mean_since_the_last_eval_and_nan_is_ignored():
    watch = HackingWatch(window=2, min_change=0.05)
    for r in (0.2, float("nan"), 0.4):
        watch.train(r)
    watch.evaluated(3, 0.9)
    assert watch.points == [(3, 0.9, pytest.approx(0.3))]


def test_warns_once_per_onset_and_clears():
    watch = HackingWatch(window=2, min_change=0.05)
    warnings = []
    rows = []
    for it, (eval_reward, train_reward) in enumerate(
        [(0.9, 0.1), (0.7, 0.3), (0.5, 0.5), (1.0, 0.5), (0.8, 0.7)], start=1
    ):
        watch.train(train_reward)
        rows.append(judge(watch, it, {"eval/reward_mean": eval_reward}, warnings.append)[1])
    assert [r["eval/hacking_suspected"] for r in rows] == [0, 1, 1, 0, 1]
    assert len(warnings) == 2  # iterations 2 and 5: two onsets, not three suspected evaluations
    assert "iterations 1..2" in warnings[0] and "iterations 4..5" in warnings[1]
    assert watch.status()["since_iteration"] == 5


def test_off_adds_nothing():
    watch = HackingWatch(window=0)
    watch.train(0.1)
    verdict, row = judge(watch, 1, {"eval/reward_mean": 0.1}, pytest.fail)
    assert not verdict.suspected and row == {} and not watch.enabled


def test_state_survives_a_checkpoint():
    a = HackingWatch(window=3, min_change=0.05)
    _feed(a, [(0.9, 0.1), (0.8, 0.3)])
    a.train(0.6)
    b = HackingWatch(window=3, min_change=0.05)
    b.load_state_dict(a.state_dict())
    assert b.evaluated(5, 0.6).suspected and b.last.onset  # the window goes on where it was
    c = HackingWatch(window=3, min_change=0.05)
    c.load_state_dict(b.state_dict())
    assert c.status()["iterations"] == [2, 4, 5] and not c.last.onset
    HackingWatch().load_state_dict({})  # a checkpoint from before the watch


def test_an_evaluation_without_training_since_repeats_no_onset():
    """Two evaluations in a row (no training between) must not warn twice for one onset."""
    w = HackingWatch(window=3, min_change=0.05)
    verdicts = _feed(w, [(0.9, 0.1), (0.8, 0.3), (0.6, 0.5)])
    assert verdicts[-1].suspected and verdicts[-1].onset
    again = w.evaluated(7, 0.5)  # no train reward since
    assert again.suspected and not again.onset


def test_a_fall_from_the_start_before_the_window_fills():
    """Iterated RLHF's first round on SmolLM2, as it went: the held-out reward 0.117 at the
    baseline, 0.102 and 0.062 after 4 and 8 iterations, the proxy rising all along: two
    evaluations after the baseline are no window of 3, but the fall from the start is seen."""
    watch = HackingWatch(window=3, min_change=0.05)
    verdicts = _feed(watch, [(0.102, 0.9), (0.062, 1.4)], per_eval=4, baseline=(0, 0.117))
    assert [v.suspected for v in verdicts] == [False, True]
    v = verdicts[-1]
    assert v.onset and v.since_start and v.iterations == [0, 8]
    assert v.eval_change == pytest.approx(-0.055) and v.train_change == pytest.approx(0.5)
    assert "since the evaluation of iteration 0 (to iteration 8)" in v.message()
    # a run that gains on the held-out set is not flagged from the start, whatever its train reward
    calm = HackingWatch(window=3, min_change=0.05)
    verdicts = _feed(calm, [(0.10, 0.9), (0.13, 1.4), (0.15, 1.6)], per_eval=4, baseline=(0, 0.117))
    assert not any(v.suspected for v in verdicts)


def test_a_watch_of_another_reward_is_not_restored():
    a = HackingWatch(window=3, min_change=0.05, reward="round-1")
    a.evaluated(0, 0.117)
    _feed(a, [(0.102, 0.9), (0.062, 1.4)])
    assert a.last.suspected
    same = HackingWatch(window=3, min_change=0.05, reward="round-1")
    assert same.load_state_dict(a.state_dict()) and same.last.suspected and same.start == (0, 0.117)
    other = HackingWatch(window=3, min_change=0.05, reward="round-2")
    assert not other.load_state_dict(a.state_dict())
    assert other.start is None and other.points == [] and not other.last.suspected
    # from there it starts again: its first evaluation is its start
    verdicts = _feed(other, [(0.30, 0.2), (0.25, 0.5), (0.20, 0.8)])
    assert other.start == (2, 0.30) and [v.suspected for v in verdicts] == [False, False, True]


def test_the_rewards_identity_is_what_it_scores_not_how_its_scores_are_fetched():
    """A new reward model, rule or API is another reward; the API's timeouts, retries and auth are
    not (a resumed run that only raised `http_timeout_s` keeps its watch)."""
    from services.common.config_sections.reward import RewardConfig
    from services.training.watch import DELIVERY, reward_identity

    assert DELIVERY <= set(RewardConfig.model_fields)
    base = RewardConfig(type="http", http_url="http://judge:8000/score")
    same = base.model_copy(update={"http_timeout_s": 90.0, "http_retries": 9, "group_retries": 1})
    assert reward_identity(same) == reward_identity(base)
    for change in ({"http_url": "http://other:8000/score"}, {"http_weight": 0.5}, {"overlong_penalty": 2.0}):
        assert reward_identity(base.model_copy(update=change)) != reward_identity(base), change


def test_a_climb_then_a_fall_from_the_best():
    """Round 2 of `rlhf iterate`'s second seed on SmolLM2 (docs/iterated-rlhf.md): from the round's
    baseline 0.281 the held-out reward climbed to 0.523 at iteration 12, then fell to 0.344 at 16
    while the train reward rose 0.43 -> 0.80. Above the start, and a 2-point window: only the fall
    from the best sees it; it says so at iteration 16, naming the best's iteration."""
    watch = HackingWatch(window=3, min_change=0.05)
    # from the round's baseline (no training since the last evaluation), 4 iterations an evaluation
    verdicts = _feed(watch, [(0.523, 0.43), (0.344, 0.80)], per_eval=4, baseline=(8, 0.281))
    assert [v.suspected for v in verdicts] == [False, True]
    v = verdicts[-1]
    assert v.onset and v.since_best and v.iterations == [12, 16]
    assert v.eval_change == pytest.approx(-0.179) and v.train_change == pytest.approx(0.37)
    assert "since its best evaluation, at iteration 12" in v.message()
    restored = HackingWatch(window=3, min_change=0.05)
    assert restored.load_state_dict(watch.state_dict()) and restored.best == (12, 0.523, 0.43)
    # a climb that holds stays silent
    calm = HackingWatch(window=3, min_change=0.05)
    verdicts = _feed(calm, [(0.523, 0.43), (0.50, 0.80), (0.53, 0.9)], per_eval=4, baseline=(8, 0.281))
    assert not any(v.suspected for v in verdicts)
