"""How a session of an agent ends when it has no reward: what the worker does with its prompt.
host.py (`AgentHost`) and the adapters that drive your environment or service for it (host.py's
own, openenv.py) raise these; the rollout workers and the evals read them."""


class AgentFailed(ValueError):
    """The agent of a session failed in a way that is its input's (or its code's): the prompt
    is dead-lettered with this message."""


class Unscored(AgentFailed):
    """The session's reward could not be had (none, or not a finite number): a dead letter in
    training, never a reward of 0; an eval row counts it as a failure and marks it `unscored`."""


class Outage(RuntimeError):
    """The session found no generation server: not its input; the prompt stays pending."""


class AgentServiceDown(Outage):
    """The agent service (`rollout.agent_url`) or the environment server (an OpenEnv URL in
    `rollout.environment`) did not answer: the prompt stays pending, and no generation server is
    to blame."""
