"""Agent sessions as a library: token-exact sessions (sessions.py: the chat template applied once,
each turn's prompt built from the session's own tokens), tool calls (tools.py), the OpenAI
endpoint the user's agents run against (protocol.py, handler.py, turns.py, routes.py), the agents'
host (host.py: `AgentHost`, that endpoint on a loopback port), the adapters of each environment
kind (gym_env.py, openenv.py, verifiers_env.py: common/environments.py's registry names them) and
the held-out eval of an agent (evaluate.py). The rollout workers, the learner's eval, `rlhf eval`
and `train --local` sample agents through here; `services/gateway/` serves the same endpoint as a
service of its own."""
