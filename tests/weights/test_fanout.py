"""Publisher.push: one encoding of a version streamed to every live server in parallel;
a server that cannot be reached fails alone, the others serve the new version."""

from types import SimpleNamespace

import torch

from services.generation.server import serve
from tests.grpc_helpers import closed, on_free_ports, publisher


def test_one_encoding_reaches_every_server_and_a_dead_one_fails_alone(cfg, tiny_model_dir):
    from services.generation.backend import HFBackend

    with (
        serve(on_free_ports(cfg, "generation"), backend=HFBackend(tiny_model_dir, "cpu")) as a,
        serve(on_free_ports(cfg, "generation"), backend=HFBackend(tiny_model_dir, "cpu")) as b,
    ):
        state = {k: v.clone() + 0.01 for k, v in a.servicer.backend.model.state_dict().items()}
        servers = [f"127.0.0.1:{a.server.port}", "127.0.0.1:1", f"127.0.0.1:{b.server.port}"]
        beats = []
        store = SimpleNamespace(
            live=lambda kind: {s: {} for s in servers},
            heartbeat=lambda kind, addr, policy_version: beats.append((addr, policy_version)),
            publish_learner=lambda *a: None,
        )
        learner = SimpleNamespace(policy_state_dict=lambda: state, device=torch.device("cpu"), lora=False)
        bc = publisher(cfg.model_copy(update={"rpc": cfg.rpc.model_copy(update={"timeout_s": 5})}), store, learner)
        try:
            out = bc.push(3, "learner:1")
        finally:
            closed(bc)
        assert out["push/servers"] == 3 and out["push/failed"] == 1
        assert sorted(beats) == sorted([(servers[0], 3), (servers[2], 3)])
        for svc in (a, b):
            assert svc.servicer.backend.policy_version == 3
            got = svc.servicer.backend.model.state_dict()
            assert all(torch.equal(got[k], state[k]) for k in state)
