import pytest

from services.common.types import RewardSample
from services.reward.functions import RewardFunctionError
from services.reward.rules import RULES, resolve_rule
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
    with pytest.raises(RewardFunctionError, match="returned nan"):
        s.score([RewardSample("p", "r")])


def _nan_rule(prompt, response, label, metadata):
    return float("nan")


def _reference_levenshtein(a: str, b: str) -> int:
    prev = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        cur = [i]
        for j, cb in enumerate(b, 1):
            cur.append(min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (ca != cb)))
        prev = cur
    return prev[-1]


@pytest.mark.parametrize(
    "response, label",
    [
        ("kitten", "sitting"),
        ("", "abc"),
        ("abc", ""),
        ("flaw", "lawn"),
        ("héllo wörld", "hello world"),
        ("ab" * 40, "ba" * 37),
        ("x", "x"),
    ],
)
def test_edit_distance_is_one_minus_levenshtein_over_the_longer(response, label):
    expected = 1.0 - _reference_levenshtein(response, label) / max(len(response), len(label))
    assert RULES["edit_distance"]("p", response, label, {}, strip=False) == expected


def test_edit_distance_of_long_texts_is_fast():
    import random
    import time

    rng = random.Random(0)
    a, b = ("".join(rng.choice("abcd") for _ in range(20_000)) for _ in range(2))
    t0 = time.perf_counter()
    v = RULES["edit_distance"]("p", a, b, {})
    # 4e8 cells: a quadratic pure-Python loop takes minutes; the bit-parallel one, milliseconds
    assert time.perf_counter() - t0 < 60
    assert 0.0 < v < 1.0
