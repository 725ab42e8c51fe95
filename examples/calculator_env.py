"""A calculator environment for `rollout.environment` (configs/smollm2-calculator.yaml): the
policy is asked a product of two 2-digit numbers (`synthetic:multiply`), beyond what a small model
multiplies in its head, and offered a calculator. A first reply with a calculation in it
("52 * 97") is a call: the environment answers with the result of that calculation, the one the
policy wrote (a wrong number copied from the question gives a wrong result), and asks for the
answer; the reply after it is the answer. A first reply without a calculation is the answer at
once. Reward 1 when the answer (the last number of the final reply) is right, 0 otherwise.

The reward comes only at the end. Answering at once is right only when the model multiplies in
its head; through the calculator it needs both turns right: the call must copy the question's
numbers, and the answer must copy the calculator's result, a number the policy sees only in the
environment's turn. Both replies are trained on (mask 1); the calculator's turn is context only
(mask 0). Run it:

    make run-smollm2-calculator
    rlhf eval -c configs/smollm2-calculator.yaml --baseline runs/smollm2-135m --model runs/smollm2-calculator/final
"""

import re

CALL = re.compile(r"(\d+)\s*(?:\*|x|×|times)\s*(\d+)")
NUMBER = re.compile(r"-?\d+")


def last_number(reply: str) -> str | None:
    """The last whole number in a reply (commas between digit groups dropped), or None."""
    found = NUMBER.findall(re.sub(r"(?<=\d),(?=\d{3})", "", reply))
    return found[-1] if found else None


class Calculator:
    max_tokens = 24  # each reply's limit

    def reset(self, sample) -> str:
        a, b = sample.metadata["a"], sample.metadata["b"]
        self.label, self.called = str(sample.label), False
        return (
            f"What is {a} times {b}? You have a calculator: to use it, reply with the calculation only, "
            "like 12 * 34. Then answer with the number only."
        )

    def step(self, reply: str):
        call = None if self.called else CALL.search(reply)
        if call is not None:
            self.called = True
            x, y = int(call.group(1)), int(call.group(2))
            return f"Calculator: {x} * {y} = {x * y}. What is the answer? Reply with the number only.", 0.0, False
        return None, float(last_number(reply) == self.label), True
