"""The GSM8K-style `math_answer` rule and its answer extraction."""

import pytest

from services.reward.rules import RULES, extract_answer, last_boxed

SOLUTION = "She sold 48 / 2 = 24 in May.\nIn all she sold 48 + 24 = 72 clips.\n#### 72"


def score(response, label, **kwargs):
    return RULES["math_answer"]("p", response, label, {}, **kwargs)


def test_strict_reads_the_number_after_the_marks():
    assert extract_answer(SOLUTION, "strict") == "72"
    assert score(SOLUTION, "72", mode="strict") == 1.0
    assert extract_answer("the answer is 72", "strict") is None
    assert score("the answer is 72", "72", mode="strict") == 0.0
    assert extract_answer("#### 5\nwait, no\n#### -1,234.", "strict") == "-1234"  # the last one
    assert extract_answer("####72", "strict") is None  # lm-eval's pattern wants the space


def test_flexible_takes_the_last_number():
    assert extract_answer("3 apples and 4 pears make 7 fruits", "flexible") == "7"
    assert score("In total: $18.", "18") == 1.0  # flexible is the default
    assert score("It costs $1,234 in all.", "1234") == 1.0
    assert score("the temperature fell to -5 degrees", "-5.0") == 1.0
    assert score("so she pays 3.50 dollars", "3.5") == 1.0
    assert extract_answer("It is 12. Well...", "flexible") == "12"  # "..." is no number
    assert score(SOLUTION, "72") == 1.0


def test_boxed_with_nested_braces():
    assert last_boxed(r"so \boxed{\frac{1}{2}} and \boxed{3}") == "3"
    assert last_boxed(r"\boxed{\frac{1}{2}}") == r"\frac{1}{2}"
    assert last_boxed(r"\boxed{\frac{1}{2}") is None and last_boxed("no box") is None
    assert score(r"the answer is \boxed{\frac{1}{2}}.", r"\frac{1}{2}", mode="boxed") == 1.0
    assert score(r"\boxed{1,234}", "1234", mode="boxed") == 1.0
    assert score(r"\boxed{\$18.00}", "18", mode="boxed") == 1.0
    assert score("#### 72", "72", mode="boxed") == 0.0


def test_auto_prefers_boxed_then_marks_then_the_last_number():
    assert extract_answer(r"#### 5 but really \boxed{6} (or 7)", "auto") == "6"
    assert extract_answer("#### 5 and then 7", "auto") == "5"
    assert extract_answer("maybe 5, then 7", "auto") == "7"
    assert score(r"\boxed{-3}", "-3", mode="auto") == 1.0


def test_no_answer_wrong_answer_and_format_score():
    assert extract_answer("I do not know", "flexible") is None
    assert score("I do not know", "72") == 0.0
    assert score("I do not know", "72", format_score=0.1) == 0.0  # nothing extracted: no format credit
    assert score("#### 71", "72", mode="strict") == 0.0
    assert score("#### 71", "72", mode="strict", format_score=0.1) == 0.1
    assert score(SOLUTION, "72", format_score=0.1) == 1.0


def test_bad_mode_and_missing_label():
    with pytest.raises(ValueError, match="unknown answer mode 'loose'; valid: strict, flexible, boxed, auto"):
        score("1", "1", mode="loose")
    with pytest.raises(ValueError, match="needs a label"):
        score("1", None)
