"""The reward server's own metrics and its held-out scorer: the HTTP API's requests counted by
path and status code (unknown paths as "other"), every request to the user's reward API counted
by outcome (ok, http_error, transport_error, bad_answer) and timed, and Score requests marked
held-out scored by `reward.eval_rules` when set (the training reward otherwise)."""

import httpx
import pytest
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry

from services.common.config import config_from_dict
from services.common.types import RewardSample, ScoreResult
from services.reward.client import HeldOut, RewardClient
from services.reward.http_scorer import HTTPScorer, RewardUnavailable
from services.reward.metrics import HTTPMetrics, RewardAPIMetrics, path_label
from services.reward.scorer import RuleScorer, build_scorer
from services.reward.server import build_http_app, serve
from tests.grpc_helpers import TOKEN
from tests.reward.test_server import FlakyRewardAPI

SAMPLES = [RewardSample("abc=", "cba", "cba"), RewardSample("ab=", "xx", "ba")]
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture()
def api():
    a = FlakyRewardAPI()
    yield a
    a.close()


class Exploding:
    def score(self, samples):
        raise RuntimeError("a bug in a scorer")


def _count(registry, name, **labels):
    return registry.get_sample_value(name, labels) or 0.0


def test_path_label_bounds_the_label_set():
    assert [path_label(p) for p in ("/score", "/get_reward", "/health", "/admin", "/score/x", "")] == [
        "/score",
        "/get_reward",
        "/health",
        "other",
        "other",
        "other",
    ]


def test_http_requests_are_counted_by_path_and_code():
    registry = CollectorRegistry()
    app = build_http_app(RuleScorer([("exact_match", 1.0, {})]), TOKEN, metrics=HTTPMetrics(registry))
    client = TestClient(app, raise_server_exceptions=False)
    body = {"query": ["abc=cba"], "prompts": ["abc="], "labels": ["cba"]}
    assert client.post("/score", json=body, headers=AUTH).status_code == 200
    assert client.post("/score", json=body, headers=AUTH).status_code == 200
    assert client.post("/get_reward", json=body).status_code == 401
    assert client.post("/get_reward", json={"query": []}, headers=AUTH).status_code == 422
    assert client.get("/health").status_code == 200
    assert client.get("/wp-login.php", headers=AUTH).status_code == 404
    assert client.get("/wp-login.php").status_code == 401  # the token first, on every path but /health

    def c(path, code):
        return _count(registry, "rlhf_http_requests_total", service="reward", path=path, code=code)

    assert (
        c("/score", "200"),
        c("/get_reward", "401"),
        c("/get_reward", "422"),
        c("/health", "200"),
        c("other", "404"),
        c("other", "401"),
    ) == (2, 1, 1, 1, 1, 1)
    assert _count(registry, "rlhf_http_request_seconds_count", service="reward", path="/score") == 2
    assert _count(registry, "rlhf_http_request_seconds_sum", service="reward", path="/score") > 0


def test_a_scorer_that_raises_counts_as_500():
    registry = CollectorRegistry()
    client = TestClient(build_http_app(Exploding(), None, metrics=HTTPMetrics(registry)), raise_server_exceptions=False)
    assert client.post("/score", json={"query": ["x"]}).status_code == 500
    assert _count(registry, "rlhf_http_requests_total", service="reward", path="/score", code="500") == 1


def _outcomes(registry) -> dict[str, float]:
    return {
        o: _count(registry, "rlhf_reward_api_requests_total", service="reward", outcome=o)
        for o in ("ok", "http_error", "transport_error", "bad_answer")
    }


def test_reward_api_requests_are_counted_by_outcome(api):
    registry = CollectorRegistry()
    metrics = RewardAPIMetrics(registry)
    assert (
        registry.get_sample_value("rlhf_reward_api_requests_total", {"service": "reward", "outcome": "ok"}) is None
    )  # no API to call yet: no samples
    # the stall is waited out (5 s); an answer on a busy machine never takes that long
    scorer = HTTPScorer(api.url, timeout_s=5, retries=3, backoff_s=0.01, metrics=metrics)
    assert _outcomes(registry) == {"ok": 0, "http_error": 0, "transport_error": 0, "bad_answer": 0}  # from 0
    api.script = ["fail", "stall", "ok"]  # a 503, a timeout, then an answer: three attempts
    scorer.score(SAMPLES)
    assert _outcomes(registry) == {"ok": 1, "http_error": 1, "transport_error": 1, "bad_answer": 0}
    api.script = ["bad"]
    with pytest.raises(RewardUnavailable):
        HTTPScorer(api.url, retries=0, metrics=metrics).score(SAMPLES)
    with pytest.raises(RewardUnavailable):
        HTTPScorer("http://127.0.0.1:9/nothing", timeout_s=0.2, retries=1, backoff_s=0.01, metrics=metrics).score(
            SAMPLES
        )
    assert _outcomes(registry) == {"ok": 1, "http_error": 1, "transport_error": 3, "bad_answer": 1}
    assert _count(registry, "rlhf_reward_api_seconds_count", service="reward") == 6
    assert _count(registry, "rlhf_reward_api_seconds_sum", service="reward") >= 0.3  # the timeout is in it


def test_reward_api_answers_that_are_not_rewards_are_bad_answers():
    registry = CollectorRegistry()
    metrics = RewardAPIMetrics(registry)
    for answer in ("[1.0, 2.0]", '{"rewards": ["x", 1.0]}', '{"rewards": [Infinity, 1.0]}', "not json"):

        def handler(request, answer=answer):
            return httpx.Response(200, text=answer)

        scorer = HTTPScorer("http://api/score", retries=0, metrics=metrics)
        scorer.client = httpx.Client(transport=httpx.MockTransport(handler))
        with pytest.raises(RewardUnavailable):
            scorer.score(SAMPLES)
    assert _outcomes(registry)["bad_answer"] == 4


def test_the_server_counts_its_reward_api_in_its_registry(api, tiny_model_dir):
    cfg = config_from_dict(
        {
            "model": {"path": tiny_model_dir, "device": "cpu"},
            "reward": {"type": "http", "http_url": api.url, "http_retries": 0},
            "rpc": {"auth_token": TOKEN, "reward": {"port": 0, "metrics_port": None, "http_port": None}},
        }
    )
    with serve(cfg) as svc:
        RewardClient(f"127.0.0.1:{svc.server.port}", cfg.rpc).score(SAMPLES)
        assert (
            _count(svc.server.metrics.registry, "rlhf_reward_api_requests_total", service="reward", outcome="ok") == 1
        )
    assert build_scorer(cfg.reward).metrics is None  # without metrics, nothing is counted


@pytest.mark.parametrize("eval_rules", [None, [{"name": "length", "kwargs": {"target": 3}}]])
def test_held_out_requests_use_the_eval_rules(tiny_model_dir, eval_rules):
    cfg = config_from_dict(
        {
            "model": {"path": tiny_model_dir, "device": "cpu"},
            "reward": {"rules": [{"name": "exact_match"}], "eval_rules": eval_rules},
            "rpc": {"auth_token": TOKEN, "reward": {"port": 0, "metrics_port": None, "http_port": None}},
        }
    )
    with serve(cfg) as svc:
        client = RewardClient(f"127.0.0.1:{svc.server.port}", cfg.rpc)
        train = client.score(SAMPLES)
        held_out = HeldOut(client).score(SAMPLES)
    assert train == [ScoreResult(1.0, {"exact_match": 1.0}), ScoreResult(0.0, {"exact_match": 0.0})]
    if eval_rules is None:
        assert held_out == train  # no gold reward set apart: the eval uses the training reward
    else:
        assert held_out == [ScoreResult(0.0, {"length": 0.0}), ScoreResult(-1 / 3, {"length": -1 / 3})]
