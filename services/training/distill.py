"""On-policy distillation, the sampling side: a teacher reads every sampled token.

    Distillation.read(groups, backend)    after a batch is sampled and scored (ReplySampler's
                                          `sample_groups`, AgentSampler alike)
      contexts       each group's prompt as the teacher sees it: the student's prompt, or it with
                     the privileged hint (`distill.hint`) inside its last user message (`Hint`)
      teacher.score  the teacher's log-prob of each response token given that context (a
                     `Teacher`: the teacher service's client, the in-process `Teacher`, or, with
                     `distill.teacher: policy`, the generation backend that sampled: `PolicyTeacher`)
      -> each group's `teacher_log_probs`; the metrics distill/*

The learner turns them into advantages (ppo/distill.py): the per-token reverse KL, teacher minus
student, discount 0. The student never sees the hint: only the teacher's context holds it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

from ..common.types import SampleGroup, TeacherScores

if TYPE_CHECKING:
    from ..common.config import Config
    from ..common.types import PromptRecord

MARK = "\x00hint\x00"


class Hint:
    """`distill.hint` rendered for a record and put into a prompt's text: inside the last user
    message when the prompt ends as the tokenizer's chat template ends a user turn (before the
    assistant's generation prompt), else after the prompt, a space apart."""

    def __init__(self, template: str, tokenizer):
        self.template, self.tokenizer = template, tokenizer
        self.turn_end = _user_turn_end(tokenizer)

    def text(self, record: PromptRecord) -> str:
        """The hint for `record`: the template's {label} and {metadata fields} filled in."""
        fields = {k: v for k, v in record.metadata.items() if isinstance(k, str)}
        fields["label"] = "" if record.label is None else record.label
        try:
            return self.template.format_map(fields)
        except (KeyError, IndexError, ValueError) as e:
            raise ValueError(
                f"distill.hint {self.template!r}: record {record.id!r} cannot fill it ({type(e).__name__}: {e}); "
                f"it has label and {sorted(k for k in fields if k != 'label') or 'no metadata'}"
            ) from None

    def context(self, prompt_ids: Sequence[int], record: PromptRecord) -> list[int]:
        """The teacher's context: the prompt's tokens decoded, the hint put in, tokenised again."""
        text = self.tokenizer.decode(list(prompt_ids), skip_special_tokens=False)
        hint = self.text(record)
        if self.turn_end and text.endswith(self.turn_end):
            text = f"{text[: -len(self.turn_end)]}\n\n{hint}{self.turn_end}"
        else:
            text = f"{text} {hint}"
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]


def _user_turn_end(tokenizer) -> str | None:
    """What the chat template writes after a user message's content when it asks for the
    assistant's reply (e.g. "<|im_end|>\\n<|im_start|>assistant\\n"); None without a template."""
    if not getattr(tokenizer, "chat_template", None):
        return None
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": MARK}], tokenize=False, add_generation_prompt=True
    )
    _, found, after = rendered.rpartition(MARK)
    return after if found and after else None


@dataclass
class PolicyTeacher:
    """The current policy as the teacher (`distill.teacher: policy`): the generation backend that
    sampled the batch scores the tokens (the hf backend in the process, a server's ScoreTokens),
    under the version it serves. No top-k."""

    backend: Any

    def score(
        self, prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]], top_k: int = 0
    ) -> TeacherScores:
        sequences = [list(p) + list(r) for p, r in zip(prompts, responses)]
        return TeacherScores(self.backend.score(sequences, [len(p) for p in prompts]).log_probs)


@dataclass
class Distillation:
    """The teacher's reading of each sampled token (the module docstring). `teacher` None: the
    policy that sampled (`PolicyTeacher` of the backend `read` is given)."""

    teacher: Any
    tokenizer: Any
    hint: Hint | None = None
    top_k: int = 0
    keep_top: bool = False  # each token's top-k kept in the groups (the top-k forward KL's loss reads them)

    @classmethod
    def for_training(cls, cfg: Config, tokenizer, teacher) -> Distillation | None:
        """The config's (None when `distill.enabled` is false); `teacher`: the teacher service's
        client or the in-process teacher (ignored with `distill.teacher: policy`)."""
        d = cfg.distill
        if not d.enabled:
            return None
        hint = Hint(d.hint, tokenizer) if d.hint else None
        return cls(None if d.teacher == "policy" else teacher, tokenizer, hint, d.top_k, d.forward_kl_coef > 0)

    def read(self, groups: list[SampleGroup], backend=None) -> dict[str, float]:
        """Each group's `teacher_log_probs`, one list per sample (and, with `keep_top`, its
        `teacher_top_ids` / `teacher_top_log_probs`); the metrics distill/*."""
        t0 = time.perf_counter()
        teacher = self.teacher if self.teacher is not None else PolicyTeacher(backend)
        contexts, responses, sampler = [], [], []
        for g in groups:
            context = self.hint.context(g.prompt_ids, g.record) if self.hint else g.prompt_ids
            for c in g.completions:
                contexts.append(context)
                responses.append(c.token_ids)
                sampler.append(c.log_probs)
        scores = teacher.score(contexts, responses, self.top_k)
        k = 0
        for g in groups:
            g.teacher_log_probs = scores.log_probs[k : k + len(g.completions)]
            if self.keep_top and scores.top_ids is not None and scores.top_log_probs is not None:
                g.teacher_top_ids = scores.top_ids[k : k + len(g.completions)]
                g.teacher_top_log_probs = scores.top_log_probs[k : k + len(g.completions)]
            k += len(g.completions)
        return {"time/teacher_s": time.perf_counter() - t0, **sampled_metrics(groups, sampler, scores)}


def sampled_metrics(groups: list[SampleGroup], sampler: list[list[float]], scores: TeacherScores) -> dict[str, float]:
    """distill/reverse_kl_sampler: the mean over trained tokens of log mu - log teacher (the
    sampler's log-probs: KL(student || teacher) estimated on the student's own samples);
    distill/teacher_top1_agree (with top-k): the share of sampled tokens the teacher ranks first."""
    masks = [c.loss_mask or [1] * len(c.token_ids) for g in groups for c in g.completions]
    tokens = [c.token_ids for g in groups for c in g.completions]
    n = sum(sum(m) for m in masks)
    if not n:
        return {}
    kl = sum(m * (s - t) for ms, ss, ts in zip(masks, sampler, scores.log_probs) for m, s, t in zip(ms, ss, ts))
    out = {"distill/reverse_kl_sampler": kl / n}
    if scores.top_ids is not None:
        agree = sum(
            m * (len(top) > 0 and top[0] == tok)
            for ms, toks, tops in zip(masks, tokens, scores.top_ids)
            for m, tok, top in zip(ms, toks, tops)
        )
        out["distill/teacher_top1_agree"] = agree / n
    return out
