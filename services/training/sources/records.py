"""A row of a prompt source as a `PromptRecord`: its prompt rendered (chat messages through the
tokenizer's chat template; a string as it is, or as one user message when `chat_template`), its
label as the string rules compare, its other fields as metadata. A row is `{"prompt": str}`,
`{"prompt": [{"role", "content"}, ...]}` (verl's parquet) or `{"messages": [...]}` (`prompt`
stands for `prompt_key`), with an optional label: the `label_key` field, else verl's
`reward_model.ground_truth`, else `solution`. GSM8K's own rows (`question`, `answer` ending in
`#### N`) give the question as prompt and N as label."""

from __future__ import annotations

import json
import zlib
from dataclasses import dataclass
from typing import Any

from ...common.types import STRUCTURED_LABEL, PromptRecord


@dataclass(frozen=True)
class PromptOptions:
    """How a source's prompts are read and rendered (`load_prompts`' parameters): the tokenizer
    (its chat template), which fields hold the prompt and the label, at most `limit` records, the
    `seed` of a generated source, and `render_prompt`'s chat_template, system_prompt, instruction."""

    tokenizer: Any = None
    prompt_key: str = "prompt"
    label_key: str = "label"
    limit: int | None = None
    seed: int = 0
    chat_template: bool = False
    system_prompt: str | None = None
    instruction: str | None = None

    def render(self, prompt: str | list) -> str:
        return render_prompt(prompt, self.tokenizer, self.chat_template, self.system_prompt, self.instruction)


def render_prompt(
    prompt: str | list,
    tokenizer,
    chat_template: bool = False,
    system_prompt: str | None = None,
    instruction: str | None = None,
) -> str:
    """The prompt text: a list of chat messages rendered through the tokenizer's chat template
    (with the generation prompt); a string (followed by `instruction`, after a space) as is, or,
    when `chat_template`, wrapped as one user message after an optional `system_prompt` message
    and rendered the same way."""
    if isinstance(prompt, str):
        if instruction:
            prompt = f"{prompt} {instruction}"
        if not chat_template:
            return prompt
        system = [{"role": "system", "content": system_prompt}] if system_prompt else []
        prompt = system + [{"role": "user", "content": prompt}]
    if not prompt or not all(isinstance(m, dict) and "role" in m and "content" in m for m in prompt):
        raise ValueError(f"a list prompt must be chat messages, each {{'role', 'content'}}; got {prompt[:2]!r}")
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            "chat messages need a tokenizer with a chat template to render them; "
            + ("none was given" if tokenizer is None else "this tokenizer has none")
        )
    return tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)


def gsm8k_label(answer: str) -> str:
    """The final answer of a GSM8K solution: the number after its `####`, commas removed
    ("... #### 1,234" -> "1234"); the whole answer, stripped, when it has no `####`."""
    _, mark, final = str(answer).rpartition("####")
    return (final if mark else str(answer)).strip().replace(",", "")


def fields(record: dict, prompt_key: str, label_key: str) -> tuple[object, object, set[str]]:
    """(prompt, label, the keys consumed) of a row in any of the formats of the module docstring."""
    messages = record.get("messages")
    if messages is None and prompt_key not in record:
        if "question" in record and "answer" in record:
            return record["question"], gsm8k_label(record["answer"]), {"question", "answer"}
        raise ValueError(
            f"record has neither {prompt_key!r} nor 'messages' (nor GSM8K's 'question' and 'answer'): {sorted(record)}"
        )
    reward_model = record.get("reward_model")
    truth = reward_model.get("ground_truth") if isinstance(reward_model, dict) else None
    label = next((v for v in (record.get(label_key), truth, record.get("solution")) if v is not None), None)
    used = {"messages", prompt_key, label_key, "solution"} | ({"reward_model"} if truth is not None else set())
    return (record[prompt_key] if messages is None else messages), label, used


def record_of(record: dict, default_id: str, options: PromptOptions) -> PromptRecord:
    """A row as a PromptRecord: its prompt rendered as `options` say, its label, and its other
    fields (verl's `data_source` among them) as metadata."""
    prompt, label, used = fields(record, options.prompt_key, options.label_key)
    rid = str(record.get("id", default_id))
    if prompt is None:
        raise ValueError(f"record {rid}: its prompt is null")
    metadata = {k: v for k, v in record.items() if k not in used | {"id"}}
    if isinstance(label, (dict, list)):  # kept as stored for functions that take it so (reward/functions.py)
        metadata[STRUCTURED_LABEL] = label
    return PromptRecord(
        id=rid,
        prompt=options.render(prompt if isinstance(prompt, list) else str(prompt)),
        label=None if label is None else label_text(label),
        metadata=metadata,
    )


def label_text(label) -> str:
    """A label as the string rules compare: itself, a number as written, a structure as JSON."""
    if isinstance(label, str):
        return label
    if isinstance(label, (dict, list)):
        return json.dumps(label, ensure_ascii=False, default=str)
    return str(label)


def split_held_out(
    records: list[PromptRecord], eval_size: int, source: str = "data.train"
) -> tuple[list[PromptRecord], list[PromptRecord]]:
    """(training, held-out) records of one dataset: the held-out ones are the `eval_size` (at most a
    fifth of the distinct prompts) whose prompt text hashes lowest, so the split is the same in
    every run, for every seed and record order; a prompt repeated in the data is held out once, or
    trained on in every copy."""
    texts = sorted({r.prompt for r in records}, key=lambda t: (zlib.crc32(t.encode()), t))
    n = min(eval_size, len(texts) // 5)
    if n == 0:
        raise ValueError(
            f"{source} has {len(texts)} distinct prompts, too few to hold out a fifth for evaluation; "
            "set data.eval to a held-out set"
        )
    held_texts = set(texts[:n])
    first: dict[str, PromptRecord] = {}  # one held-out record per prompt
    for r in records:
        if r.prompt in held_texts:
            first.setdefault(r.prompt, r)
    held = [first[t] for t in texts[:n]]
    return [r for r in records if r.prompt not in held_texts], held
