"""Replay records <-> domain objects: PromptTask <-> PromptRecord, TrajectoryGroup <-> SampleGroup.
Per-token numbers travel as raw little-endian float32 bytes."""

from __future__ import annotations

import json
import time

import numpy as np

from ..rpc.gen import replay_pb2 as rpb
from ..types import Completion, PromptRecord, SampleGroup, ScoreResult

_F32 = np.dtype("<f4")
_I32 = np.dtype("<i4")
MAX_TOP_K = 64  # distill.top_k's bound


def make_task(
    record: PromptRecord, epoch: int, policy_version: int, min_version: int, group_size: int, attempt: int = 0
) -> rpb.PromptTask:
    t = rpb.PromptTask(
        uid=f"{epoch}:{record.id}",
        attempt=attempt,
        record_id=record.id,
        epoch=epoch,
        prompt=record.prompt,
        metadata_json=json.dumps(record.metadata) if record.metadata else "",
        min_version=min_version,
        group_size=group_size,
        fed_at_version=policy_version,
    )
    if record.label is not None:
        t.label = record.label
    return t


def task_record(task: rpb.PromptTask) -> PromptRecord:
    return PromptRecord(
        task.record_id,
        task.prompt,
        task.label if task.HasField("label") else None,
        json.loads(task.metadata_json) if task.metadata_json else {},
    )


def group_to_proto(
    g: SampleGroup,
    task: rpb.PromptTask,
    worker: str = "",
    server: str = "",
    generate_seconds: float = 0.0,
    batch_tokens: int = 0,
) -> rpb.TrajectoryGroup:
    out = rpb.TrajectoryGroup(
        task=task,
        prompt_ids=g.prompt_ids,
        policy_version=g.policy_version,
        worker=worker,
        generation_server=server,
        created_at=time.time(),
        generate_seconds=generate_seconds,
        tokens=sum(len(c.token_ids) for c in g.completions),
        batch_tokens=batch_tokens,
    )
    for j, c in enumerate(g.completions):
        s = out.samples.add(
            response_ids=c.token_ids,
            log_probs=np.asarray(c.log_probs, _F32).tobytes(),
            score=g.scores[j].reward,
            finish_reason=c.finish_reason,
        )
        s.components.update(g.scores[j].components)
        if c.loss_mask is not None:
            s.loss_mask = np.asarray(c.loss_mask, np.uint8).tobytes()
        if c.token_versions is not None:
            s.token_versions.extend(c.token_versions)
        if g.values is not None:
            s.values = np.asarray(g.values[j], _F32).tobytes()
        if g.teacher_log_probs is not None:
            s.teacher_log_probs = np.asarray(g.teacher_log_probs[j], _F32).tobytes()
        if g.teacher_top_ids is not None and g.teacher_top_log_probs is not None:
            s.teacher_top_k = next((len(row) for sample in g.teacher_top_ids for row in sample), 0)
            s.teacher_top_ids = np.asarray(g.teacher_top_ids[j], _I32).tobytes()
            s.teacher_top_log_probs = np.asarray(g.teacher_top_log_probs[j], _F32).tobytes()
    return out


def group_from_proto(m: rpb.TrajectoryGroup) -> SampleGroup:
    completions, scores, values, teacher, top_ids, top_lps = [], [], [], [], [], []
    for s in m.samples:
        ids = list(s.response_ids)
        lp = np.frombuffer(s.log_probs, _F32)
        if len(lp) != len(ids):
            raise ValueError(f"trajectory {m.task.uid}: {len(lp)} log-probs for {len(ids)} tokens")
        mask = np.frombuffer(s.loss_mask, np.uint8).tolist() if s.loss_mask else None
        if mask is not None and (len(mask) != len(ids) or not set(mask) <= {0, 1}):
            raise ValueError(f"trajectory {m.task.uid}: a loss mask of {len(mask)} 0/1 entries for {len(ids)} tokens")
        versions = list(s.token_versions) or None
        if versions is not None and (len(versions) != len(ids) or min(versions) < m.policy_version):
            raise ValueError(
                f"trajectory {m.task.uid}: {len(versions)} token versions for {len(ids)} tokens, or one older "
                f"than the group's policy_version {m.policy_version}"
            )
        completions.append(Completion(ids, lp.tolist(), s.finish_reason, mask, versions))
        scores.append(ScoreResult(s.score, dict(s.components)))
        if s.values:
            values.append(per_token(s.values, len(ids), "values", m.task.uid))
        if s.teacher_log_probs:
            teacher.append(per_token(s.teacher_log_probs, len(ids), "teacher log-probs", m.task.uid))
        if s.teacher_top_k or s.teacher_top_ids or s.teacher_top_log_probs:
            i, lp_k = teacher_top(s, len(ids), m.task.uid)
            top_ids.append(i)
            top_lps.append(lp_k)
    for what, got in (("values", values), ("teacher log-probs", teacher), ("teacher top-k", top_ids)):
        if got and len(got) != len(completions):
            raise ValueError(f"trajectory {m.task.uid}: {what} for only some samples")
    return SampleGroup(
        m.task.uid, task_record(m.task), list(m.prompt_ids), completions, scores, values or None,
        int(m.policy_version), teacher or None, top_ids or None, top_lps or None,
    )  # fmt: skip


def teacher_top(s: rpb.Sample, n_tokens: int, uid: str) -> tuple[list[list[int]], list[list[float]]]:
    """A sample's teacher top-k, checked: (T, k) ids, each at least 0, and (T, k) finite
    log-probs, k in [1, MAX_TOP_K]."""
    k = s.teacher_top_k
    ids, lps = np.frombuffer(s.teacher_top_ids, _I32), np.frombuffer(s.teacher_top_log_probs, _F32)
    if not 1 <= k <= MAX_TOP_K or len(ids) != n_tokens * k or len(lps) != n_tokens * k:
        raise ValueError(
            f"trajectory {uid}: a teacher top-k of k={k} (1..{MAX_TOP_K}) with {len(ids)} ids and {len(lps)} "
            f"log-probs for {n_tokens} tokens"
        )
    if (ids < 0).any() or not np.isfinite(lps).all():
        raise ValueError(f"trajectory {uid}: a teacher top-k id below 0 or a log-prob that is not finite")
    return ids.reshape(n_tokens, k).tolist(), lps.reshape(n_tokens, k).tolist()


def per_token(raw: bytes, n_tokens: int, what: str, uid: str) -> list[float]:
    """A sample's float32 per-token field, checked to hold one finite number per response token."""
    v = np.frombuffer(raw, _F32)
    if len(v) != n_tokens:
        raise ValueError(f"trajectory {uid}: {len(v)} {what} for {n_tokens} tokens")
    if not np.isfinite(v).all():
        raise ValueError(f"trajectory {uid}: a {what.removesuffix('s')} that is not finite")
    return v.tolist()
