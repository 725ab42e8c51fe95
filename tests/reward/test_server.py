"""The reward server over gRPC and over its own HTTP endpoint, and the `http` scorer against a
real local HTTP reward API that fails, stalls and recovers."""

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import grpc
import httpx
import pytest

from services.common.rpc.gen import reward_pb2 as rpb
from services.common.types import RewardSample, ScoreResult
from services.reward.client import RewardAPIFailure, RewardClient
from services.reward.http_scorer import HTTPScorer, RewardUnavailable
from services.reward.scorer import CombinedScorer, RuleScorer
from services.reward.server import serve
from tests.grpc_helpers import TOKEN, expect_code, on_free_ports
from tests.http_helpers import error_of, head, raw
from tests.waits import wait_until


class FlakyRewardAPI:
    """A real HTTP server speaking OpenRLHF's protocol; its behaviour is scripted per request:
    'ok', 'fail' (HTTP 503), 'stall' (no answer until `close()`: past any client timeout),
    'bad' (wrong count)."""

    def __init__(self):
        self.script: list[str] = []
        self.requests: list[dict] = []
        self.released = threading.Event()
        api = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                api.requests.append(body)
                mode = api.script.pop(0) if api.script else "ok"
                if mode == "fail":
                    self.send_response(503)
                    self.end_headers()
                    return
                if mode == "stall":
                    api.released.wait(120)
                rewards = [float(len(q)) for q in body["query"]]
                if mode == "bad":
                    rewards = rewards[:-1]
                if mode == "lists":
                    rewards = [[r, 1.0] for r in rewards]
                data = json.dumps({"rewards": rewards, "extra": "ignored"}).encode()
                try:
                    self.send_response(200)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except BrokenPipeError:
                    pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/get_reward"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.released.set()
        self.httpd.shutdown()


@pytest.fixture()
def api():
    a = FlakyRewardAPI()
    yield a
    a.close()


SAMPLES = [RewardSample("abc=", "cba", "cba"), RewardSample("ab=", "xx", "ba")]


def test_http_scorer_speaks_openrlhf_protocol(api):
    s = HTTPScorer(api.url, timeout_s=30, retries=0)
    out = s.score(SAMPLES)
    assert [r.reward for r in out] == [7.0, 5.0]
    assert api.requests[0] == {"query": ["abc=cba", "ab=xx"], "prompts": ["abc=", "ab="], "labels": ["cba", "ba"]}
    api.script = ["lists"]
    assert [r.reward for r in s.score(SAMPLES)] == [8.0, 6.0]


def test_http_scorer_retries_through_failures_and_stalls(api):
    api.script = ["fail", "stall", "ok"]
    # the stall is waited out (5 s); an answer on a busy machine never takes that long
    s = HTTPScorer(api.url, timeout_s=5, retries=3, backoff_s=0.05)
    assert [r.reward for r in s.score(SAMPLES)] == [7.0, 5.0]
    assert len(api.requests) == 3


def test_http_scorer_gives_up_loudly_never_a_silent_zero(api):
    api.script = ["fail", "fail", "fail"]
    s = HTTPScorer(api.url, timeout_s=30, retries=2, backoff_s=0.01)
    with pytest.raises(RewardUnavailable, match="after 3 attempts .*HTTP 503"):
        s.score(SAMPLES)
    api.script = ["bad"]
    with pytest.raises(RewardUnavailable, match="1 rewards for 2 samples"):
        HTTPScorer(api.url, retries=0).score(SAMPLES)
    with pytest.raises(RewardUnavailable, match="no reward"):
        HTTPScorer("http://127.0.0.1:9/nothing", timeout_s=0.2, retries=1, backoff_s=0.01).score(SAMPLES)


def test_http_scorer_batches_and_limits_concurrency(api):
    s = HTTPScorer(api.url, batch_size=3, concurrency=2)
    out = s.score([RewardSample("p", "r" * i) for i in range(10)])
    assert [r.reward for r in out] == [1.0 + i for i in range(10)]
    assert sorted(len(r["query"]) for r in api.requests) == [1, 3, 3, 3]


@pytest.fixture()
def reward_server(cfg, api):
    scorer = CombinedScorer(
        [
            ("rules", 1.0, RuleScorer([("exact_match", 1.0, {}), ("edit_distance", 0.5, {})])),
            ("http", 0.1, HTTPScorer(api.url, timeout_s=30, retries=1, backoff_s=0.01)),
        ]
    )
    with serve(on_free_ports(cfg, "reward", http=True), scorer) as svc:
        yield svc.server


def test_grpc_score_with_components(reward_server, cfg):
    c = RewardClient(f"127.0.0.1:{reward_server.port}", cfg.rpc)
    out = c.score([RewardSample("abc=", "cba", "cba", {"k": 1}), RewardSample("ab=", "ab", "ba")])
    assert out[0].reward == pytest.approx(1.0 + 0.5 + 0.1 * 7) and out[0].components["rules/exact_match"] == 1.0
    assert out[1].components["http"] == 5.0


def test_grpc_bad_input_and_auth(reward_server, cfg, api):
    c = RewardClient(f"127.0.0.1:{reward_server.port}", cfg.rpc)
    expect_code(
        lambda: c.stub.Score(rpb.ScoreRequest(), metadata=c.metadata),
        grpc.StatusCode.INVALID_ARGUMENT,
        "samples: empty batch",
    )
    bad_meta = rpb.ScoreRequest(samples=[rpb.RewardSample(prompt="a", response="b", label="b", metadata_json="{x")])
    expect_code(
        lambda: c.stub.Score(bad_meta, metadata=c.metadata),
        grpc.StatusCode.INVALID_ARGUMENT,
        "samples[0].metadata_json",
    )
    no_label = rpb.ScoreRequest(samples=[rpb.RewardSample(prompt="a", response="b")])
    expect_code(lambda: c.stub.Score(no_label, metadata=c.metadata), grpc.StatusCode.INVALID_ARGUMENT, "needs a label")
    expect_code(lambda: c.stub.Score(no_label), grpc.StatusCode.UNAUTHENTICATED)
    api.script = ["fail", "fail"]
    with pytest.raises(RewardAPIFailure, match="reward API failed"):  # UNAVAILABLE with Reason.REWARD_API_FAILED
        c.score(SAMPLES)
    assert len(c.score(SAMPLES)) == 2  # recovered, still serving


def test_reward_server_speaks_openrlhf_http(reward_server):
    url = f"http://127.0.0.1:{reward_server.http_port}"
    body = {"query": ["abc=cba", "ab=xx"], "prompts": ["abc=", "ab="], "labels": ["cba", "ba"]}
    r = httpx.post(f"{url}/get_reward", json=body, headers={"Authorization": f"Bearer {TOKEN}"})
    assert r.status_code == 200, r.text
    rewards = r.json()["rewards"]
    assert rewards[0] == pytest.approx(1.5 + 0.7) and rewards[1] == pytest.approx(0.5 * 0.0 + 0.5)
    assert httpx.post(f"{url}/score", json=body).status_code == 401
    assert (
        httpx.post(f"{url}/score", json={"query": []}, headers={"Authorization": f"Bearer {TOKEN}"}).status_code == 422
    )
    # our own http scorer can use our own reward server as its external API
    own = HTTPScorer(f"{url}/score", headers={"Authorization": f"Bearer {TOKEN}"})
    assert [x.reward for x in own.score([RewardSample("abc=", "cba", "cba")])] == pytest.approx([2.2])


def test_http_is_guarded_like_every_http_surface(reward_server, monkeypatch):
    """Auth on the headers before the body (a body of 10 GB announced and never sent: 401 at
    once, 413 at once with the token), the schema behind the token and no doc pages, every error
    in the one shape, and a scorer that raises is a 500 in it after which the connection serves
    the next request."""
    port = reward_server.http_port
    url, auth = f"http://127.0.0.1:{port}", {"Authorization": f"Bearer {TOKEN}"}
    status, _, body, seconds = raw(port, head("/score", "Content-Length: 10000000000"))
    assert status == 401 and seconds < 5 and json.loads(body)["error"]["code"] == "invalid_api_key"
    status, _, body, seconds = raw(
        port, head("/score", f"Authorization: Bearer {TOKEN}", "Content-Length: 10000000000")
    )
    assert status == 413 and seconds < 5 and json.loads(body)["error"]["code"] == "request_too_large"
    for path in ("/openapi.json", "/docs", "/status"):
        error_of(httpx.get(url + path), 401, code="invalid_api_key")
    assert "/score" in httpx.get(url + "/openapi.json", headers=auth).json()["paths"]
    error_of(httpx.get(url + "/docs", headers=auth), 404)
    error_of(httpx.get(url + "/score", headers=auth), 405)
    error_of(httpx.post(url + "/score", json={"query": ["x"]}), 401)

    def broken(samples):
        raise RuntimeError("a bug")

    import services.reward.server as server

    monkeypatch.setattr(server, "_check_scores", lambda results: broken(results))
    with httpx.Client(limits=httpx.Limits(max_connections=1), headers=auth, timeout=30) as c:
        e = error_of(c.post(url + "/score", json={"query": ["abc=cba"], "labels": ["cba"]}), 500)
        assert e["type"] == "server_error" and "a bug" not in e["message"]
        assert c.get(url + "/status").status_code == 200


def test_grpc_refuses_oversized_texts_and_metadata(reward_server, cfg):
    c = RewardClient(f"127.0.0.1:{reward_server.port}", cfg.rpc)
    long = "x" * (cfg.reward.max_text_chars + 1)
    for field, sample in (
        ("prompt", rpb.RewardSample(prompt=long, response="r", label="r")),
        ("response", rpb.RewardSample(prompt="p", response=long, label="r")),
        ("label", rpb.RewardSample(prompt="p", response="r", label=long)),
    ):
        req = rpb.ScoreRequest(samples=[rpb.RewardSample(prompt="p", response="r", label="r"), sample])
        expect_code(
            lambda: c.stub.Score(req, metadata=c.metadata),
            grpc.StatusCode.INVALID_ARGUMENT,
            f"samples[1].{field}: {len(long)} characters, more than reward.max_text_chars",
        )
    for meta, fragment in (
        ("[" * 100_000, "100000 characters, more than 65536"),
        ("[" * 10_000, "nested too deeply"),
        ('{"a": "' + "x" * 70_000 + '"}', "70009 characters, more than 65536"),
    ):
        req = rpb.ScoreRequest(samples=[rpb.RewardSample(prompt="p", response="r", label="r", metadata_json=meta)])
        expect_code(
            lambda: c.stub.Score(req, metadata=c.metadata),
            grpc.StatusCode.INVALID_ARGUMENT,
            f"samples[0].metadata_json: {fragment}",
        )
    ok = "y" * cfg.reward.max_text_chars
    assert c.score([RewardSample("p", ok, ok)])[0].components["rules/exact_match"] == 1.0


class SlowScorer:
    """1 ms per sample; records the size of each call."""

    def __init__(self):
        self.calls: list[int] = []

    def score(self, samples):
        self.calls.append(len(samples))
        time.sleep(0.001 * len(samples))
        return [ScoreResult(0.0, {}) for _ in samples]


def _handled(server, method: str) -> float:
    """How many `method` calls the server has finished, whatever their status."""
    return sum(
        s.value
        for m in server.metrics.requests.collect()
        for s in m.samples
        if s.name.endswith("_total") and s.labels["method"] == method
    )


def test_grpc_score_stops_when_the_deadline_passes(cfg):
    scorer = SlowScorer()
    with serve(on_free_ports(cfg, "reward"), scorer) as svc:
        c = RewardClient(f"127.0.0.1:{svc.server.port}", cfg.rpc, timeout_s=1.0)
        expect_code(lambda: c.score([RewardSample("p", "r")] * 20_000), grpc.StatusCode.DEADLINE_EXCEEDED)
        wait_until(lambda: _handled(svc.server, "Score"), "the Score call handled", every_s=0.05)
        assert _handled(svc.server, "Score") == 1
        # 20 s of work (40 slices of 512 at 1 ms a sample) unsliced; it stopped within a slice or two of
        # the 1 s deadline (a busy machine only makes the sleeps longer, so fewer slices fit)
        assert len(scorer.calls) <= 4 and sum(scorer.calls) <= 4 * 512, "the server went on scoring after the deadline"


def test_http_refuses_bad_json_cleanly(reward_server, cfg):
    url = f"http://127.0.0.1:{reward_server.http_port}/get_reward"
    http = httpx.Client(headers={"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"})
    for body, code in (
        (b'{"query": ["a=b"], "labels": [NaN]}', 400),
        (b'{"query": [Infinity]}', 400),
        (b'{"query": ["a"], "prompts": [-Infinity]}', 400),
        (b'{"query": ["\xff"]}', 400),
        (b"[" * 100_000, 400),
        (b'{"query": ["a"', 400),
        (b'{"query": "a=b"}', 422),
        (b'{"query": [1]}', 422),
        (b'{"quer": ["a"]}', 422),
    ):
        r = http.post(url, content=body)
        assert r.status_code == code, (body[:40], r.status_code, r.text)
        assert error_of(r, code)["message"], r.text
    assert httpx.post(url, content=b'{"query": [NaN]}', headers={"Content-Type": "application/json"}).status_code == 401
    long = "x" * (cfg.reward.max_text_chars + 1)
    for body, fragment in (
        ({"query": ["p=" + long], "prompts": ["p="], "labels": ["r"]}, "query[0]'s response"),
        ({"query": ["p=r"], "prompts": ["p="], "labels": [long]}, "labels[0]"),
        ({"query": [long + "r"], "prompts": [long], "labels": ["r"]}, "prompts[0]"),
        ({"query": [long * 2], "labels": ["r"]}, "query[0]"),
    ):
        r = http.post(url, json=body)
        assert fragment in error_of(r, 422)["message"], r.text
    r = http.post(url, json={"query": ["abc=cba"], "prompts": ["abc="], "labels": ["cba"]})
    assert r.status_code == 200 and set(r.json()) == {"rewards", "scores", "extra_logs"}
    http.close()
