"""The policy version counter and the learner's fence: versions only go up; each learner process
takes an epoch above every earlier one's, and publishes its address, newest policy version and identity
(run id, epoch), so generation servers accept weight pushes only from the current writer.

Keys, under the run's namespace `ns`:

    ns:version       int                       the newest policy version (only goes up)
    ns:learner_epoch int                       the newest learner process's epoch
    ns:learner       hash                      the learner's address, policy_version, run id and epoch
"""

from __future__ import annotations

from typing import cast

import redis

from .connection import RedisPart, says_where_everywhere


class VersionFence(RedisPart):
    def __init__(self, client: redis.Redis, namespace: str = "rlhf"):
        super().__init__(client, namespace)
        self._setup_fence()

    def _setup_fence(self) -> None:
        self.version_key, self.learner_key = f"{self.ns}:version", f"{self.ns}:learner"

    def version(self) -> int:
        return int(self.r.get(self.version_key) or 0)

    def next_version(self) -> int:
        return int(self.r.incr(self.version_key))

    def raise_version_to(self, policy_version: int) -> None:
        """Make the version counter at least `policy_version` (it never goes down)."""
        self.r.set(self.version_key, max(policy_version, self.version()))

    def new_learner_epoch(self) -> int:
        """A learner process starts: its epoch, above every earlier one's (the fencing token its
        weight pushes carry)."""
        return int(self.r.incr(f"{self.ns}:learner_epoch"))

    def publish_learner(self, address: str, policy_version: int, run_id: str = "", epoch: int = 0) -> None:
        """The learner's address, its newest published policy version and its identity (run id,
        epoch): generation servers accept weight pushes only from this writer."""
        self.r.hset(
            self.learner_key,
            mapping={
                "address": address,
                "policy_version": policy_version,
                "run_id": run_id,
                "epoch": epoch,
                "ts": self.now(),
            },
        )

    def learner_info(self) -> dict:
        """{address, policy_version, run_id, epoch, ts} as strings; {} before a learner published."""
        raw = cast("dict[bytes, bytes]", self.r.hgetall(self.learner_key))  # the client decodes no replies
        return {k.decode(): v.decode() for k, v in raw.items()}


says_where_everywhere(VersionFence)
