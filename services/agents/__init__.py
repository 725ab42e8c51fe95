"""Agent sessions as a library: token-exact sessions (sessions.py: the chat template applied once,
each turn's prompt built from the session's own tokens), tool calls (tools.py), the user's agent
functions run against an OpenAI-compatible endpoint of their own (host.py: `AgentHost`, the
gateway's HTTP app on a loopback port) and the held-out eval of an agent (evaluate.py). The
rollout workers, the learner's eval, `rlhf eval` and `train --local` sample agents through here;
`services/gateway/` is the HTTP service alone."""
