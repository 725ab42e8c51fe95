"""gRPC client of the teacher server with the in-process `Teacher`'s interface (the `Teacher`
protocol of common/types.py)."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Sequence

from ..common.rpc.client import RPCClient, endpoint_address
from ..common.rpc.gen import teacher_pb2 as tpb
from ..common.rpc.gen import teacher_pb2_grpc
from ..common.rpc.retry import RideThrough, Tagged
from ..common.types import TeacherScores

if TYPE_CHECKING:
    from ..common.config import Config


class TeacherClient(RPCClient):
    stub_class = teacher_pb2_grpc.TeacherStub

    def score(
        self, prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]], top_k: int = 0
    ) -> TeacherScores:
        """The teacher's log-prob of each token of `responses[i]` given `prompts[i]` and the
        tokens before it; with `top_k`, each position's k most likely tokens and their log-probs."""
        req = tpb.TeacherScoreRequest(
            sequences=[
                tpb.TeacherSequence(prompt_ids=list(p), response_ids=list(r)) for p, r in zip(prompts, responses)
            ],
            top_k=top_k,
        )
        resp = self.stub.Score(req, timeout=self.timeout, metadata=self.metadata)
        return scores_from_proto(resp)

    def info(self) -> tpb.TeacherInfo:
        """Model path, vocabulary size, dtype, tokenizer fingerprint, incarnation and start time."""
        return self.stub.Info(tpb.TeacherInfoRequest(), timeout=self.timeout, metadata=self.metadata)


def scores_from_proto(resp: tpb.TeacherScoreResponse) -> TeacherScores:
    """A Score answer as `TeacherScores`: each result's flat top-k lists cut back into rows of k."""
    log_probs = [list(r.log_probs) for r in resp.results]
    k = resp.top_k
    if not k:
        return TeacherScores(log_probs)
    top_ids = [[list(r.top_ids[t : t + k]) for t in range(0, len(r.top_ids), k)] for r in resp.results]
    top_lps = [[list(r.top_log_probs[t : t + k]) for t in range(0, len(r.top_log_probs), k)] for r in resp.results]
    return TeacherScores(log_probs, top_ids, top_lps)


def teacher_client(cfg: Config, stop_event: threading.Event, on_wait) -> TeacherClient:
    """The teacher server's client (rpc.teacher): its errors tagged "teacher", the server waited
    for while it is unavailable."""
    teacher_at = endpoint_address(cfg.rpc.teacher)
    ride = RideThrough("teacher server", teacher_at, cfg.rpc, stop_event, on_wait=on_wait)
    return TeacherClient(teacher_at, cfg.rpc, interceptors=[Tagged("teacher"), ride])
