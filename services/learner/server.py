"""The learner's network faces: gRPC (PullWeights for a generation server that starts late,
Status), a JSON status page over HTTP, and its Prometheus gauges."""
from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import Counter, Gauge

from ..common.rpc.codec import weight_chunks
from ..common.rpc.gen import learner_pb2 as lpb, learner_pb2_grpc


class LearnerServicer(learner_pb2_grpc.LearnerServicer):
    def __init__(self, service):
        self.service = service

    def PullWeights(self, request, context):
        version, state = self.service.snapshot
        if not state or request.have_version >= version:
            return
        yield from weight_chunks(state, version)

    def Status(self, request, context):
        s = self.service.status()
        return lpb.LearnerStatus(**{k: v for k, v in s.items() if k in lpb.LearnerStatus.DESCRIPTOR.fields_by_name})


def status_http(service, host: str, port: int) -> ThreadingHTTPServer:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            if self.path.split("?")[0] in ("/status", "/"):
                body, code = json.dumps(service.status(), default=str).encode(), 200
            elif self.path == "/healthz":
                body, code = b'{"ok": true}', 200
            else:
                body, code = b'{"error": "not found; try /status"}', 404
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    httpd = ThreadingHTTPServer((host, port), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True, name="status-http").start()
    return httpd


class LearnerMetrics:
    def __init__(self, registry):
        g = lambda name, doc: Gauge(name, doc, registry=registry)  # noqa: E731
        self.iteration = g("rlhf_learner_iteration", "completed iterations")
        self.version = g("rlhf_learner_policy_version", "newest policy version")
        self.reward = g("rlhf_learner_reward", "mean training reward of the last batch")
        self.eval_reward = g("rlhf_learner_eval_reward", "held-out reward of the last eval")
        self.kl = g("rlhf_learner_kl", "KL to the reference of the last batch")
        self.staleness = g("rlhf_replay_staleness", "mean policy-version lag of the last batch")
        self.backlog = g("rlhf_replay_lag", "trajectory groups waiting for the learner")
        self.push_seconds = g("rlhf_learner_push_seconds", "seconds of the last weight push")
        self.iteration_seconds = g("rlhf_learner_iteration_seconds", "seconds of the last iteration")
        self.dropped = Counter("rlhf_replay_dropped_stale_total", "groups dropped as too stale", registry=registry)
        self._dropped_seen = 0

    def observe(self, service, m: dict) -> None:
        self.iteration.set(service.iteration)
        self.version.set(service.learner.version)
        self.reward.set(m.get("reward/score_mean", float("nan")))
        if "eval/reward_mean" in m:
            self.eval_reward.set(m["eval/reward_mean"])
        self.kl.set(m.get("ppo/kl_ref", 0.0))
        self.staleness.set(m.get("replay/staleness_mean", 0.0))
        self.backlog.set(m.get("replay/backlog", 0))
        self.push_seconds.set(m.get("time/push_s", 0.0))
        self.iteration_seconds.set(m.get("time/iteration_s", 0.0))
        d = service.counters["dropped_stale"]
        self.dropped.inc(d - self._dropped_seen)
        self._dropped_seen = d
