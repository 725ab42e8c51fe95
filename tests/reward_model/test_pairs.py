"""Pair construction (`services/reward_model/pairs.py`): every pair the judge tells apart, each
text once, never two answers it scores alike; hard negatives (one form, different numbers) found
and made, and kept first when a prompt's pairs are capped."""

import random

from services.reward_model.pairs import (
    Judged,
    cap_pairs,
    counterfactuals,
    form,
    is_hard,
    judged_pairs,
    pair_row,
)


def test_k_right_of_n_give_k_times_n_minus_k_pairs():
    answers = [Judged(f"right {i}", 1.0) for i in range(3)] + [Judged(f"wrong {i}", 0.0) for i in range(5)]
    pairs = judged_pairs(answers, min_gap=1e-9)
    assert len(pairs) == 3 * 5
    assert {(c.text, r.text) for c, r in pairs} == {(f"right {i}", f"wrong {j}") for i in range(3) for j in range(5)}


def test_graded_scores_pair_every_two_apart_and_never_two_alike():
    answers = [Judged("a", 2.0), Judged("b", 1.0), Judged("c", 1.0), Judged("d", 0.5)]
    pairs = {(c.text, r.text) for c, r in judged_pairs(answers, min_gap=1e-9)}
    assert pairs == {("a", "b"), ("a", "c"), ("a", "d"), ("b", "d"), ("c", "d")}  # b and c alike: no pair
    assert {(c.text, r.text) for c, r in judged_pairs(answers, min_gap=0.75)} == {("a", "b"), ("a", "c"), ("a", "d")}


def test_a_text_sampled_twice_counts_once_and_all_alike_give_none():
    answers = [Judged("12", 1.0), Judged("12", 1.0), Judged("13", 0.0)]
    assert [(c.text, r.text) for c, r in judged_pairs(answers, 1e-9)] == [("12", "13")]
    assert judged_pairs([Judged("x", 0.0), Judged("y", 0.0)], 1e-9) == []


def test_hard_means_one_form_and_different_numbers():
    assert form("14 + 15 = 29") == "# + # = #"
    assert is_hard("14 + 15 = 29", "14 + 15 = 39")
    assert is_hard("The answer is 29.", "The answer is -3.")
    assert not is_hard("14 + 15 = 29", "The answer is 29")  # another form
    assert not is_hard("abc", "abd")  # no number: not what hard means here
    assert not is_hard("29", "29 ")  # the same answer


def test_counterfactuals_change_one_number_and_keep_the_form():
    rng = random.Random(0)
    made = counterfactuals("14 + 15 = 29", 6, rng)
    assert len(made) == 6 and len(set(made)) == 6 and "14 + 15 = 29" not in made
    for text in made:
        assert form(text) == "# + # = #"
        changed = [a != b for a, b in zip("14 + 15 = 29".split(), text.split())]
        assert sum(changed) == 1, text
    assert counterfactuals("no number here", 3, rng) == []


def test_a_row_says_whether_its_pair_is_hard_or_made():
    row = pair_row("p1", "What is 14 + 15?", "29", Judged("14 + 15 = 29", 1.0), Judged("14 + 15 = 39", 0.0, True))
    assert row["hard"] and row["synthetic"] and row["chosen_reward"] == 1.0 and row["rejected_reward"] == 0.0
    row = pair_row("p1", "q", "29", Judged("29", 1.0), Judged("I do not know", 0.0))
    assert not row["hard"] and not row["synthetic"]


def test_a_cap_keeps_the_hard_pairs_first():
    answers = [Judged("= 29", 1.0), Judged("= 39", 0.0), Judged("= 28", 0.0)] + [
        Judged(f"no idea {c}", 0.0) for c in "abcdef"
    ]
    pairs = judged_pairs(answers, 1e-9)
    assert len(pairs) == 8
    kept = cap_pairs(pairs, 3, random.Random(0))
    assert len(kept) == 3
    assert sum(is_hard(c.text, r.text) for c, r in kept) == 2  # both hard pairs, then one other
    assert cap_pairs(pairs, None, random.Random(0)) == pairs


def test_counterfactuals_are_judged_and_the_ones_judged_worse_become_hard_pairs():
    """make-prefs' step 3 with the real math_answer judge: copies of a prompt's best answer with a
    number changed; the judge finds the ones that changed the sum wrong, and those pair as hard."""
    from services.common.config_sections import RuleSpec
    from services.common.types import PromptRecord
    from services.reward.scorer import RuleScorer
    from services.reward_model.rlaif import _add_counterfactuals

    prompt = PromptRecord(id="p", prompt="What is 14 + 15?", label="29")
    answers = {"p": [Judged("14 + 15 = 29", 1.0), Judged("I think it is thirty", 0.0)]}
    judge = RuleScorer.from_specs([RuleSpec(name="math_answer")])
    made = _add_counterfactuals([prompt], answers, judge, 6, random.Random(0))
    assert made == 6 and len(answers["p"]) == 8 and all(a.synthetic for a in answers["p"][2:])
    for a in answers["p"][2:]:  # the judge's verdict: right only when the last number is still 29
        assert a.score == (1.0 if a.text.endswith("= 29") else 0.0), a
    rows = [pair_row("p", prompt.prompt, "29", c, r) for c, r in judged_pairs(answers["p"], 1e-9)]
    hard = [r for r in rows if r["hard"]]
    assert hard and all(r["chosen"] == "14 + 15 = 29" or r["chosen"].endswith("= 29") for r in hard)
    assert all(r["synthetic"] for r in hard)


def test_a_numeric_label_corrects_the_last_number_of_a_wrong_answer_first():
    made = counterfactuals("15 + 81 = 92, I believe", 3, random.Random(1), label="96")
    assert made[0] == "15 + 81 = 96, I believe" and len(made) == 3
    assert all(form(m) == form("15 + 81 = 92, I believe") for m in made)
    right = counterfactuals("15 + 81 = 96", 2, random.Random(1), label="96")
    assert "15 + 81 = 96" not in right and len(right) == 2  # a right answer is not "corrected"
    assert counterfactuals("the answer is 9", 1, random.Random(1), label="abc")[0] != "the answer is abc"


def test_numbers_are_read_whole_and_written_back_as_they_were():
    from services.reward_model.pairs import NUMBER, nudged

    assert NUMBER.findall("10-5 = 5, x2, -3 and 1,234.5 or 1, 2") == ["10", "5", "5", "-3", "1,234.5", "1", "2"]
    assert nudged("1,234", 10) == "1,244" and nudged("2.50", -1) == "1.50" and nudged("-3", 5) == "2"
    assert nudged("3.14159265", 1) == "4.14159265" and nudged("1234567", 1) == "1234568"
    made = counterfactuals("The total is 1,234.", 1, random.Random(0), label="1,334")
    assert made == ["The total is 1,334."]


def test_a_score_the_judge_could_not_give_makes_no_pair():
    answers = [Judged("a", 1.0), Judged("b", float("nan")), Judged("c", 0.0)]
    assert [(c.text, r.text) for c, r in judged_pairs(answers, 1e-9)] == [("a", "c")]
