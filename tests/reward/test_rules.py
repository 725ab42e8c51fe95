import pytest

from services.reward.rules import RULES, resolve_rule
from services.common.types import RewardSample
from services.reward.scorer import CombinedScorer, RuleScorer


def test_rules_hand_cases():
    assert RULES["exact_match"]("p", " cba ", "cba", {}) == 1.0
    assert RULES["exact_match"]("p", "cbb", "cba", {}) == 0.0
    assert RULES["edit_distance"]("p", "cbx", "cba", {}) == pytest.approx(2 / 3)
    assert RULES["edit_distance"]("p", "", "", {}) == 1.0
    assert RULES["verifiable_answer"]("p", "so answer: 42.", "42", {}) == 1.0
    assert RULES["verifiable_answer"]("p", "\\boxed{3.0}", "3", {}) == 1.0
    assert RULES["verifiable_answer"]("p", "no idea", "3", {}) == 0.0
    assert RULES["repetition"]("p", "abcabcabc", None, {}) < -0.4
    assert RULES["repetition"]("p", "abcdefg", None, {}) == 0.0
    assert RULES["length"]("p", "x" * 15, None, {}, max_len=10) == pytest.approx(-0.5)
    assert RULES["regex_format"]("p", "<a>1</a>", None, {}, pattern=r"<a>\d+</a>") == 1.0
    with pytest.raises(ValueError, match="needs a label"):
        RULES["exact_match"]("p", "x", None, {})


def test_resolve_by_import_path_and_unknown():
    fn = resolve_rule("services.reward.rules:edit_similarity")
    assert fn("p", "a", "a", {}) == 1.0
    with pytest.raises(ValueError, match="registered: .*exact_match"):
        resolve_rule("nope")


def test_rule_scorer_weights_and_components():
    s = RuleScorer([("exact_match", 2.0, {}), ("edit_distance", 0.5, {})])
    [r] = s.score([RewardSample("abc=", "cba", "cba")])
    assert r.reward == pytest.approx(2.5) and r.components == {"exact_match": 1.0, "edit_distance": 1.0}
    combo = CombinedScorer([("a", 1.0, s), ("b", -1.0, RuleScorer([("exact_match", 1.0, {})]))])
    [r] = combo.score([RewardSample("abc=", "cba", "cba")])
    assert r.reward == pytest.approx(1.5) and r.components["a"] == 2.5


def test_non_finite_rule_is_an_error():
    s = RuleScorer([("tests.reward.test_rules:_nan_rule", 1.0, {})])
    with pytest.raises(ValueError, match="returned nan"):
        s.score([RewardSample("p", "r")])


def _nan_rule(prompt, response, label, metadata):
    return float("nan")
