"""The Redis replay buffer shared by the learner, rollout workers and generation servers."""
from .store import ReplayStore, connect  # noqa: F401
