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
from ..common.modeling import last_logits_kwargs, response_log_probs
from ..common.padding import pad_left
from ..common.token_batch import TokenBatch, build_token_batch
from ..common.types import TeacherScores

if TYPE_CHECKING:
    from ..common.config import Config

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


class Teacher:
    def __init__(
        self,
        model_path: str,
        device: str = "auto",
        dtype: str = "float32",
        micro_batch_size: int = 16,
        share_prompts: bool = True,
    ):
        """The model at `model_path` in `dtype` on `device`, in eval mode and without gradients;
        `micro_batch_size` sequences go through each forward; with `share_prompts` the responses
        to one prompt share its forward."""
        self.path, self.dtype, self.micro_batch_size = str(model_path), dtype, micro_batch_size
        self.share_prompts = share_prompts
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
            share_prompts=cfg.distill.share_prompts,
        )

    def score(
        self, prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]], top_k: int = 0
    ) -> TeacherScores:
        """The teacher's log-prob (temperature 1) of each token of `responses[i]` given `prompts[i]`
        and the tokens before it; with `top_k`, each position's k most likely tokens too. An empty
        response gets empty lists. Responses to one prompt (a group's samples) share one forward
        of the prompt (`_shared`, its keys and values reused for each of them); the rest go through
        the model `micro_batch_size` at a time, similar lengths together (less padding)."""
        n = len(prompts)
        out = _Scores(n, top_k)
        groups: dict[tuple[int, ...], list[int]] = {}
        for i in range(n):
            if responses[i]:
                groups.setdefault(tuple(prompts[i]), []).append(i)
        shared = {p: rows for p, rows in groups.items() if self.share_prompts and len(rows) > 1 and len(p) > 1}
        alone = sorted(
            (i for p, rows in groups.items() if p not in shared for i in rows),
            key=lambda i: len(prompts[i]) + len(responses[i]),
        )
        for start in range(0, len(alone), self.micro_batch_size):
            rows = alone[start : start + self.micro_batch_size]
            out.put(rows, responses, self._forward([prompts[i] for i in rows], [responses[i] for i in rows], top_k))
        for piece in self._pieces(shared):
            rows = [i for _, part in piece for i in part]
            out.put(rows, responses, self._shared(piece, [responses[i] for i in rows], top_k))
        return out.scores()

    @torch.no_grad()
    def _forward(self, prompts: list[Sequence[int]], responses: list[Sequence[int]], top_k: int) -> dict:
        """One forward of a micro-batch (`[left-padded prompt | right-padded response]`): its
        `response_log_probs` in float32 on the CPU."""
        batch = build_token_batch(prompts, responses, self.pad_id).to(self.device)
        return _cpu(response_log_probs(self.model, batch, top_k=top_k))

    def _pieces(self, shared: dict[tuple[int, ...], list[int]]) -> list[list[tuple[tuple[int, ...], list[int]]]]:
        """The shared prompts' rows in pieces of at most `micro_batch_size` responses, each piece a
        list of (prompt, its rows in the piece)."""
        pieces: list[list[tuple[tuple[int, ...], list[int]]]] = [[]]
        size = 0
        for prompt, rows in shared.items():
            for s in range(0, len(rows), self.micro_batch_size):
                part = rows[s : s + self.micro_batch_size]
                if size + len(part) > self.micro_batch_size and pieces[-1]:
                    pieces.append([])
                    size = 0
                pieces[-1].append((prompt, part))
                size += len(part)
        return [p for p in pieces if p]

    @torch.no_grad()
    def _shared(self, piece: list[tuple[tuple[int, ...], list[int]]], responses: list[Sequence[int]], top_k: int):
        """A piece's prompts but their last token in one forward (left-padded), its cache then
        selected per response: each response row reads `[last prompt token | response]` over its
        prompt's cached keys and values, positions going on from the prompt's."""
        prompts = [list(p) for p, _ in piece]
        prefix_ids, prefix_attn = pad_left([p[:-1] for p in prompts], self.pad_id)
        cache = self.model(
            input_ids=prefix_ids.to(self.device),
            attention_mask=prefix_attn.to(self.device),
            position_ids=(prefix_attn.cumsum(-1) - 1).clamp(min=0).to(self.device),
            use_cache=True,
            **last_logits_kwargs(self.model),
        ).past_key_values
        owner = torch.tensor([g for g, (_, rows) in enumerate(piece) for _ in rows])
        cache.batch_select_indices(owner.to(self.device))
        rows = build_token_batch([[prompts[g][-1]] for g in owner.tolist()], responses, self.pad_id)
        batch = TokenBatch(
            rows.input_ids,
            torch.cat([prefix_attn[owner], rows.attention_mask], dim=1),
            rows.position_ids + torch.tensor([len(prompts[g]) - 1 for g in owner.tolist()])[:, None],
            rows.response_mask,
            1,
        ).to(self.device)
        return _cpu(response_log_probs(self.model, batch, top_k=top_k, past_key_values=cache))

    def tokenizer_fingerprint(self) -> str:
        return tokenizer_fingerprint(self.tokenizer)


def _cpu(out: dict) -> dict:
    return {k: v.float().cpu() if v.is_floating_point() else v.cpu() for k, v in out.items()}


class _Scores:
    """Each response's scores as its forward's rows come back, in the order of the request."""

    def __init__(self, n: int, top_k: int):
        self.top_k = top_k
        self.log_probs: list[list[float]] = [[] for _ in range(n)]
        self.top_ids: list[list[list[int]]] = [[] for _ in range(n)]
        self.top_log_probs: list[list[list[float]]] = [[] for _ in range(n)]

    def put(self, rows: list[int], responses: Sequence[Sequence[int]], out: dict) -> None:
        for j, i in enumerate(rows):
            t = len(responses[i])
            self.log_probs[i] = out["log_probs"][j, :t].tolist()
            if self.top_k:
                self.top_ids[i] = out["top_ids"][j, :t].tolist()
                self.top_log_probs[i] = out["top_log_probs"][j, :t].tolist()

    def scores(self) -> TeacherScores:
        if not self.top_k:
            return TeacherScores(self.log_probs)
        return TeacherScores(self.log_probs, self.top_ids, self.top_log_probs)


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
