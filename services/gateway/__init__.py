"""The gateway service (`rlhf serve gateway`, server.py): the agents' OpenAI-compatible endpoint
(services/agents/: protocol, handler, routes) composed with the generation servers it samples on
and its metrics (metrics.py). It holds the sessions, so a session outlives the generation server
it was on."""
