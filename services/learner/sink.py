"""The learner service's weight sink (`PushSink`): the one place its policy versions are
numbered, and the fencing identity (run id, epoch) every push carries; after a push, when due,
the push parity check (parity.py: does every server serve what was pushed?)."""

from __future__ import annotations

from ..common.replay import ReplayStore
from ..weights.publisher import Publisher
from .parity import PushParity


class PushSink:
    """The weight sink of the learner service, and the one place its policy versions are
    numbered: from the replay store's counter, so that they only go forward across learner
    restarts and above anything a server serves. Each new policy is pushed to every live
    generation server and published in the registry, with `address` (where servers pull from:
    set by the server before the run starts). `run_id` and `fence_epoch` (this process's, from
    `fence()` at the start) are the identity the generation servers' fence checks. `parity`, when
    given, checks the servers a push went to (`rpc.push_parity`), its metrics into the push's."""

    def __init__(self, store: ReplayStore, publisher: Publisher, run_id: str, parity: PushParity | None = None):
        self.store, self.publisher, self.parity = store, publisher, parity
        self.address = ""
        self.run_id, self.fence_epoch = run_id, 0

    def fence(self) -> None:
        """A new learner epoch from Redis: pushes of an older learner process of the run are refused."""
        self.fence_epoch = self.store.new_learner_epoch()
        self.publisher.identity = (self.run_id, self.fence_epoch)

    def next_version(self) -> int:
        return self.store.next_version()

    def publish(self, learner) -> tuple[int, dict]:
        policy_version = self.next_version()
        metrics = self.publisher.push(policy_version, self.address)
        if self.parity is not None and self.parity.due():
            metrics.update(self.parity.check(learner, policy_version, self.publisher.pushed_to))
        return policy_version, metrics

    def publish_current(self, policy_version: int) -> None:
        """At the start: the policy the learner holds (version 0, the initial weights every server
        loads, is only published; a restored one is pushed)."""
        if policy_version > 0:
            self.store.publish_learner(self.address, policy_version, *self.publisher.identity)
            self.publisher.push(policy_version, self.address)
        else:
            self.publisher.publish_initial(self.address)
