"""A rollout worker, a real reward server calling the user's reward API (`FaultAPI`, real HTTP on
loopback), a real generation server and a real Redis: whatever the API does, no group is ever
appended with a partial or a default reward. A batch the API fails is scored again (not
generated again), then split; a group the API keeps failing while it scores the others is
dropped: dead-lettered (the learner feeds a replacement) and counted. An API that is down is
waited for (breaker open), and nothing is dropped.

`test_measure_each_failure_mode` prints, per failure mode, the requests the API got, the
batches scored again, the groups dropped and the times to detect and recover
(`pytest -s tests/rollout/test_reward_api_failures.py -k measure`; with RLHF_REWARD_API_BENCH=1
also with one request per Score call, the least load)."""

import itertools
import logging
import os
import threading
import time

import pytest

from services.common.config import config_from_dict
from services.common.replay import ReplayStore
from services.common.replay.records import group_from_proto, make_task
from services.common.replay.streams import WORKERS_GROUP
from services.generation.server import serve as serve_generation
from services.reward.server import serve as serve_reward
from services.rollout.worker import RolloutWorker
from services.training.sources.synthetic import reverse_task
from tests.grpc_helpers import on_free_ports
from tests.reward.fault_api import FaultAPI

GROUP = 2
_ns = itertools.count()
# the HTTP timeout is long: a loopback answer on a busy machine must never look like a failure (the
# exact request counts below would change); only the measurement's "hang" mode waits one out
REWARD = {
    "http_timeout_s": 10.0,
    "http_retries": 1,
    "http_backoff_s": 0.01,
    "http_max_backoff_s": 0.05,
    "http_breaker_failures": 3,
    "http_breaker_cooldown_s": 0.5,
    "group_retries": 1,
    "group_retry_wait_s": 0.05,
}


@pytest.fixture(scope="module")
def model_dir(untrained_model_dir):
    return untrained_model_dir


@pytest.fixture()
def api():
    a = FaultAPI()
    yield a
    a.close()


def _cfg(model_dir, redis_url, api_url, reward=None, rpc=None):
    return config_from_dict(
        {
            "model": {"path": model_dir, "device": "cpu"},
            "adv_estimator": "grpo",
            "num_return_sequences_in_group": GROUP,
            "rollout_batch_size": 4,
            "prompt_length": 16,
            "response_length": 4,
            "reward": {"type": "http", "http_url": api_url, **REWARD, **(reward or {})},
            "replay": {"url": redis_url, "namespace": f"rewardapi{next(_ns)}", "block_ms": 50, "heartbeat_s": 0.2},
            "rollout": {"retries": 2, "retry_backoff_s": 0.05},
            "rpc": {
                "generation": {"port": 0, "metrics_port": None},
                "reward": {"port": 0, "metrics_port": None, "http_port": None},
                "critic": {"port": 0, "metrics_port": None},
                "retry_backoff_s": 0.05,
                "retry_max_backoff_s": 0.2,
                **(rpc or {}),
            },
        }
    )


class System:
    """A reward server on `api`, a generation server, a worker, 4 prompts fed and claimed."""

    def __init__(self, cfg, n=4):
        self.cfg = cfg
        self._reward, self._generation = (
            serve_reward(on_free_ports(cfg, "reward")),
            serve_generation(on_free_ports(cfg, "generation")),
        )
        self.reward = self._reward.__enter__()
        cfg.rpc.reward.port = self.reward.server.port
        self.generation = self._generation.__enter__()
        self.store = ReplayStore.from_config(cfg)
        self.records = reverse_task("train", n)
        self.store.feed([make_task(r, 0, 0, 0, GROUP) for r in self.records])
        self.worker = RolloutWorker(cfg, ReplayStore.from_config(cfg), name="w1")
        self.entries, _ = self.store.claim_prompts("w1", 10, block_ms=50)
        assert len(self.entries) == n

    def breaker(self) -> dict:
        return self.reward.servicer.scorer.status()["breaker"]

    def metric(self, name, **labels) -> float:
        return self.worker.metrics.registry.get_sample_value(name, {"service": "rollout", **labels}) or 0.0

    def groups(self):
        return [group_from_proto(m) for _, m in self.store.read_trajectories(1000, block_ms=100)]

    def pending(self) -> int:
        return int(self.store.r.xpending(self.store.prompts, WORKERS_GROUP)["pending"])

    def close(self):
        self.store.reset()
        self._generation.__exit__(None, None, None)
        self._reward.__exit__(None, None, None)


@pytest.fixture()
def system(model_dir, redis_server, api):
    made = []

    def make(reward=None, rpc=None, n=4):
        made.append(System(_cfg(model_dir, redis_server.url, api.url, reward, rpc), n))
        return made[-1]

    yield make
    for s in made:
        s.close()


def assert_every_reward_is_the_apis(sys_, groups):
    """Each sample's reward is what FaultAPI answers for it (the length of prompt + response):
    none is a default."""
    tok = sys_.worker.tokenizer
    for g in groups:
        assert len(g.scores) == GROUP
        for c, s in zip(g.completions, g.scores):
            expected = float(len(g.record.prompt + tok.decode(c.token_ids, skip_special_tokens=True)))
            assert s.reward == expected and s.components == {"http": expected}, (g.uid, s)


def test_a_group_the_api_keeps_failing_is_dropped_and_counted_the_others_are_kept(system, api):
    """One prompt makes the API answer 500 every time. The batch's scoring is retried (once), the
    batch is split, the three other groups are appended with the API's rewards, the failing one is
    dead-lettered with the reason and counted; the breaker stays closed for everyone else."""
    s = system()
    poison = s.records[2]
    api.poison = (poison.prompt, "500")
    assert s.worker.process(s.entries) == 3
    groups = s.groups()
    assert sorted(g.uid for g in groups) == sorted(f"0:{r.id}" for r in s.records if r is not poison)
    assert_every_reward_is_the_apis(s, groups)
    dead = s.store.read_dead()
    assert [t.uid for _, t, _ in dead] == [f"0:{poison.id}"]
    assert "reward API" in dead[0][2] and "HTTP 500" in dead[0][2]
    assert (
        s.metric("rlhf_rollout_groups_dropped_total"),
        s.metric("rlhf_rollout_dead_letters_total"),
        s.metric("rlhf_rollout_score_retries_total"),
        s.metric("rlhf_rollout_groups_produced_total"),
    ) == (1, 1, 1, 3)
    # the batch: 2 tries of 2 attempts; alone: 3 prompts answered, the poison twice (1 + 1 retry)
    assert api.count() == 2 * 2 + 3 + 2
    assert s.breaker()["state"] == "closed"
    assert s.pending() == 0 and s.store.prompt_backlog() == 0  # every prompt produced or dead-lettered


def test_a_failure_that_passes_is_scored_again_without_generating_again(system, api):
    s = system()
    api.script = ["503", "503"]  # the batch's first try: both attempts fail; the second try answers
    assert s.worker.process(s.entries) == 4
    assert_every_reward_is_the_apis(s, s.groups())
    assert s.metric("rlhf_rollout_score_retries_total") == 1 and s.metric("rlhf_rollout_groups_dropped_total") == 0
    assert s.generation.servicer.batcher.batches == 1  # the samples were kept, only scored again
    assert s.store.read_dead() == [] and s.pending() == 0


@pytest.mark.parametrize("mode", ["503", "close", "401"])
def test_an_api_that_is_down_is_waited_for_and_nothing_is_dropped(system, api, mode):
    """Every request fails: the breaker opens, the worker waits for the reward server (as for a
    restart) without hammering the API, and after rpc.dependency_wait_s leaves the batch
    pending. Nothing appended, nothing dropped."""
    s = system(rpc={"dependency_wait_s": 1.5})
    api.mode = mode
    t0 = time.monotonic()
    assert s.worker.process(s.entries) == 0
    took = time.monotonic() - t0
    assert took >= 1.5
    assert s.breaker()["state"] in ("open", "half_open")
    assert s.store.read_dead() == [] and s.metric("rlhf_rollout_groups_dropped_total") == 0 and s.groups() == []
    assert s.pending() == 4
    # the breaker opened after 3 failed requests (a closed connection may be the input's: a body
    # retried counts once, the prompts tried alone count each); then at most one probe per cooldown
    # (0.5 s) for as long as the worker waited
    probes = int(took / REWARD["http_breaker_cooldown_s"]) + 1
    assert api.count() <= {"503": 3, "401": 3, "close": 2 * 2 + 2 + 1}[mode] + probes, (api.count(), took)


def test_an_api_that_comes_back_is_used_again(system, api):
    s = system(rpc={"dependency_wait_s": 30})
    api.mode = "503"
    threading.Timer(1.0, lambda: setattr(api, "mode", "ok")).start()
    assert s.worker.process(s.entries) == 4
    assert_every_reward_is_the_apis(s, s.groups())
    assert s.breaker()["state"] == "closed" and s.store.read_dead() == []


def test_an_outage_found_while_splitting_the_batch_drops_nothing(system, api):
    """The API fails every request (a 500 each, which alone never opens the breaker for a body
    retried): no prompt can be scored alone either, so none is blamed; all stay pending."""
    s = system(reward={"http_breaker_failures": 0})
    api.mode = "500"
    assert s.worker.process(s.entries) == 0
    assert s.store.read_dead() == [] and s.metric("rlhf_rollout_groups_dropped_total") == 0
    assert s.metric("rlhf_rollout_errors_total", kind="reward_api") == 1
    assert s.pending() == 4


# ------------------------------------------------------------------------------------------- measurement
class _Opened(logging.Handler):
    def __init__(self):
        super().__init__()
        self.opened = self.closed = None

    def emit(self, record):
        msg = record.getMessage()
        if "circuit open after" in msg and self.opened is None:
            self.opened = time.monotonic()
        if "circuit closed" in msg:
            self.closed = time.monotonic()


MODES = [  # name, what the API does, for how long (s; None = for good, for one prompt)
    ("500", {"mode": "500"}, 3.0),
    ("429 + Retry-After: 1", {"mode": "429", "retry_after": "1"}, 3.0),
    ("hang", {"mode": "hang"}, 3.0),
    ("closed connection", {"mode": "close"}, 3.0),
    ("401", {"mode": "401"}, 3.0),
    ("400 for one prompt", {"poison": "400"}, None),
    ("500 for one prompt", {"poison": "500"}, None),
]


def test_measure_each_failure_mode(system, api, capsys):
    """Production-like settings scaled down (timeout 2 s, 3 retries, breaker 5 / 1 s, 2 group
    retries 0.5 s apart), one batch of 4 prompts x 2 samples in flight, sent as 4 requests of 2
    samples (or 1 of 8). Per mode: requests the API got, batches scored again, groups dropped,
    time from the failure's start to the breaker opening (detect) and from the API's recovery to
    the batch appended (recover). An outage drops nothing; one bad input loses its group only."""
    rows = []
    loads = (8, 2) if os.environ.get("RLHF_REWARD_API_BENCH") else (2,)
    for (name, how, outage), per_request in itertools.product(MODES, loads):
        api.requests.clear()
        api.mode, api.poison, api.retry_after, api.script = "ok", None, None, []
        s = system(
            reward={
                "http_timeout_s": 2.0,
                "http_retries": 3,
                "http_backoff_s": 0.05,
                "http_max_backoff_s": 0.5,
                "http_breaker_failures": 5,
                "http_breaker_cooldown_s": 1.0,
                "group_retries": 2,
                "group_retry_wait_s": 0.5,
            },
            rpc={"dependency_wait_s": 60},
        )
        s.reward.servicer.scorer.batch_size = per_request  # 8 samples: 1 request per Score call, or 4
        watch = _Opened()
        logging.getLogger("services.reward.http_scorer").addHandler(watch)
        try:
            api.retry_after = how.get("retry_after")
            poison = s.records[1]
            if "poison" in how:
                api.poison = (poison.prompt, how["poison"])
            else:
                api.mode = how["mode"]
                threading.Timer(outage, lambda: setattr(api, "mode", "ok")).start()
            t0 = time.monotonic()
            appended = s.worker.process(s.entries)
            t_done = time.monotonic()
        finally:
            logging.getLogger("services.reward.http_scorer").removeHandler(watch)
            api.poison = None
        groups = s.groups()
        assert_every_reward_is_the_apis(s, groups)
        dropped = int(s.metric("rlhf_rollout_groups_dropped_total"))
        dead = s.store.read_dead()
        assert appended + len(dead) + s.pending() == 4 and len(groups) == appended
        if outage is not None:
            assert appended == 4 and dead == [], name  # an outage drops nothing
            in_outage = sum(1 for r in api.requests if r["t"] < t0 + outage)
        else:
            assert appended == 3 and [t.uid for _, t, _ in dead] == [f"0:{poison.id}"], name
            in_outage = None
        rows.append(
            (
                name + (f", {outage:g} s" if outage else ""),
                8 // per_request,
                len(api.requests),
                in_outage,
                int(s.metric("rlhf_rollout_score_retries_total")),
                len(dead),
                dropped,
                f"{watch.opened - t0:.2f}" if watch.opened else "-",
                f"{t_done - (t0 + outage):.2f}" if outage is not None else "-",
                f"{t_done - t0:.2f}",
            )
        )
    with capsys.disabled():
        print(
            "\n| API fails | requests per Score | API requests (in the outage) | batches scored again | "
            "dead-lettered | of which dropped by the reward API | breaker open after s | appended s after the "
            "API is back | batch s |\n|" + "---|" * 9
        )
        for r in rows:
            print(
                f"| {r[0]} | {r[1]} | {r[2]} ({r[3] if r[3] is not None else '-'}) | {r[4]} | {r[5]} | {r[6]} | "
                f"{r[7]} | {r[8]} | {r[9]} |"
            )
