"""A real verifiers environment for the tests (tests/rollout/test_verifiers.py): a vf.SingleTurnEnv over
an in-memory `datasets.Dataset` of the tiny model's task (reverse "abc=" -> "cba"), scored by a
Rubric of two reward functions, `exact` (weight 1) and `in_place` (weight 0.5). Questions that
start with a marker fail on purpose, each in one of the ways a rollout or its scoring can fail."""

import math

import verifiers as vf
from datasets import Dataset

LETTERS = "abcdefgh"
RAISES = "x"  # setup_state raises RuntimeError: the environment's own code failed
REFUSES = "y"  # setup_state raises a vf.Error: verifiers stops the rollout with state["error"]
BROKEN = "z"  # the `exact` reward function raises (verifiers would log it and score it 0.0)
NAN = "w"  # `in_place` gives NaN


def questions(n: int, offset: int = 0) -> list[str]:
    """n distinct strings of 3 letters, from the `offset`th on."""
    out = []
    for i in range(offset, offset + n):
        a, b, c = i % 8, (i // 8) % 8, (i // 64) % 8
        out.append(LETTERS[a] + LETTERS[b] + LETTERS[c] + "=")
    return out


def rows(qs: list[str]) -> list[dict]:
    return [{"question": q, "answer": q.rstrip("=")[::-1], "info": {"letters": len(q) - 1}} for q in qs]


def reply(completion) -> str:
    return completion[-1]["content"] if completion else ""


def exact(completion, answer) -> float:
    if answer.startswith(BROKEN):
        raise ValueError("the checker broke")
    return 1.0 if reply(completion).strip() == answer else 0.0


def in_place(completion, answer, info) -> float:
    """The share of the answer's letters in place (`info` of a prompt of another source: its
    record's metadata)."""
    if answer.startswith(NAN):
        return math.nan
    got = reply(completion).strip()
    return sum(1 for i, c in enumerate(answer) if i < len(got) and got[i] == c) / info.get("letters", len(answer))


class ReverseEnv(vf.SingleTurnEnv):
    async def setup_state(self, state):
        question = state["prompt"][-1]["content"]
        if question.startswith(RAISES):
            raise RuntimeError("the environment's tool crashed")
        if question.startswith(REFUSES):
            raise vf.ToolCallError("the sandbox refused the question")
        return state


def load_environment(n: int = 40, eval_n: int = 0, overlap: int = 0, extra: str = "") -> vf.Environment:
    """`n` training rows; `eval_n` eval rows (none: no eval_dataset), the first `overlap` of them
    training rows too; `extra`: more questions, comma-separated, appended to the training rows."""
    train = questions(n) + [q for q in extra.split(",") if q]
    held = questions(overlap) + questions(eval_n - overlap, offset=n) if eval_n else []
    rubric = vf.Rubric(funcs=[exact, in_place], weights=[1.0, 0.5])
    return ReverseEnv(
        dataset=Dataset.from_list(rows(train)),
        eval_dataset=Dataset.from_list(rows(held)) if held else None,
        rubric=rubric,
        sampling_args={"max_tokens": 6, "temperature": 0.7},
    )


class AgainEnv(vf.MultiTurnEnv):
    """After each reply: "again=", for ever (the endpoint's max_turns ends the episode)."""

    async def env_response(self, messages, state, **kwargs):
        return [{"role": "user", "content": "again="}]


def replies(completion) -> float:
    return 0.1 * sum(1 for m in completion if m["role"] == "assistant")


def load_multiturn() -> vf.Environment:
    return AgainEnv(
        dataset=Dataset.from_list(rows(questions(10))),
        rubric=vf.Rubric(funcs=[replies]),
        sampling_args={"max_tokens": 3},
    )


def load_grouped() -> vf.Environment:
    """An environment whose rubric scores a group at once (not supported: each session is scored alone)."""

    def relative(completions, answers) -> list[float]:
        return [0.0 for _ in completions]

    return vf.SingleTurnEnv(dataset=Dataset.from_list(rows(questions(10))), rubric=vf.Rubric(funcs=[relative]))


def load_nothing():
    return "not an environment"
