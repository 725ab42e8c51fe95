"""What an agent may return as a session's reward besides a float: the reward with its parts."""

from __future__ import annotations


class Reward(float):
    """A session's reward with its parts by name (a verifiers rubric's per-function scores, say):
    what an agent may return instead of a float. Each part is a score component of the session's
    sample (`reward/<name>` in the metrics, `eval/<name>` in an eval) beside `agent`, the reward
    itself (host.py: AgentHost)."""

    components: dict[str, float]

    def __new__(cls, value: float, components: dict[str, float]):
        reward = super().__new__(cls, value)
        reward.components = dict(components)
        return reward
