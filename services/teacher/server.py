"""The teacher server of on-policy distillation: Score (the teacher's log-prob of each sampled
token, and its top-k when asked) and Info. At start it refuses a teacher whose tokenizer differs
from the policy's (model.path's).

    rlhf serve teacher -c configs/tiny-cpu.yaml
"""

from __future__ import annotations

import logging
import time
import uuid
from typing import TYPE_CHECKING

from ..common.compute import ComputeThread
from ..common.lifecycle import GrpcService
from ..common.model_files import load_tokenizer
from ..common.rpc.errors import BadRequest
from ..common.rpc.gen import teacher_pb2 as tpb
from ..common.rpc.gen import teacher_pb2_grpc
from ..common.rpc.server import RPCServer, batch_size_histogram
from ..common.types import TeacherScores
from .teacher import Teacher, check_tokenizers

if TYPE_CHECKING:
    from ..common.config import Config

log = logging.getLogger(__name__)

MAX_TOP_K = 64  # distill.top_k's bound
# a teacher's context may be longer than the student's prompt: distill.hint adds a sentence to it
PROMPT_FACTOR = 2
# bytes an answer takes per response token: its log-prob (4), and per top-k entry an id (a varint,
# at most 5) and a log-prob (4); and per sequence, the message's own framing (at most)
TOKEN_BYTES, TOP_BYTES, SEQUENCE_BYTES = 4, 9, 16


class TeacherServicer(teacher_pb2_grpc.TeacherServicer):
    def __init__(self, teacher: Teacher, cfg: Config, batch_size=None):
        """`batch_size`: the `rlhf_batch_size` child that counts sequences per call (None = not counted)."""
        self.teacher, self.cfg, self.batch_size = teacher, cfg, batch_size
        self.compute = ComputeThread("teacher")  # one forward at a time, in order
        self.fingerprint = teacher.tokenizer_fingerprint()
        self.incarnation, self.started_at = uuid.uuid4().hex, time.time()

    def Score(self, request, context):
        prompts, responses, top_k = read_request(request, self.teacher.vocab_size, self.cfg)
        if self.batch_size is not None:
            self.batch_size.observe(len(prompts))
        scores = self.compute.run(self.teacher.score, prompts, responses, top_k)
        return score_response(scores, top_k)

    def Info(self, request, context):
        return tpb.TeacherInfo(
            model_path=self.teacher.path,
            vocab_size=self.teacher.vocab_size,
            dtype=self.teacher.dtype,
            tokenizer_fingerprint=self.fingerprint,
            incarnation=self.incarnation,
            started_at=self.started_at,
        )


def read_request(request: tpb.TeacherScoreRequest, vocab_size: int, cfg: Config):
    """A Score request's prompts, responses and top_k, checked: 1 to rpc.max_prompts_per_request
    sequences, top_k in [0, 64] (and at most the vocabulary), each prompt 1 to 2 x prompt_length
    tokens (a hint lengthens the teacher's context), each response at most response_length tokens
    (none: nothing to score), every id in [0, vocab_size), at most rpc.max_request_tokens token
    positions in all, and an answer that fits in rpc.max_message_mb. Anything else: `BadRequest`."""
    seqs, top_k = request.sequences, request.top_k
    if not seqs:
        raise BadRequest("sequences: empty batch (0 sequences)", field="sequences")
    most = cfg.rpc.max_prompts_per_request
    if len(seqs) > most:
        raise BadRequest(
            f"sequences: {len(seqs)} sequences, more than rpc.max_prompts_per_request={most}", field="sequences"
        )
    if not 0 <= top_k <= min(MAX_TOP_K, vocab_size):
        raise BadRequest(f"top_k: {top_k}, expected in [0, {min(MAX_TOP_K, vocab_size)}]", field="top_k")
    total = sum(len(q.prompt_ids) + len(q.response_ids) for q in seqs)
    if total > cfg.rpc.max_request_tokens:
        raise BadRequest(
            f"sequences: {total} token positions, more than rpc.max_request_tokens={cfg.rpc.max_request_tokens}; "
            "send fewer or shorter sequences per request",
            field="sequences",
        )
    _check_answer_size(seqs, top_k, cfg.rpc.max_message_mb)
    prompts, responses = [], []
    for i, q in enumerate(seqs):
        prompts.append(
            _ids(q.prompt_ids, f"sequences[{i}].prompt_ids", 1, PROMPT_FACTOR * cfg.prompt_length, vocab_size)
        )
        responses.append(_ids(q.response_ids, f"sequences[{i}].response_ids", 0, cfg.response_length, vocab_size))
    return prompts, responses, top_k


def _ids(ids, field: str, least: int, most: int, vocab_size: int) -> list[int]:
    """`ids` as a list, `least` to `most` of them, each in [0, vocab_size)."""
    if not least <= len(ids) <= most:
        raise BadRequest(f"{field}: {len(ids)} tokens, expected {least} to {most}", field=field)
    if ids and (min(ids) < 0 or max(ids) >= vocab_size):
        bad = next(t for t in ids if not 0 <= t < vocab_size)
        raise BadRequest(f"{field}: token id {bad} outside the vocabulary [0, {vocab_size})", field=field)
    return list(ids)


def _check_answer_size(seqs, top_k: int, max_message_mb: int) -> None:
    """The answer to `seqs` must fit in one message (rpc.max_message_mb): a top-k answer is k
    times larger than the request."""
    tokens = sum(len(q.response_ids) for q in seqs)
    size = tokens * (TOKEN_BYTES + top_k * TOP_BYTES) + len(seqs) * SEQUENCE_BYTES
    if size > max_message_mb << 20:
        raise BadRequest(
            f"sequences: the answer ({tokens} response tokens, top_k={top_k}) would take up to {size / 2**20:.1f} MiB, "
            f"more than rpc.max_message_mb={max_message_mb}; send fewer sequences per request or a smaller top_k",
            field="sequences",
        )


def score_response(scores: TeacherScores, top_k: int) -> tpb.TeacherScoreResponse:
    """The answer: per sequence its log-probs and, with top_k, its top ids and log-probs flattened (T x k)."""
    results = []
    for i, lp in enumerate(scores.log_probs):
        r = tpb.TeacherTokenScores(log_probs=lp)
        if top_k and scores.top_ids is not None and scores.top_log_probs is not None:
            r.top_ids.extend(t for row in scores.top_ids[i] for t in row)
            r.top_log_probs.extend(v for row in scores.top_log_probs[i] for v in row)
        results.append(r)
    return tpb.TeacherScoreResponse(results=results, top_k=top_k)


def serve(cfg: Config, teacher: Teacher | None = None) -> GrpcService:
    """The teacher service: checks the teacher's tokenizer against the policy's (model.path's) and
    refuses to start when they differ (`check_tokenizers`' sentence), loads the teacher `distill`
    describes (or uses `teacher`), then binds `rpc.teacher`'s ports and serves gRPC."""

    def build():
        t = _checked_teacher(cfg, teacher)
        ep = cfg.rpc.teacher
        server = RPCServer("teacher", cfg.rpc, ep.port, ep.metrics_port, host=ep.host)
        servicer = TeacherServicer(t, cfg, batch_size_histogram(server.metrics, "sequences"))
        teacher_pb2_grpc.add_TeacherServicer_to_server(servicer, server.grpc)
        server.start()
        server.set_ready(True)
        return server, servicer, [servicer.compute.close]

    return GrpcService("teacher", build)


def _checked_teacher(cfg: Config, teacher: Teacher | None) -> Teacher:
    """`teacher`, or the one `distill` describes, its tokenizer compared with the policy's before
    any weights load (a ValueError saying where they differ)."""
    path = teacher.path if teacher is not None else (cfg.distill.teacher_path or cfg.model.path)
    if not cfg.distill.needs_server:
        log.info(
            "distill.enabled=%s, distill.teacher=%s: no run of this config asks this server; serving %s anyway",
            cfg.distill.enabled,
            cfg.distill.teacher,
            path,
        )
    teacher_tok = teacher.tokenizer if teacher is not None else load_tokenizer(path)
    check_tokenizers(teacher_tok, load_tokenizer(cfg.model.path), path, cfg.model.path)
    return teacher if teacher is not None else Teacher.from_config(cfg)
