"""The user's reward API failing in every way it does in practice, over real HTTP on loopback
(`FaultAPI`, a standard-library server in a thread): 500, 503 and 429 with Retry-After, 400/422,
401/403/404, a hang, a closed connection, an answer that is not rewards. Retries happen only for
timeouts, lost connections, 5xx and 429, with backoff or Retry-After; no sample ever gets a
default reward (a batch is scored whole or not at all); the concurrency cap holds across
concurrent calls; the circuit breaker opens, fails fast, lets one probe through and closes, in
the log, /status and the metrics; the auth header arrives and its token never shows."""

import email.utils
import json
import logging
import random
import threading
import time

import grpc
import httpx
import pytest
from prometheus_client import CollectorRegistry

from services.common.config import config_from_dict
from services.common.config_sections import RewardConfig
from services.common.rpc.errors import reason_of
from services.common.types import RewardSample
from services.reward.client import RewardAPIFailure, RewardClient
from services.reward.http_scorer import (
    HTTPScorer,
    RewardAPIFailed,
    RewardRejected,
    RewardUnavailable,
    decorrelated_jitter,
    public_url,
    retry_after_s,
)
from services.reward.metrics import RewardAPIMetrics
from services.reward.server import serve
from tests.grpc_helpers import TOKEN
from tests.reward.fault_api import FaultAPI

SAMPLES = [RewardSample("abc=", "cba", "cba"), RewardSample("ab=", "xx", "ba")]
REWARDS = [7.0, 5.0]  # len(prompt + response): what FaultAPI answers


@pytest.fixture(scope="module")
def model_dir(untrained_model_dir):
    return untrained_model_dir


@pytest.fixture()
def api():
    a = FaultAPI()
    yield a
    a.close()


class FakeClock:
    """The breaker's clock, moved by the test: its cooldown passes when the test says so."""

    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, s: float) -> None:
        self.now += s


def make(api, registry=None, **kw) -> HTTPScorer:
    """A scorer of `api`. Its HTTP timeout is long (30 s: a loopback answer on a busy machine must
    never look like a timeout); the tests of a hang give theirs."""
    opts = dict(timeout_s=30.0, retries=2, backoff_s=0.01, max_backoff_s=0.05, breaker_failures=0)
    opts.update(kw)
    return HTTPScorer(api.url, metrics=RewardAPIMetrics(registry or CollectorRegistry()), **opts)


def value(registry, name, **labels):
    return registry.get_sample_value(name, {"service": "reward", **labels})


# ------------------------------------------------------------------------------------------- what is retried
@pytest.mark.parametrize(
    "mode, error",
    [
        ("500", "HTTP 500"),
        ("503", "HTTP 503"),
        ("429", "HTTP 429"),
        ("hang", "ReadTimeout"),
        ("close", "RemoteProtocolError"),
    ],
)
def test_timeouts_lost_connections_5xx_and_429_are_retried_then_fail_loudly(api, mode, error):
    api.mode = mode
    # a hang needs a timeout short enough to wait out three times, and long enough that the loopback
    # answer after it is never taken for one on a busy machine
    s = make(api, retries=2, **({"timeout_s": 2.0} if mode == "hang" else {}))
    with pytest.raises(RewardAPIFailed, match=f"reward API failed: .*after 3 attempts .*{error}"):
        s.score(SAMPLES)
    assert api.count() == 3  # the request and its 2 retries, no more
    api.script, api.mode = [mode, mode], "ok"
    assert [r.reward for r in s.score(SAMPLES)] == REWARDS  # two failures, then the answer
    assert api.count() == 6


@pytest.mark.parametrize(
    "mode, kind, what",
    [
        ("400", RewardRejected, "rejected the request: HTTP 400"),
        ("422", RewardRejected, "rejected the request: HTTP 422"),
        ("401", RewardUnavailable, "refuses the request: HTTP 401"),
        ("403", RewardUnavailable, "refuses the request: HTTP 403"),
        ("404", RewardUnavailable, "refuses the request: HTTP 404"),
        ("bad", RewardAPIFailed, "1 rewards for 2 samples"),
    ],
)
def test_other_4xx_and_answers_that_are_not_rewards_are_never_retried(api, mode, kind, what):
    api.mode = mode
    with pytest.raises(kind, match=what) as e:
        make(api, retries=3).score(SAMPLES)
    assert type(e.value) is kind
    assert api.count() == 1
    if mode in ("400", "422"):
        assert '"error": "no"' in str(e.value)  # the start of the body, for the user to read


def test_retry_after_is_honoured_in_seconds_and_as_a_date_and_capped(api):
    """Lower bounds only (a busy machine makes every wait longer, never shorter); the cap is shown
    by a wait far shorter than the one asked for."""
    api.script, api.retry_after = ["429", "ok"], "0.5"
    assert [r.reward for r in make(api).score(SAMPLES)] == REWARDS
    assert api.gaps()[-1] >= 0.5
    api.requests.clear()
    # the date is to the second, 4 s ahead: at least 3 s from now, less whatever the machine took
    api.script, api.retry_after = ["503", "ok"], email.utils.formatdate(time.time() + 4, usegmt=True)
    make(api).score(SAMPLES)
    assert api.gaps()[-1] >= 1.0
    api.requests.clear()
    api.script, api.retry_after = ["429", "ok"], "60"
    make(api, retry_after_max_s=0.2).score(SAMPLES)
    assert 0.2 <= api.gaps()[-1] < 30  # a minute asked for, the cap waited
    assert retry_after_s("soon") is None and retry_after_s("-3") == 0.0 and retry_after_s(None) is None


def test_backoff_without_retry_after_has_jitter_between_its_bounds(api):
    """The schedule is drawn, between its floor and its cap (checked on the draws themselves);
    over HTTP, every retry waits at least the floor."""
    rng, last, waits = random.Random(0), 0.05, []
    for _ in range(200):
        last = decorrelated_jitter(rng, 0.05, 0.2, last)
        waits.append(last)
    assert all(0.05 <= w <= 0.2 for w in waits) and len(set(waits)) > 20 and max(waits) == 0.2
    api.mode = "500"
    with pytest.raises(RewardAPIFailed):
        make(api, retries=6, backoff_s=0.05, max_backoff_s=0.2).score(SAMPLES)
    gaps = api.gaps()
    assert len(gaps) == 6 and all(g >= 0.05 for g in gaps), gaps


# ------------------------------------------------------------------------------------------- no default reward
def test_a_batch_is_scored_whole_or_not_at_all(api):
    """Four requests of one sample each; the second one's input makes the API fail every time:
    the call raises (no reward for any sample, none defaulted), and the requests not yet sent are
    not sent."""
    samples = [RewardSample(f"p{i}=", "x", None) for i in range(4)]
    api.poison = ("p1=", "500")
    s = make(api, batch_size=1, concurrency=1, retries=2)
    with pytest.raises(RewardAPIFailed, match="HTTP 500"):
        s.score(samples)
    assert [r["mode"] for r in api.requests] == ["ok", "500", "500", "500"]  # p2, p3 never sent
    api.poison = None
    assert [r.reward for r in s.score(samples)] == [4.0] * 4


def test_the_concurrency_cap_holds_across_concurrent_calls(api):
    """The API holds its answers until three requests are in, so the cap is reached whatever the
    machine's speed; a fourth would arrive while they are held."""
    api.gate = threading.Event()
    s = make(api, batch_size=1, concurrency=3)
    out = {}

    def call(k):
        out[k] = [r.reward for r in s.score([RewardSample("p" * k, "r" * i) for i in range(6)])]

    threads = [threading.Thread(target=call, args=(k,)) for k in range(1, 5)]
    for t in threads:
        t.start()
    api.wait_for("three requests at once", lambda a: a.in_flight == 3)
    api.gate.set()
    for t in threads:
        t.join()
    assert out == {k: [float(k + i) for i in range(6)] for k in range(1, 5)}
    assert api.count() == 24 and api.max_in_flight == 3  # four calls of six requests, three at a time


# ------------------------------------------------------------------------------------------- the breaker
def test_the_breaker_opens_fails_fast_probes_once_and_closes(api, caplog):
    """The cooldown runs on a clock the test moves; the probe's answer is held by the API until
    the test has seen the others fail fast."""
    registry, clock = CollectorRegistry(), FakeClock()
    s = make(api, registry, retries=1, breaker_failures=3, breaker_cooldown_s=30.0, clock=clock)
    state = lambda: value(registry, "rlhf_reward_api_breaker_state")  # noqa: E731
    assert state() == 0 and s.status()["breaker"]["state"] == "closed"
    caplog.set_level(logging.INFO, logger="services.reward.http_scorer")
    api.mode = "503"
    with pytest.raises(RewardAPIFailed):  # two failed attempts, the breaker still closed
        s.score(SAMPLES)
    with pytest.raises(RewardUnavailable, match="circuit open after 3 failed requests") as e:
        s.score(SAMPLES)  # the third failure opens it: the retry is not sent
    assert type(e.value) is RewardUnavailable and api.count() == 3
    clock.advance(29.0)
    for _ in range(5):  # open: fails at once, the API is not asked
        with pytest.raises(RewardUnavailable, match="circuit open .*HTTP 503.*next probe in 1.0s"):
            s.score(SAMPLES)
    assert api.count() == 3
    st = s.status()["breaker"]
    assert st["state"] == "open" and st["last_error"] == "HTTP 503" and st["times_opened"] == 1
    assert st["open_for_s"] == 29.0 and st["next_probe_in_s"] == 1.0
    assert (state(), value(registry, "rlhf_reward_api_breaker_opened_total")) == (2, 1)
    assert value(registry, "rlhf_reward_api_short_circuited_total") >= 6
    opened = [r for r in caplog.records if "circuit open" in r.getMessage()]
    assert len(opened) == 1 and opened[0].levelno == logging.WARNING and "HTTP 503" in opened[0].getMessage()

    clock.advance(1.0)  # half-open: one probe, which fails: open again
    with pytest.raises(RewardUnavailable, match="circuit open"):
        s.score(SAMPLES)
    assert api.count() == 4 and state() == 2
    assert any("the probe failed" in r.getMessage() for r in caplog.records)

    clock.advance(30.0)  # the API is back; the probe goes through and, while it is out, the others fail fast
    api.mode, api.gate = "ok", threading.Event()
    probe = {}
    t = threading.Thread(target=lambda: probe.setdefault("out", s.score(SAMPLES)))
    t.start()
    api.wait_for("the probe", lambda a: len(a.requests) == 5)
    assert state() == 1 and s.status()["breaker"]["state"] == "half_open"
    with pytest.raises(RewardUnavailable, match="a probe is out"):
        s.score(SAMPLES)
    api.gate.set()
    t.join()
    assert [r.reward for r in probe["out"]] == REWARDS and api.count() == 5
    assert state() == 0 and s.status()["breaker"]["state"] == "closed"
    assert [r.reward for r in s.score(SAMPLES)] == REWARDS
    closed = [r for r in caplog.records if "circuit closed" in r.getMessage()]
    assert len(closed) == 1 and closed[0].levelno == logging.INFO
    assert value(registry, "rlhf_reward_api_breaker_opened_total") == 1  # a reopening is the same outage


def test_one_input_the_api_chokes_on_does_not_open_the_breaker(api):
    """Retries of one failing body count once: a poison input fails its own batch (which a worker
    then drops) while the API stays open for everyone else."""
    api.poison = ("abc=", "500")
    s = make(api, retries=3, breaker_failures=2)
    for _ in range(3):
        with pytest.raises(RewardAPIFailed):
            s.score(SAMPLES)
    assert s.status()["breaker"]["state"] == "closed" and api.count() == 12
    assert [r.reward for r in s.score(SAMPLES[1:])] == [5.0]


def test_an_api_that_refuses_every_connection_opens_the_breaker(api):
    url = api.url
    api.close()
    s = HTTPScorer(url, timeout_s=30.0, retries=5, backoff_s=0.01, max_backoff_s=0.02, breaker_failures=3)
    with pytest.raises(RewardUnavailable, match="circuit open after 3 failed requests .*ConnectError"):
        s.score(SAMPLES)


# ------------------------------------------------------------------------------------------- auth
TOKEN_VALUE = "sk-test-3f9a1c77e2b04d1d"


def test_the_auth_header_arrives_and_its_token_never_shows(api, monkeypatch, caplog):
    caplog.set_level(logging.DEBUG)
    monkeypatch.setenv("MY_REWARD_KEY", TOKEN_VALUE)
    cfg = RewardConfig(
        type="http",
        http_url=api.url,
        http_auth_env="MY_REWARD_KEY",
        http_retries=1,
        http_timeout_s=30.0,
        http_backoff_s=0.01,
        http_breaker_failures=2,
    )
    s = HTTPScorer.from_config(cfg)
    assert [r.reward for r in s.score(SAMPLES)] == REWARDS
    assert api.requests[-1]["headers"]["Authorization"] == f"Bearer {TOKEN_VALUE}"
    messages = []
    for mode in ("400", "401", "500"):  # 400 and 401 echo the headers in their body
        api.mode = mode
        with pytest.raises(Exception) as e:
            s.score(SAMPLES)
        messages.append(str(e.value))
    assert "***" in messages[0] and "***" in messages[1]
    shown = "\n".join(messages + [json.dumps(s.status())] + [r.getMessage() for r in caplog.records])
    assert TOKEN_VALUE not in shown and "circuit open" in shown

    api.mode = "ok"
    raw = HTTPScorer.from_config(cfg.model_copy(update={"http_auth_header": "X-API-Key", "http_auth_scheme": ""}))
    raw.score(SAMPLES)
    assert api.requests[-1]["headers"]["X-API-Key"] == TOKEN_VALUE
    monkeypatch.delenv("MY_REWARD_KEY")
    HTTPScorer.from_config(cfg).score(SAMPLES)
    assert "Authorization" not in api.requests[-1]["headers"]  # no token, no header
    assert RewardConfig().http_auth_env == "RLHF_REWARD_API_KEY"


def test_urls_are_shown_without_credentials_or_query():
    assert public_url("https://user:pw@api.example:8443/v1/reward?key=abc") == "https://api.example:8443/v1/reward"


# ------------------------------------------------------------------------------------------- the reward server
def test_the_reward_server_tells_each_failure_apart_and_shows_the_breaker(api, model_dir):
    """Over gRPC: an input the API rejects is INVALID_ARGUMENT (a worker isolates that prompt); a
    batch the API failed is UNAVAILABLE saying so (the client turns it into `RewardAPIFailure`:
    a worker scores it again, then drops it); an API that is down is a plain UNAVAILABLE (callers
    wait; its own HTTP API answers 503). /status and /metrics show the breaker."""
    cfg = config_from_dict(
        {
            "model": {"path": model_dir, "device": "cpu"},
            "reward": {
                "type": "http",
                "http_url": api.url,
                "http_retries": 1,
                "http_timeout_s": 30.0,
                "http_backoff_s": 0.01,
                "http_breaker_failures": 3,
                "http_breaker_cooldown_s": 0.5,
            },
            "rpc": {"auth_token": TOKEN, "reward": {"port": 0, "metrics_port": 0, "http_port": 0}},
        }
    )
    auth = {"Authorization": f"Bearer {TOKEN}"}
    with serve(cfg) as svc:
        client = RewardClient(f"127.0.0.1:{svc.server.port}", cfg.rpc)

        def status():
            url = f"http://127.0.0.1:{svc.server.http_port}/status"
            return httpx.get(url, headers=auth, timeout=5).json()["reward_api"][0]["breaker"]

        def metrics():
            return httpx.get(f"http://127.0.0.1:{svc.server.metrics_port}/metrics", headers=auth, timeout=5).text

        assert [r.reward for r in client.score(SAMPLES)] == REWARDS
        assert status()["state"] == "closed" and 'rlhf_reward_api_breaker_state{service="reward"} 0.0' in metrics()
        assert httpx.get(f"http://127.0.0.1:{svc.server.http_port}/status", timeout=5).status_code == 401

        api.mode = "422"
        with pytest.raises(grpc.RpcError) as e:
            client.score(SAMPLES)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "HTTP 422" in e.value.details()
        api.mode = "500"
        with pytest.raises(RewardAPIFailure, match="after 2 attempts .*HTTP 500"):
            client.score(SAMPLES)
        api.mode = "503"
        with pytest.raises(grpc.RpcError) as e:
            client.score(SAMPLES)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "circuit open" in e.value.details()
        assert reason_of(e.value) is None  # down, not a failed batch: callers wait (the 500s above carried
        # Reason.REWARD_API_FAILED, which is what made them a RewardAPIFailure)
        st = status()
        assert st["state"] == "open" and st["last_error"] == "HTTP 503"
        assert 'rlhf_reward_api_breaker_state{service="reward"} 2.0' in metrics()
        assert 'rlhf_reward_api_breaker_opened_total{service="reward"} 1.0' in metrics()
        r = httpx.post(
            f"http://127.0.0.1:{svc.server.http_port}/score",
            headers=auth,
            timeout=5,
            json={"query": ["abc=cba"], "prompts": ["abc="], "labels": ["cba"]},
        )
        assert r.status_code == 503 and "circuit open" in r.text  # its own HTTP API says so too
        api.mode = "ok"
        time.sleep(0.55)  # past the cooldown (a busy machine only makes it longer): the probe goes through
        assert [r.reward for r in client.score(SAMPLES)] == REWARDS
        assert status()["state"] == "closed"
