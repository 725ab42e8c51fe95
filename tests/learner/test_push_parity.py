"""The push parity check (rpc.push_parity) on real generation servers over loopback gRPC: after a
push through the learner's `PushSink`, every server scores the probe batch and the learner compares
with its own log-probs. A clean push stays silent (float32 and bfloat16 servers, full and LoRA
pushes); a push that did not land raises the alarm: a stale server (its push failed), a tensor left
out of a full push (refused, so stale), a LoRA target left out of a partial push, an adapter not
merged. With on_mismatch: stop the run stops with a sentence naming the server and the version."""

import logging

import pytest
import torch
from prometheus_client import CollectorRegistry

from services.common.model_files import load_causal_lm, load_tokenizer
from services.generation.backend import HFBackend
from services.generation.server import serve
from services.learner.metrics import LearnerMetrics
from services.learner.parity import PushParity, PushParityFailed
from services.learner.sink import PushSink
from tests.grpc_helpers import closed, on_free_ports, publisher
from tests.learner.test_lora_push import lora_policy
from tests.weights.test_publisher import Registry

TEXTS = ["ab=", "abc=", "ba=", "cab="]


class Store(Registry):
    """The replay store as the sink and the publisher use it: the servers' entries, the version counter."""

    version = 0

    def next_version(self) -> int:
        self.version += 1
        return self.version


class Learner:
    """What the publisher and the check read of a `PolicyTrainer` without LoRA: its policy and its weights."""

    lora, sharded = False, False
    device = torch.device("cpu")

    def __init__(self, path):
        self.policy = load_causal_lm(path).eval()

    def policy_state_dict(self):
        return {k: v.detach().clone() for k, v in self.policy.state_dict().items()}

    def train(self, seed: int) -> None:
        """Stands in for an update: every weight moves (enough that the old version is far)."""
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in self.policy.parameters():
                p.add_(torch.randn(p.shape, generator=g) * 0.02)


def _cfg(cfg, **parity):
    out = cfg.model_copy(deep=True)
    out.rpc.push_parity = out.rpc.push_parity.model_copy(update={"every": 1, **parity})
    return out


class Run:
    """Generation servers (one per dtype given), the learner's publisher over them, and its sink
    with the parity check: what `LearnerLoop` wires, without Redis."""

    def __init__(self, cfg, model_dir, learner, dtypes=(torch.float32,)):
        self.servers = [
            serve(on_free_ports(cfg, "generation"), backend=HFBackend(model_dir, "cpu", dt)).start() for dt in dtypes
        ]
        self.addresses = [f"127.0.0.1:{s.server.port}" for s in self.servers]
        self.store = Store(self.servers)
        self.publisher = publisher(cfg, self.store, learner)
        self.metrics = LearnerMetrics(CollectorRegistry())
        self.parity = PushParity(cfg, self.publisher.servers.client, TEXTS, load_tokenizer(model_dir), self.metrics)
        self.sink = PushSink(self.store, self.publisher, "run-a", self.parity)
        self.sink.fence = lambda: None
        self.publisher.identity = ("run-a", 1)
        self.learner = learner

    def publish(self) -> dict:
        return self.sink.publish(self.learner)[1]

    def failures(self, i: int) -> float | None:
        return self.metrics.registry.get_sample_value(
            "rlhf_push_parity_failures_total", {"service": "learner", "server": self.addresses[i]}
        )

    def gauge(self, name: str, i: int) -> float | None:
        return self.metrics.registry.get_sample_value(name, {"service": "learner", "server": self.addresses[i]})

    def close(self) -> None:
        closed(self.publisher)
        for s in self.servers:
            s.stop()


@pytest.fixture
def run(cfg, tiny_model_dir, request):
    made = []

    def make(learner=None, dtypes=(torch.float32,), **parity):
        r = Run(_cfg(cfg, **parity), tiny_model_dir, learner or Learner(tiny_model_dir), dtypes)
        made.append(r)
        return r

    yield make
    for r in made:
        r.close()


def _warnings(caplog):
    return [
        r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and r.name == "services.learner.parity"
    ]


def test_every_says_which_pushes_are_checked(cfg):
    def due(every, n):
        p = PushParity(_cfg(cfg, every=every), lambda a: None, TEXTS, None)
        return [p.due() for _ in range(n)]

    assert due(3, 7) == [True, False, False, True, False, False, True]  # the first push always
    assert due(1, 3) == [True] * 3 and due(0, 3) == [False] * 3


def test_a_clean_push_stays_silent_on_float32_and_bfloat16_servers(run, caplog):
    r = run(dtypes=(torch.float32, torch.bfloat16))
    caplog.set_level(logging.INFO, logger="services.learner.parity")
    for seed in (0, 1):
        r.learner.train(seed)
        m = r.publish()
        assert (m["push/failed"], m["push/parity_servers"], m["push/parity_failures"]) == (0, 2, 0)
    assert _warnings(caplog) == []
    assert [r.failures(i) for i in range(2)] == [0.0, 0.0]
    s = r.parity.settings
    assert r.gauge("rlhf_push_parity_mean_abs", 0) < s.max_mean_abs  # float32: the same numbers
    assert 0 < r.gauge("rlhf_push_parity_mean_abs", 1) < s.max_mean_abs_bf16  # bfloat16's rounding only
    assert m["push/parity_max_abs"] == max(r.gauge("rlhf_push_parity_max_abs", i) for i in range(2))
    assert 0 <= m["push/parity_kl"] < 0.01 and m["push/parity_s"] > 0
    assert any("push parity v2: 2 server(s) serve it" in x.getMessage() for x in caplog.records)


def test_a_server_whose_push_failed_raises_the_alarm(run, caplog, monkeypatch):
    r = run(dtypes=(torch.float32, torch.float32))

    def refuse(state, version):
        raise RuntimeError("out of memory (a test)")

    monkeypatch.setattr(r.servers[1].servicer.backend, "update_weights", refuse)
    r.learner.train(0)
    m = r.publish()
    assert (m["push/failed"], m["push/parity_servers"], m["push/parity_failures"]) == (1, 2, 1)
    assert (r.failures(0), r.failures(1)) == (0.0, 1.0)
    [warning] = _warnings(caplog)
    assert f"generation server {r.addresses[1]} does not serve the pushed policy version 1" in warning
    assert "it scored the probe with version 0" in warning


def test_a_tensor_left_out_of_a_full_push_raises_the_alarm(run, caplog, monkeypatch):
    """A full version must hold every tensor: the servers refuse it and keep serving the old one."""
    r = run()
    r.learner.train(0)
    whole = r.learner.policy_state_dict
    monkeypatch.setattr(
        r.learner, "policy_state_dict", lambda: {k: v for k, v in whole().items() if k != "model.norm.weight"}
    )
    m = r.publish()
    assert (m["push/failed"], m["push/parity_failures"]) == (1, 1)
    assert "scored the probe with version 0" in _warnings(caplog)[0]


def test_with_stop_the_run_stops_naming_the_server_and_the_version(run, monkeypatch):
    r = run(dtypes=(torch.float32, torch.float32), on_mismatch="stop")
    r.learner.train(0)
    r.publish()  # clean
    monkeypatch.setattr(r.servers[0].servicer.backend, "update_weights", lambda *a: 1 / 0)
    r.learner.train(1)
    with pytest.raises(PushParityFailed) as e:
        r.publish()
    assert str(e.value) == (
        f"the run stops (rpc.push_parity.on_mismatch: stop): generation server {r.addresses[0]} does not serve "
        "the pushed policy version 2: it scored the probe with version 1 (a push it did not take)"
    )
    assert r.failures(0) == 1.0


def test_a_server_that_cannot_score_is_skipped_not_alarmed(run, caplog, monkeypatch):
    r = run(dtypes=(torch.float32, torch.float32))
    monkeypatch.setattr(r.servers[1].servicer.backend, "scores_tokens", False)
    for seed in (0, 1):
        r.learner.train(seed)
        m = r.publish()
        assert (m["push/parity_servers"], m["push/parity_failures"]) == (1, 0)
    [warning] = _warnings(caplog)  # said once
    assert f"{r.addresses[1]} cannot score tokens, not checked" in warning


# ---------------------------------------------------------------- LoRA: partial pushes of the merged targets
@pytest.fixture(scope="module")
def lora_learner(tiny_model_dir):
    return lora_policy(tiny_model_dir)


def _train_lora(learner, seed):
    """Stands in for an update: new adapter weights (B starts at 0, so the merge would be the base)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in learner.policy.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)


def test_a_clean_lora_push_stays_silent(run, lora_learner, caplog):
    r = run(lora_learner)
    _train_lora(lora_learner, 0)
    m = r.publish()
    assert (m["push/partial"], m["push/parity_servers"], m["push/parity_failures"]) == (1, 1, 0)
    assert m["push/parity_mean_abs"] < r.parity.settings.max_mean_abs and _warnings(caplog) == []


def test_a_lora_target_left_out_of_a_partial_push_raises_the_alarm(run, lora_learner, caplog, monkeypatch):
    r = run(lora_learner)
    _train_lora(lora_learner, 1)
    merged = lora_learner.policy_delta_state_dict
    monkeypatch.setattr(
        lora_learner,
        "policy_delta_state_dict",
        lambda: {k: v for k, v in merged().items() if k != "model.layers.0.self_attn.v_proj.weight"},
    )
    m = r.publish()
    assert (m["push/failed"], m["push/partial"], m["push/parity_failures"]) == (0, 1, 1)  # taken, and wrong
    assert "differ from the learner's by" in _warnings(caplog)[0] and "float32 engine" in _warnings(caplog)[0]


def test_an_adapter_not_merged_raises_the_alarm(run, lora_learner, caplog, monkeypatch):
    from peft.tuners.lora import LoraLayer

    def unmerged(policy):  # the targets' base weights, the adapters left out
        return {
            f"{name}.weight": module.get_base_layer().weight.detach().clone()
            for name, module in policy.get_base_model().named_modules()
            if isinstance(module, LoraLayer)
        }

    r = run(lora_learner)
    _train_lora(lora_learner, 2)
    monkeypatch.setattr("services.learner.trainer.merged_lora_weights", unmerged)
    m = r.publish()
    assert (m["push/failed"], m["push/parity_failures"]) == (0, 1)
    assert r.failures(0) == 1.0 and m["push/parity_mean_abs"] > 10 * r.parity.settings.max_mean_abs
