"""LoRA pushes: with model.lora.rank > 0 only the merged LoRA-targeted modules change, so a server
whose other tensors are provably the run's base (it loaded model.path, or holds a full version of
this run) gets only those ("partial"), over gRPC or shared memory alike, and ends with exactly the
full merged policy. A server that cannot take partial versions (vLLM) or whose base is not
provably this run's gets the full policy; PullWeights still serves the full policy."""

import os
from types import SimpleNamespace

import pytest
import torch

from services.common.config import config_from_dict
from services.generation.backend import HFBackend
from services.generation.server import serve
from services.learner.trainer import PolicyTrainer
from tests.grpc_helpers import closed, on_free_ports, publisher
from tests.weights.test_publisher import Registry, _serves, with_shm


def lora_policy(model_dir):
    """A LoRA (rank 4) GRPO learner on `model_dir` (test_push_parity.py's too)."""
    cfg = config_from_dict(
        {
            "model": {"path": model_dir, "device": "cpu", "lora": {"rank": 4}},
            "adv_estimator": "grpo",
            "num_return_sequences_in_group": 2,
        }
    )
    return PolicyTrainer(cfg)


@pytest.fixture(scope="module")
def learner(tiny_model_dir):
    return lora_policy(tiny_model_dir)


def _train(learner, seed):
    """Stands in for an update: new adapter weights (B starts at 0, so the merge would be the base)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in learner.policy.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)


def test_the_delta_is_the_merged_targets_of_the_full_state(learner):
    _train(learner, 0)
    full, delta = learner.policy_state_dict(), learner.policy_delta_state_dict()
    targets = tuple(learner.cfg.model.lora.target_modules)
    assert delta and set(delta) < set(full)
    assert all(k.endswith(".weight") and k.split(".")[-2] in targets for k in delta)
    assert {k for k in full if k.split(".")[-2] in targets and k.endswith(".weight")} == set(delta)
    assert all(torch.equal(delta[k], full[k]) for k in delta)


class _Registry(Registry):
    """The servers' entries, with the entry of some overridden (a vLLM server, another base)."""

    def __init__(self, services, overrides):
        super().__init__(services)
        self.overrides = overrides

    def live(self, kind):
        entries = super().live(kind)
        for i, s in enumerate(self.services):
            entries[f"127.0.0.1:{s.server.port}"].update(self.overrides.get(i, {}))
        return entries


def test_lora_pushes_send_only_the_targets_where_the_base_is_proven(cfg, learner, tiny_model_dir, tmp_path):
    local, remote = with_shm(cfg, tmp_path / "shm"), with_shm(cfg, tmp_path / "elsewhere")
    servers = [
        serve(on_free_ports(c, "generation"), backend=HFBackend(tiny_model_dir, "cpu")).start()
        for c in (local, remote, remote, remote)
    ]
    # 0: co-located, fresh (model.path); 1: remote, fresh; 2: a vLLM server (whole policies only);
    # 3: its weights came from another run
    registry = _Registry(servers, {2: {"partial": False}, 3: {"base": "run:another-run"}})
    bc = publisher(local, registry, learner)
    bc.identity = ("run-a", 1)
    try:
        _train(learner, 1)
        out = bc.push(1, "learner:1")
        full = learner.policy_state_dict()
        full_bytes = sum(t.numel() * t.element_size() for t in full.values())
        delta_bytes = sum(t.numel() * t.element_size() for t in learner.policy_delta_state_dict().values())
        assert (out["push/failed"], out["push/partial"], out["push/shm"]) == (0, 2, 1)
        assert out["push/bytes"] == 2 * delta_bytes + 2 * full_bytes
        for s in servers:
            assert s.servicer.backend.policy_version == 1 and _serves(s, full)
        print(f"partial push: {delta_bytes} of {full_bytes} bytes ({delta_bytes / full_bytes:.3f})")
        assert delta_bytes < full_bytes / 2
        # server 3 now holds a full version of this run: from now on it gets partial ones too
        assert [info["base"] for a, info in registry.beats if a.endswith(str(servers[3].server.port))] == ["run:run-a"]
        registry.overrides.pop(3)
        _train(learner, 2)
        out = bc.push(2, "learner:1")
        full = learner.policy_state_dict()
        assert (out["push/failed"], out["push/partial"]) == (0, 3)
        for s in servers:
            assert s.servicer.backend.policy_version == 2 and _serves(s, full)
        # late joiners pull the full policy
        policy_version, pulled = bc.snapshot
        assert policy_version == 2 and set(pulled) == set(full) and all(torch.equal(pulled[k], full[k]) for k in full)
        assert [p for p in os.listdir(tmp_path / "shm") if p.startswith("rlhf-weights-")] == [
            "rlhf-weights-run_a-e1-v2-partial.safetensors"
        ]
    finally:
        closed(bc)
        for s in servers:
            s.stop()


def test_without_lora_every_push_is_full(cfg, tiny_model_dir):
    with serve(on_free_ports(cfg, "generation"), backend=HFBackend(tiny_model_dir, "cpu")) as svc:
        state = {k: v + 0.01 for k, v in svc.servicer.backend.model.state_dict().items()}
        learner = SimpleNamespace(
            policy_state_dict=lambda: state, device=torch.device("cpu"), lora=False, policy_delta_state_dict=lambda: {}
        )
        bc = publisher(cfg, Registry([svc]), learner)
        try:
            out = bc.push(1, "learner:1")
        finally:
            closed(bc)
        assert out["push/partial"] == 0 and _serves(svc, state)
