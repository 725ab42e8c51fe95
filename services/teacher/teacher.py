"""The teacher of on-policy distillation: a frozen causal LM that reads the student's sampled
tokens and says how likely it finds each one (and, when asked, which k tokens it would have
picked). The teacher server and the in-process trainer both host this object.

The teacher scores the policy's token ids, so it must share the policy's tokenizer:
`check_tokenizers` refuses one whose vocabulary differs, in one sentence that says where.
"""

from __future__ import annotations

import hashlib
import json
from typing import TYPE_CHECKING, Sequence

import torch

from ..common.model_files import load_causal_lm, load_tokenizer, resolve_device
from ..common.modeling import response_log_probs
from ..common.token_batch import build_token_batch
from ..common.types import TeacherScores

if TYPE_CHECKING:
    from ..common.config import Config

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


class Teacher:
    def __init__(self, model_path: str, device: str = "auto", dtype: str = "float32", micro_batch_size: int = 16):
        """The model at `model_path` in `dtype` on `device`, in eval mode and without gradients;
        `micro_batch_size` sequences go through each forward."""
        self.path, self.dtype, self.micro_batch_size = str(model_path), dtype, micro_batch_size
        self.device = resolve_device(device)
        self.model = load_causal_lm(self.path, self.device, DTYPES[dtype]).eval().requires_grad_(False)
        self.tokenizer = load_tokenizer(self.path)
        self.vocab_size = int(self.model.config.vocab_size)
        pad = self.tokenizer.pad_token_id  # any id: padding is masked out
        self.pad_id = 0 if pad is None else int(pad)

    @classmethod
    def from_config(cls, cfg: Config) -> "Teacher":
        """The teacher `distill` describes: distill.teacher_path (else model.path, the frozen
        initial policy), in distill.dtype on model.device."""
        return cls(
            cfg.distill.teacher_path or cfg.model.path,
            device=cfg.model.device,
            dtype=cfg.distill.dtype,
            micro_batch_size=cfg.distill.micro_batch_size,
        )

    def score(
        self, prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]], top_k: int = 0
    ) -> TeacherScores:
        """The teacher's log-prob (temperature 1) of each token of `responses[i]` given `prompts[i]`
        and the tokens before it; with `top_k`, each position's k most likely tokens too. Sequences
        with something to score go through the model `micro_batch_size` at a time, similar lengths
        together (less padding); an empty response gets empty lists."""
        n = len(prompts)
        log_probs: list[list[float]] = [[] for _ in range(n)]
        top_ids: list[list[list[int]]] = [[] for _ in range(n)]
        top_log_probs: list[list[list[float]]] = [[] for _ in range(n)]
        scored = sorted((i for i in range(n) if responses[i]), key=lambda i: len(prompts[i]) + len(responses[i]))
        for start in range(0, len(scored), self.micro_batch_size):
            rows = scored[start : start + self.micro_batch_size]
            out = self._forward([prompts[i] for i in rows], [responses[i] for i in rows], top_k)
            for j, i in enumerate(rows):
                t = len(responses[i])
                log_probs[i] = out["log_probs"][j, :t].tolist()
                if top_k:
                    top_ids[i] = out["top_ids"][j, :t].tolist()
                    top_log_probs[i] = out["top_log_probs"][j, :t].tolist()
        if not top_k:
            return TeacherScores(log_probs)
        return TeacherScores(log_probs, top_ids, top_log_probs)

    @torch.no_grad()
    def _forward(self, prompts: list[Sequence[int]], responses: list[Sequence[int]], top_k: int) -> dict:
        """One forward of a micro-batch (`[left-padded prompt | right-padded response]`): its
        `response_log_probs` in float32 on the CPU."""
        batch = build_token_batch(prompts, responses, self.pad_id).to(self.device)
        out = response_log_probs(self.model, batch, top_k=top_k)
        return {k: v.float().cpu() if v.is_floating_point() else v.cpu() for k, v in out.items()}

    def tokenizer_fingerprint(self) -> str:
        return tokenizer_fingerprint(self.tokenizer)


def tokenizer_fingerprint(tokenizer) -> str:
    """sha256 of a tokenizer's vocabulary (token -> id, sorted) and its special tokens: two
    tokenizers with the same fingerprint turn text into the same ids."""
    h = hashlib.sha256()
    h.update(json.dumps(sorted(tokenizer.get_vocab().items()), ensure_ascii=False).encode())
    h.update(json.dumps(tokenizer.special_tokens_map, sort_keys=True, ensure_ascii=False).encode())
    return h.hexdigest()


def check_tokenizers(teacher_tok, student_tok, teacher_path: str, student_path: str) -> None:
    """Raise ValueError, in one sentence, when the teacher's vocabulary differs from the student's
    (the policy's): its size and the first token id that differs."""
    teacher, student = teacher_tok.get_vocab(), student_tok.get_vocab()
    if teacher == student:
        return
    by_id = [{i: t for t, i in v.items()} for v in (teacher, student)]
    first = min(i for i in set(by_id[0]) | set(by_id[1]) if by_id[0].get(i) != by_id[1].get(i))
    at = [repr(ids[first]) if first in ids else "no token" for ids in by_id]
    raise ValueError(
        f"the teacher's tokenizer ({teacher_path}, {len(teacher):,} tokens) differs from the policy's "
        f"({student_path}, {len(student):,} tokens), first at token id {first} ({at[0]} in the teacher's, {at[1]} "
        "in the policy's): the teacher scores the policy's token ids, so distill.teacher_path must share "
        "model.path's tokenizer"
    )
