"""The reward server's OpenRLHF-style POST /score bounded in samples as its gRPC Score is (issue
54): 4,000,000 samples in a 48 MB body were scored (71 s, 3.5 GB, a 64 MB answer); now more than
65,536 are refused, 422 in the one error shape, before a model of any sample is built."""

import json
import time

import httpx

from services.reward.scorer import RuleScorer
from services.reward.server import MAX_SAMPLES, serve
from tests.grpc_helpers import TOKEN, on_free_ports
from tests.http_helpers import error_of

AUTH = {"Authorization": f"Bearer {TOKEN}", "content-type": "application/json"}


def test_score_refuses_more_samples_than_grpc_score_takes(cfg):
    scorer = RuleScorer([("exact_match", 1.0, {})])
    with serve(on_free_ports(cfg, "reward", http=True), scorer) as svc:
        base = f"http://127.0.0.1:{svc.server.http_port}"
        body = json.dumps({"query": ["a"] * (MAX_SAMPLES + 1)}).encode()
        t0 = time.perf_counter()
        e = error_of(httpx.post(base + "/score", content=body, headers=AUTH, timeout=60), 422)
        assert f"more than {MAX_SAMPLES}" in e["message"] and time.perf_counter() - t0 < 20
        labels = json.dumps({"query": ["a"], "labels": ["a"] * (MAX_SAMPLES + 1)}).encode()
        error_of(httpx.post(base + "/get_reward", content=labels, headers=AUTH, timeout=60), 422)
        ok = httpx.post(base + "/score", json={"query": ["a", "b"], "labels": ["a", "a"]}, headers=AUTH)
        assert ok.status_code == 200 and ok.json()["rewards"] == [1.0, 0.0]
        schema = httpx.get(base + "/openapi.json", headers=AUTH).json()
        request = json.dumps(schema)
        assert f'"maxItems": {MAX_SAMPLES}' in request  # the bound is documented where clients read it
