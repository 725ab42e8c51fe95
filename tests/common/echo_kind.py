"""A made-up environment kind for tests/common/test_environments.py: what adding an ecosystem
takes (this one file, and one EnvironmentKind naming it). `echo:WORD` plays an episode of one turn
whose reward is 1 when the reply holds WORD; its prompts are WORD's letters
(none held out of its own)."""


def check(ref: str) -> None:
    if not ref.removeprefix("echo:").isalpha():
        raise ValueError(f"{ref!r}: give echo:WORD (letters)")


def agent(ref: str, rc):
    word = ref.removeprefix("echo:")

    def run(client, sample) -> float:
        answer = client.chat.completions.create(model="policy", messages=[{"role": "user", "content": sample.prompt}])
        return float(word in (answer.choices[0].message.content or ""))

    return run


def records(ref: str, split: str, tokenizer, limit=None):
    if split == "eval":
        return None  # no held-out set of its own: the loader holds out a split of the training rows
    word = ref.removeprefix("echo:")
    rows = [{"id": f"echo-{split}-{i}", "prompt": f"{c}=", "label": c} for i, c in enumerate(word)]
    return rows[:limit] if limit is not None else rows
