"""A generation server in a distributed run: it registers itself in Redis with a heartbeat (so
the learner pushes every new policy to it and rollout workers send it prompts), and it pulls the
current policy from the learner when it starts late or finds it missed a push.
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING

import grpc

from ..common.replay import ReplayStore
from ..common.rpc.errors import Unavailable

if TYPE_CHECKING:
    from ..common.config import Config

log = logging.getLogger(__name__)


class Registration:
    def __init__(self, cfg: Config, servicer, address: str, store: ReplayStore):
        self.cfg, self.servicer, self.address, self.store = cfg, servicer, address, store
        self.backend = servicer.backend
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._behind_since: int | None = None  # learner version we first saw ourselves behind

    def sync(self) -> bool:
        """Pull the learner's policy if it is newer than ours (`WeightReceiver.pull`). True if
        weights were applied."""
        info = self.store.learner_info()
        if not info or int(info.get("policy_version", 0)) <= self.backend.policy_version:
            return False
        from ..weights.pull import LearnerClient

        client = LearnerClient(info["address"], self.cfg.rpc)
        try:
            return self.servicer.receiver.pull(
                lambda: client.pull_weights(self.backend.policy_version),
                info["address"],
                client.timeout,
                info.get("policy_version"),
            )
        finally:
            client.close()

    def heartbeat(self) -> None:
        """The registry entry: policy_version, and what the learner plans each push by (`registry_info`:
        the shared-memory probe, where the weights come from, partial pushes or not, and with
        rpc.delta_push the version a delta may be against: none in a new process)."""
        self.store.heartbeat(
            "generation", self.address, policy_version=self.backend.policy_version, **self.servicer.registry_info()
        )

    def start(self) -> "Registration":
        try:
            self.sync()
        except (grpc.RpcError, OSError, Unavailable) as e:
            log.warning("could not pull the current policy from the learner yet: %s", e)
        self.heartbeat()
        self._thread = threading.Thread(target=self._loop, name="registration", daemon=True)
        self._thread.start()
        log.info(
            "registered %s in the replay namespace %r at policy version %d",
            self.address,
            self.store.ns,
            self.backend.policy_version,
        )
        return self

    def _loop(self) -> None:
        while not self._stop.wait(self.cfg.replay.heartbeat_s):
            try:
                self.heartbeat()
                learner_version = int(self.store.learner_info().get("policy_version", 0))
                if learner_version > self.backend.policy_version:
                    # behind on two heartbeats in a row for the same version: the push missed us
                    if self._behind_since == learner_version:
                        self.sync()
                        self._behind_since = None
                    else:
                        self._behind_since = learner_version
                else:
                    self._behind_since = None
            except Exception as e:  # Redis or the learner restarting; keep serving
                log.warning("registration: %s", e)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        try:
            self.store.deregister("generation", self.address)
        except Exception as e:  # Redis gone at shutdown: the entry expires with its heartbeat's TTL
            log.info("could not deregister %s (%s); its registry entry expires on its own", self.address, e)
