"""A user's reward API, for the compose tests: its own container, the OpenRLHF protocol, the
standard library only.

    POST /get_reward  {"query": [prompt+response, ...], "prompts": [...], "labels": [...]}
                  ->  {"rewards": [r, ...]}
    GET  /stats   ->  {"calls": N, "samples": M}     (what it has scored since it started)
    GET  /health  ->  200

The reward for the tiny reverse task: 1 for the exact answer plus the character similarity to it
(difflib), the same shape as the built-in exact_match + edit_distance rules, so a run learns;
plus $REWARD_OFFSET (default 0), which makes its rewards recognisable in a run's metrics. With
$API_KEY set, a POST without `Authorization: Bearer $API_KEY` gets 401 (counted in /stats)."""

import difflib
import json
import os
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

lock = threading.Lock()
stats = {"calls": 0, "samples": 0, "unauthorized": 0}
OFFSET = float(os.environ.get("REWARD_OFFSET", "0"))
API_KEY = os.environ.get("API_KEY", "")


def reward(prompt: str, query: str, label: str) -> float:
    response = (query[len(prompt) :] if query.startswith(prompt) else query).strip()
    label = label.strip()
    return OFFSET + float(response == label) + difflib.SequenceMatcher(None, response, label).ratio()


class Handler(BaseHTTPRequestHandler):
    def do_POST(self):
        if self.path != "/get_reward":
            return self.reply(404, {"error": "POST /get_reward"})
        if API_KEY and self.headers.get("Authorization") != f"Bearer {API_KEY}":
            with lock:
                stats["unauthorized"] += 1
            return self.reply(401, {"error": "a bearer token is required"})
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
        queries, prompts, labels = body["query"], body["prompts"], body["labels"]
        rewards = [reward(p, q, lab or "") for q, p, lab in zip(queries, prompts, labels)]
        with lock:
            stats["calls"] += 1
            stats["samples"] += len(rewards)
        self.reply(200, {"rewards": rewards})

    def do_GET(self):
        if self.path == "/stats":
            with lock:
                return self.reply(200, dict(stats))
        return self.reply(200 if self.path == "/health" else 404, {"ok": self.path == "/health"})

    def reply(self, code: int, obj) -> None:
        data = json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


if __name__ == "__main__":
    ThreadingHTTPServer(("0.0.0.0", 8000), Handler).serve_forever()
