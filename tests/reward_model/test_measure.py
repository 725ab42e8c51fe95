"""A reward model measured like one (`services/reward_model/measure.py`), on scores whose answers
are known: accuracy overall and on the hard pairs, the AUC across prompts, the calibration bins."""

import pytest
import torch

from services.reward_model.measure import auc, calibration, describe, measure
from services.reward_model.preferences import Preference


def _pair(prompt, chosen, rejected, hard=False, gold=(1.0, 0.0)):
    return Preference(id=prompt, prompt=prompt, chosen=chosen, rejected=rejected, hard=hard, gold=gold)


def test_accuracy_overall_and_on_the_hard_pairs():
    pairs = [_pair("a", "1", "2", hard=True), _pair("b", "3", "4", hard=True)]
    pairs += [_pair("c", "x", "y"), _pair("d", "u", "v")]
    chosen, rejected = torch.tensor([1.0, 0.0, 2.0, 2.0]), torch.tensor([0.0, 1.0, 1.0, 1.0])
    m = measure(pairs, chosen, rejected)
    assert m["accuracy"] == 0.75 and m["pairs"] == 4
    assert m["hard_accuracy"] == 0.5 and m["hard_pairs"] == 2
    assert "on the hard ones 0.500 (2 pairs)" in describe(m)[0]
    assert measure(pairs[2:], chosen[2:], rejected[2:])["hard_accuracy"] is None


def test_the_auc_compares_answers_across_prompts():
    """Within each prompt the model is right, but prompt b's scores sit above prompt a's: a wrong
    answer of b outscores the right answer of a, which the pairwise accuracy cannot see."""
    pairs = [_pair("a", "right a", "wrong a"), _pair("b", "right b", "wrong b")]
    chosen, rejected = torch.tensor([1.0, 11.0]), torch.tensor([0.0, 10.0])
    m = measure(pairs, chosen, rejected)
    assert m["accuracy"] == 1.0
    # right answers {1, 11} against wrong {0, 10}: 1>0, 1<10, 11>0, 11>10 -> 3 of 4
    assert m["auc"] == pytest.approx(0.75)
    assert auc([(0.0, 1.0), (0.0, 0.0)]) == 0.5  # a tie of the score counts half
    assert auc([(1.0, 1.0), (2.0, 1.0)]) is None  # no two answers the judge tells apart


def test_each_answer_counts_once_and_rows_without_the_judges_scores_are_left_out():
    pairs = [_pair("a", "r", "w1"), _pair("a", "r", "w2"), _pair("b", "x", "y", gold=None)]
    m = measure(pairs, torch.tensor([3.0, 3.0, 0.0]), torch.tensor([1.0, 2.0, 1.0]))
    assert sum(b["answers"] for b in m["calibration"]) == 3  # r, w1, w2: not r twice, nothing of b
    assert m["auc"] == 1.0


def test_calibration_bins_hold_equal_counts_and_the_judges_mean():
    scored = [(float(s), 1.0 if s >= 4 else 0.0) for s in range(8)]
    bins = calibration(scored, bins=4)
    assert [b["answers"] for b in bins] == [2, 2, 2, 2]
    assert [b["judge_mean"] for b in bins] == [0.0, 0.0, 1.0, 1.0]
    assert (bins[0]["score_from"], bins[-1]["score_to"]) == (0.0, 7.0)
    assert len(calibration(scored[:3], bins=8)) == 3
