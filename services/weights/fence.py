"""The fence of a distributed run: a version (pushed, pulled or shared) is taken only from the
run's learner, as the replay registry names it (its run id, epoch and version counter)."""

from __future__ import annotations

import redis

from ..common.replay import ReplayStore
from ..common.rpc.errors import BadRequest, Unavailable
from ..common.rpc.gen import common_pb2


class LearnerFence:
    """The generation server's check of a weight push's (or pull's) header in a distributed run:
    it comes from the run's learner (run_id and epoch as the learner published them in the replay
    registry) and its version is not above the registry's version counter (the learner raises it
    before each push). Anything else is refused with `BadRequest`; a registry that cannot be
    reached gives `Unavailable`."""

    def __init__(self, store: ReplayStore):
        self.store = store

    def __call__(self, header: common_pb2.WeightHeader) -> None:
        try:
            info = self.store.learner_info()
            counter = self.store.version()
        except (redis.RedisError, OSError) as e:
            raise Unavailable(
                f"weights: the replay registry cannot be reached to check the push's writer: {e}"
            ) from None
        writer = f"run_id={header.run_id!r}, epoch={header.epoch}"
        if not info:
            raise BadRequest(
                f"weights: push from a writer that is not the run's learner ({writer}): no learner "
                f"has registered in the replay namespace {self.store.ns!r}"
            )
        run_id, epoch = info.get("run_id", ""), int(info.get("epoch") or 0)
        if header.run_id != run_id or int(header.epoch) != epoch:
            raise BadRequest(
                f"weights: push from a writer that is not the run's learner ({writer}; the learner "
                f"registered in {self.store.ns!r} has run_id={run_id!r}, epoch={epoch})"
            )
        if header.version > counter:
            raise BadRequest(
                f"weights: push from a writer that is not the run's learner: version {header.version} "
                f"is above the run's version counter {counter}"
            )
