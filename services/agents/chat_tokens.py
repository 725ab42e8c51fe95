"""The chat template and the tokenizer of the served model, read the way a token-exact session
needs them (sessions.py): a new conversation's prompt, and the tokens of the messages that extend
one after a sampled turn (`ChatTokens.continuation`: the template's closing of that turn, unless the
policy sampled its end itself, then the new messages up to the next generation prompt)."""

from __future__ import annotations

from typing import Protocol


class SampledTurn(Protocol):
    """A sampled turn, as `continuation` reads it (sessions.py's `Choice`): its token ids."""

    ids: list[int]


MARK = "\u2063rlhf-assistant-content\u2063"  # stands in for an assistant turn's content when reading the template


class ChatTokens:
    """The chat template and the tokenizer of the served model, read the way a session needs
    them: the prompt of a new conversation, and the tokens of the messages that extend one."""

    def __init__(self, tokenizer):
        self.tok = tokenizer
        if getattr(tokenizer, "chat_template", None) is None:
            raise ValueError(
                "the model's tokenizer has no chat template: /v1/chat/completions needs one "
                "(tokenizer_config.json's chat_template, or chat_template.jinja in the model directory)"
            )
        probe = self.render([{"role": "user", "content": "x"}, {"role": "assistant", "content": MARK}], False)
        self.closing = probe[probe.index(MARK) + len(MARK) :]  # what the template puts after an assistant turn
        eos = tokenizer.eos_token_id
        self.eos_text = tokenizer.decode([eos]) if eos is not None else ""

    def render(self, messages: list[dict], add_generation_prompt: bool, tools: list | None = None) -> str:
        return self.tok.apply_chat_template(
            messages, tools=tools or None, tokenize=False, add_generation_prompt=add_generation_prompt
        )

    def encode(self, text: str) -> list[int]:
        return list(self.tok(text, add_special_tokens=False)["input_ids"])

    def prompt(self, messages: list[dict], tools: list | None = None) -> list[int]:
        """A new conversation's prompt: the template with the generation prompt, tokenised once."""
        return self.encode(self.render(messages, True, tools))

    def continuation(
        self, before: list[dict], after: list[dict], last: SampledTurn, tools: list | None = None
    ) -> list[int] | None:
        """The tokens that follow the sampled turn `last` (the last message of `before`) when the
        conversation goes on with `after`: the rest of the template's closing of that turn (its end
        of turn, unless the policy sampled it), then `after` as the template renders it, up to the
        next generation prompt. None when the template does not render `before` as a prefix of
        `before + after` (then the session cannot go on token-exact)."""
        head = self.render(before, False, tools)
        full = self.render(before + after, True, tools)
        if not full.startswith(head) or not head.endswith(self.closing):
            return None
        closing = self.closing
        sampled_eos = bool(last.ids) and last.ids[-1] == self.tok.eos_token_id
        if sampled_eos and self.eos_text and closing.startswith(self.eos_text):
            closing = closing[len(self.eos_text) :]  # the policy sampled the end of its turn itself
        return self.encode(closing + full[len(head) :])


class NotTokenExact(ValueError):
    """Echoed token fields that the session cannot go on from: the chat template renders the
    conversation before the echoed message differently once more messages follow it."""

    def __init__(self, index: int):
        super().__init__(
            f"messages[{index}]: the chat template does not render the conversation up to this assistant "
            "message as a prefix of the whole, so the next prompt cannot go on from its token ids"
        )
        self.index = index
