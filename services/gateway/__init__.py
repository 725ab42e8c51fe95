"""The gateway: an OpenAI-compatible endpoint for agents in front of the generation servers, with
token-exact sessions (sessions.py: what the policy saw and sampled, turn by turn), the HTTP API
(app.py) and the service (server.py: `rlhf serve gateway`)."""
