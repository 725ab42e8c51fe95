"""KEDA's redis-streams trigger against a real Redis 7, started by the rendered Redis container's own
startup script (password required, AOF on): the XINFO GROUPS `lag` the lag-mode trigger reads grows
as the learner's feeder feeds prompts and falls to zero as workers claim and produce them (the
store's own claim_prompts/produce, as services/rollout/worker.py calls them), and the XPENDING count
the second trigger reads covers what lag cannot see: prompts claimed and not yet done. The metric is
read as KEDA's scaler reads it (pkg/scalers/redis_streams_scaler.go: INFO's major version >= 7,
XINFO GROUPS' entry for the consumer group, 0 when the stream does not exist, XLEN when the group
does not; XPENDING's count in pending mode; active when above activationLagCount)."""

from __future__ import annotations

import math
import os
import socket
import stat
import subprocess
import time
from pathlib import Path

import pytest
import redis

from . import manifests as m

OVERLAY = "cpu-tiny+keda"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def objs(docs):
    return docs[OVERLAY]


@pytest.fixture(scope="module")
def redis7(objs, tmp_path_factory):
    """The Redis StatefulSet's container script, run by sh with a Redis 7 server binary, its paths
    (/run/redis, /data) and port moved into a temporary directory: {port, password, dir, proc}."""
    server = m.redis7_server()
    sts = m.one(objs, "StatefulSet", "redis")
    c = m.pod_spec(sts)["containers"][0]
    env = m.container_env(c, sts, objs)
    script = m.expand(c["args"][0], env)
    d = tmp_path_factory.mktemp("redis7")
    (d / "conf").mkdir()
    (d / "data").mkdir()
    (d / "bin").mkdir()
    (d / "bin" / "redis-server").symlink_to(server)
    port = _free_port()
    mounts = {vm["mountPath"] for vm in c["volumeMounts"]}
    assert {"/run/redis", "/data"} <= mounts
    for old, new in (
        ("/run/redis", str(d / "conf")),
        ("dir /data", f"dir {d / 'data'}"),
        ("port 6379", f"port {port}\nbind 127.0.0.1"),
    ):
        assert old in script, old
        script = script.replace(old, new)
    proc = subprocess.Popen(
        [*c["command"], script],
        env={"PATH": f"{d / 'bin'}:{os.environ['PATH']}", **env},
        stdout=open(d / "redis.log", "w"),
        stderr=subprocess.STDOUT,
    )
    password = env["RLHF_REDIS_PASSWORD"]
    client = redis.Redis(host="127.0.0.1", port=port, password=password, socket_timeout=2)
    deadline, up = time.monotonic() + 120, False
    while not up and proc.poll() is None and time.monotonic() < deadline:
        try:
            up = client.ping()
        except redis.exceptions.ConnectionError:
            time.sleep(0.05)
    if not up:
        proc.kill()
        pytest.fail(f"Redis did not start:\n{(d / 'redis.log').read_text()}")
    assert proc.poll() is None, (d / "redis.log").read_text()
    yield {"port": port, "password": password, "dir": d, "proc": proc}
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def test_the_redis_container_runs_redis_7_with_a_password_and_aof(redis7):
    port, password, d = redis7["port"], redis7["password"], redis7["dir"]
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:  # no password: refused
        s.sendall(b"PING\r\n")
        assert s.recv(100).startswith(b"-NOAUTH")
    r = redis.Redis(host="127.0.0.1", port=port, password=password, decode_responses=True)
    assert int(r.info("server")["redis_version"].split(".")[0]) >= 7
    assert r.config_get("appendonly") == {"appendonly": "yes"}
    assert r.config_get("appendfsync") == {"appendfsync": "everysec"}
    assert r.config_get("save") == {"save": ""}
    assert Path(r.config_get("dir")["dir"]) == d / "data"
    conf = d / "conf" / "redis.conf"
    assert stat.S_IMODE(conf.stat().st_mode) == 0o600  # the password's file: its owner only
    cmdline = Path(f"/proc/{redis7['proc'].pid}/cmdline").read_bytes()
    assert password.encode() not in cmdline and b"redis-server" in cmdline


def keda_metric(r: redis.Redis, meta: dict) -> int | None:
    """What KEDA's redis-streams scaler reads for a trigger's metadata (None: XINFO GROUPS' lag is
    NULL, which KEDA's client reads as -1 or 0, i.e. nothing waiting)."""
    if "lagCount" in meta:
        assert int(r.info("server")["redis_version"].split(".")[0]) >= 7, "KEDA: redis version 7+ required for lag"
        try:
            groups = r.xinfo_groups(meta["stream"])
        except redis.ResponseError as e:
            if "no such key" in str(e):
                return 0
            raise
        for g in groups:
            name = g["name"].decode() if isinstance(g["name"], bytes) else g["name"]
            if name == meta["consumerGroup"]:
                return g["lag"]
        return r.xlen(meta["stream"])
    assert "pendingEntriesCount" in meta
    return r.xpending(meta["stream"], meta["consumerGroup"])["pending"]


class Keda:
    """The ScaledObject's triggers read on a Redis: each one's metric, activity, and the replicas
    the HPA KEDA creates would want (the maximum over triggers of ceil(metric / target))."""

    def __init__(self, so: dict, r: redis.Redis):
        self.so, self.r = so, r
        self.triggers = {t["name"]: t["metadata"] for t in so["spec"]["triggers"]}

    def read(self) -> dict:
        values = {name: keda_metric(self.r, meta) for name, meta in self.triggers.items()}
        lag, pending = values["prompts-waiting"], values["prompts-in-flight"]
        if lag is not None:  # the learner's rlhf_replay_prompts_waiting (the HPA's metric) is their sum
            assert self.r.xlen(self.triggers["prompts-waiting"]["stream"]) == lag + pending
        return values

    def active(self) -> bool:
        return any((v or 0) > int(self.triggers[n].get("activationLagCount", "0")) for n, v in self.read().items())

    def replicas(self) -> int:
        if not self.active():
            return self.so["spec"]["minReplicaCount"]
        want = 1
        for name, v in self.read().items():
            meta = self.triggers[name]
            target = int(meta.get("lagCount") or meta["pendingEntriesCount"])
            want = max(want, math.ceil(max(v or 0, 0) / target))
        return min(want, self.so["spec"]["maxReplicaCount"])


@pytest.fixture
def setup(objs, redis7, tmp_path):
    """(store, feeder, worker config, Keda reader) on a fresh replay namespace of the Redis above,
    with the configs the rendered learner and rollout containers resolve."""
    from services.common.replay.store import ReplayStore
    from services.learner.feeder import PromptFeeder
    from services.training.data import load_prompts

    learner_w = m.one(objs, "StatefulSet", "learner")
    rollout_w = m.one(objs, "Deployment", "rollout")
    (learner,) = [r for r in m.resolve(learner_w, m.pod_spec(learner_w)["containers"][0], objs, tmp_path)]
    (worker,) = [r for r in m.resolve(rollout_w, m.pod_spec(rollout_w)["containers"][0], objs, tmp_path)]
    url = f"redis://127.0.0.1:{redis7['port']}/0"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(worker.cfg.replay.password_env, worker.env[worker.cfg.replay.password_env])
        store = ReplayStore.from_config(worker.cfg, url=url)  # the worker's namespace and password
    store.reset()
    feeder = PromptFeeder(learner.cfg, store, load_prompts(learner.cfg.data.train, "train", seed=learner.cfg.run.seed))
    keda = Keda(m.one(objs, "ScaledObject", "rollout"), store.r)
    yield store, feeder, worker.cfg, keda
    store.reset()


def _group(task):
    from services.common.rpc.gen import replay_pb2 as rpb

    return rpb.TrajectoryGroup(task=task)


def _claim(store, name, n):
    entries, _ = store.claim_prompts(name, n, block_ms=10)
    return entries


def _produce(store, entries):
    assert store.produce([(e, _group(t)) for e, t in entries]) == [True] * len(entries)


def test_lag_grows_as_prompts_are_fed_and_falls_to_zero_as_workers_consume_them(setup, objs):
    from services.common.replay.streams import WORKERS_GROUP

    store, feeder, cfg, keda = setup
    meta = keda.triggers["prompts-waiting"]
    assert (meta["stream"], meta["consumerGroup"]) == (store.prompts, WORKERS_GROUP)
    batch, per_request = cfg.rollout_batch_size, cfg.rollout.prompts_per_request
    assert keda.read() == {"prompts-waiting": 0, "prompts-in-flight": 0} and not keda.active()
    assert keda.replicas() == 0  # nothing fed: scaled to zero
    feeder.feed(1, policy_version=0)  # the learner feeds iteration 1's batch
    assert keda.read() == {"prompts-waiting": batch, "prompts-in-flight": 0} and keda.active()
    feeder.feed(2, policy_version=0)
    assert keda.read()["prompts-waiting"] == 2 * batch
    assert keda.replicas() == math.ceil(2 * batch / int(meta["lagCount"]))
    # a worker claims a request's worth, then produces it (acknowledged and deleted in one script)
    held = _claim(store, "rollout-a", per_request)
    assert len(held) == per_request
    assert keda.read() == {"prompts-waiting": 2 * batch - per_request, "prompts-in-flight": per_request}
    _produce(store, held)
    assert keda.read() == {"prompts-waiting": 2 * batch - per_request, "prompts-in-flight": 0}
    while keda.read()["prompts-waiting"]:
        held = _claim(store, "rollout-a", per_request)
        assert held
        # all claimed: lag is 0, yet the claimed prompts are still being worked on
        assert keda.read()["prompts-in-flight"] == len(held) and keda.active()
        _produce(store, held)
    assert keda.read() == {"prompts-waiting": 0, "prompts-in-flight": 0}
    assert not keda.active() and keda.replicas() == 0
    assert store.prompt_queue() == (0, 0)


def test_lag_cannot_see_claimed_prompts_the_pending_trigger_does(setup):
    """Why the ScaledObject has the second trigger. (1) A worker killed before it produced leaves
    its prompts pending: lag is 0, so lag alone would let KEDA scale to zero with nobody left to
    reclaim them. (2) When the newest-delivered prompts are acknowledged before older ones
    (concurrent batches finishing out of order), Redis cannot count the lag (NULL) until the next
    claim: lag alone reads nothing waiting. Pending stays above zero in both, so KEDA keeps a worker."""
    from services.common.replay.store import ReplayStore

    store, feeder, cfg, keda = setup
    n = 6
    feeder._feed(n, policy_version=0)
    # (1) claimed by a worker that dies
    dead = _claim(store, "rollout-dead", n)
    assert keda.read() == {"prompts-waiting": 0, "prompts-in-flight": n}
    assert keda.active() and keda.replicas() >= 1
    rescuer = ReplayStore(store.r, store.ns, claim_idle_s=0.05)  # replay.claim_idle_s, shortened
    time.sleep(0.1)
    taken, reclaimed = rescuer.claim_prompts("rollout-new", n, block_ms=10)
    assert reclaimed == n and {e for e, _ in taken} == {e for e, _ in dead}
    _produce(rescuer, taken)
    assert keda.read() == {"prompts-waiting": 0, "prompts-in-flight": 0} and not keda.active()
    # (2) two workers' batches finish out of order while prompts wait
    feeder._feed(3 * n, policy_version=0)
    first, second = _claim(store, "rollout-a", n), _claim(store, "rollout-b", n)
    assert keda.read() == {"prompts-waiting": n, "prompts-in-flight": 2 * n}
    _produce(store, second)  # the newer batch is done first
    assert keda.read() == {"prompts-waiting": None, "prompts-in-flight": n}
    assert keda.active()  # the pending trigger
    third = _claim(store, "rollout-b", n // 2)  # the next claim makes the lag countable again
    assert keda.read() == {"prompts-waiting": n - n // 2, "prompts-in-flight": n + n // 2}
    _produce(store, first)
    _produce(store, third)
    _produce(store, _claim(store, "rollout-a", n))
    assert keda.read() == {"prompts-waiting": 0, "prompts-in-flight": 0}
