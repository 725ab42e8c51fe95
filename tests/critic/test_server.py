import os
import time

import grpc
import pytest
import torch

from services.common.rpc.codec import batch_to_proto, tensor_to_proto
from services.common.rpc.gen import critic_pb2 as cpb
from services.common.token_batch import build_token_batch
from services.critic.client import CriticClient
from services.critic.critic import Critic
from services.critic.server import serve
from tests.grpc_helpers import expect_code, on_free_ports


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("critic-root")


@pytest.fixture(scope="module")
def server(cfg, root):
    with serve(on_free_ports(cfg, "critic"), root=root) as svc:
        yield svc.server


@pytest.fixture()
def fresh(cfg, tmp_path):
    """A critic server of its own on an empty checkpoint root (tmp_path/'run'); yields a client."""
    with serve(on_free_ports(cfg, "critic"), root=tmp_path / "run") as svc:
        c = CriticClient(f"127.0.0.1:{svc.server.port}", cfg.rpc)
        yield c
        c.close()


def _batch():
    return build_token_batch([[1, 4, 5, 30], [1, 6, 30]], [[5, 4, 2], [6]], 0)


def _train(c, b, target=2.0):
    return c.train_step(b, b.response_mask * target, c.values(b))


def test_values_train_save_load_match_in_process(server, cfg, root):
    c = CriticClient(f"127.0.0.1:{server.port}", cfg.rpc)
    local = Critic.from_config(cfg)
    b = _batch()
    assert torch.allclose(c.values(b), local.values(b), atol=1e-6)
    returns = b.response_mask * 2.0
    m_remote = c.train_step(b, returns, c.values(b))
    m_local = local.train_step(b, returns, local.values(b))
    assert m_remote["critic/vf_loss"] == pytest.approx(m_local["critic/vf_loss"], rel=1e-5)
    assert torch.allclose(c.values(b), local.values(b), atol=1e-5)
    assert c.save("ck") == 1
    assert (root / "ck" / "critic_optim.pt").is_file()
    c.train_step(b, returns, c.values(b))
    assert c.load("ck") == 1
    assert torch.allclose(c.values(b), local.values(b), atol=1e-5)


def test_bad_critic_input(server, cfg, tmp_path):
    c = CriticClient(f"127.0.0.1:{server.port}", cfg.rpc)
    b = _batch()
    call = lambda req: c.stub.Train(req, metadata=c.metadata)  # noqa: E731
    nan = b.response_mask.clone()
    nan[0, 0] = float("nan")
    expect_code(
        lambda: call(
            cpb.TrainRequest(
                batch=batch_to_proto(b), returns=tensor_to_proto(nan), old_values=tensor_to_proto(b.response_mask)
            )
        ),
        grpc.StatusCode.INVALID_ARGUMENT,
        "returns: contains NaN",
    )
    expect_code(
        lambda: call(
            cpb.TrainRequest(
                batch=batch_to_proto(b),
                returns=tensor_to_proto(torch.zeros(2, 5)),
                old_values=tensor_to_proto(b.response_mask),
            )
        ),
        grpc.StatusCode.INVALID_ARGUMENT,
        "returns: shape [2, 5], expected [2, 3]",
    )
    big = build_token_batch([[1, 99999]], [[4]], 0)
    expect_code(
        lambda: c.stub.Values(cpb.ValuesRequest(batch=batch_to_proto(big)), metadata=c.metadata),
        grpc.StatusCode.INVALID_ARGUMENT,
        "token id 99999 outside the vocabulary",
    )
    long = build_token_batch([[1] * 40], [[4]], 0)
    expect_code(
        lambda: c.stub.Values(cpb.ValuesRequest(batch=batch_to_proto(long)), metadata=c.metadata),
        grpc.StatusCode.INVALID_ARGUMENT,
        "prompt_length=32",
    )
    expect_code(
        lambda: c.stub.Values(cpb.ValuesRequest(), metadata=c.metadata),
        grpc.StatusCode.INVALID_ARGUMENT,
        "batch.input_ids: missing",
    )
    expect_code(lambda: c.load("none"), grpc.StatusCode.INVALID_ARGUMENT, "no critic checkpoint")
    assert c.values(b).shape == (2, 3)  # still serving


def test_huge_targets_are_refused_and_the_critic_stays_finite(fresh):
    b = _batch()
    _train(fresh, b)
    before = fresh.values(b)
    huge = b.response_mask * 3.4e38
    for returns, old in ((huge, b.response_mask), (-huge, b.response_mask), (b.response_mask, huge)):
        expect_code(lambda: fresh.train_step(b, returns, old), grpc.StatusCode.INVALID_ARGUMENT, "max_abs_target")
    after = fresh.values(b)
    assert torch.isfinite(after).all() and torch.equal(after, before)
    assert fresh.info().step == 1
    _train(fresh, b)  # still trains
    assert fresh.info().step == 2


def test_a_non_finite_step_is_refused_not_taken(cfg, tmp_path):
    """With the bound lifted, the loss overflows to inf: the step is refused, not taken."""
    loose = cfg.model_copy(update={"critic": cfg.critic.model_copy(update={"max_abs_target": 1e39})})
    with serve(on_free_ports(loose, "critic"), root=tmp_path) as svc:
        c = CriticClient(f"127.0.0.1:{svc.server.port}", cfg.rpc)
        b = _batch()
        before = c.values(b)
        expect_code(
            lambda: c.train_step(b, b.response_mask * 3.4e38, before),
            grpc.StatusCode.INVALID_ARGUMENT,
            "critic step skipped",
        )
        assert torch.equal(c.values(b), before) and c.info().step == 0


BAD_PATHS = [
    ("", "path: empty"),
    ("ABS", "must be relative"),
    ("../ck", "without '..'"),
    ("a/../../ck", "without '..'"),
    ("a/../ck", "without '..'"),
    ("ck\0x", "NUL"),
    ("c" * 1025, "more than 1024"),
    (".", "inside the checkpoint root"),
    ("link/ck", "inside the checkpoint root"),
]  # link -> a directory outside the root


def test_checkpoint_paths_stay_under_the_root(fresh, tmp_path):
    run, outside = tmp_path / "run", tmp_path / "outside"
    outside.mkdir()
    run.mkdir(exist_ok=True)
    os.symlink(outside, run / "link")
    for path, fragment in BAD_PATHS:
        path = str(outside / "ck") if path == "ABS" else path
        for rpc in (fresh.save, fresh.load):
            expect_code(lambda: rpc(path), grpc.StatusCode.INVALID_ARGUMENT, fragment)
    assert not list(outside.iterdir())
    (run / "file").write_text("x")
    expect_code(lambda: fresh.save("file/ck"), grpc.StatusCode.INVALID_ARGUMENT, "file/ck")
    assert fresh.save("a/ck") == 0 and (run / "a" / "ck" / "value_head.safetensors").is_file()


def _reshape_optim_state(f):
    state = torch.load(f, weights_only=True)
    for s in state["optimizer"]["state"].values():
        s["exp_avg"] = torch.zeros(3, 3)
    torch.save(state, f)


@pytest.mark.parametrize(
    "file, damage",
    [
        ("critic_optim.pt", lambda f: f.unlink()),
        ("critic_optim.pt", lambda f: f.write_bytes(b"\0garbage" * 10)),
        ("critic_optim.pt", _reshape_optim_state),
        ("value_head.safetensors", lambda f: f.write_bytes(b"\0garbage" * 10)),
        ("model.safetensors", lambda f: f.write_bytes(b"\0garbage" * 10)),
    ],
)
def test_a_failed_load_leaves_the_critic_unchanged(fresh, tmp_path, file, damage):
    b = _batch()
    _train(fresh, b)
    fresh.save("ck")
    _train(fresh, b, target=5.0)
    before = fresh.values(b)
    damage(tmp_path / "run" / "ck" / file)
    expect_code(
        lambda: fresh.load("ck"),
        grpc.StatusCode.INVALID_ARGUMENT,
        "backbone model files" if file == "model.safetensors" else file,
    )
    assert torch.equal(fresh.values(b), before)
    info = fresh.info()
    assert info.step == 2 and info.loaded_from == ""
    _train(fresh, b)  # still trains
    assert fresh.info().step == 3


def test_info_names_the_incarnation_and_the_loaded_checkpoint(fresh):
    info = fresh.info()
    assert info.step == 0 and info.loaded_from == "" and len(info.incarnation) == 32
    assert time.time() - 120 < info.started_at <= time.time()
    b = _batch()
    _train(fresh, b)
    fresh.save("checkpoints/iter_000001/critic")
    assert fresh.load("checkpoints/iter_000001/critic") == 1
    again = fresh.info()
    assert (again.step, again.loaded_from, again.incarnation) == (1, "checkpoints/iter_000001/critic", info.incarnation)


def test_a_restarted_critic_resumes_from_the_newest_complete_checkpoint(cfg, tmp_path):
    b = _batch()
    run = tmp_path / "run"
    with serve(on_free_ports(cfg, "critic"), root=run) as svc:
        c = CriticClient(f"127.0.0.1:{svc.server.port}", cfg.rpc)
        first = c.info().incarnation
        for it in (1, 2, 3):
            _train(c, b, target=float(it))
            c.save(f"checkpoints/iter_{it:06d}/critic")
            if it < 3:  # iteration 3's learner state was never written: incomplete
                (run / "checkpoints" / f"iter_{it:06d}" / "learner.pt").write_bytes(b"")
                expected = c.values(b)
        (run / "checkpoints" / "iter_000004").mkdir()
        (run / "checkpoints" / "iter_000004" / "learner.pt").write_bytes(b"")  # no critic/
    with serve(on_free_ports(cfg, "critic"), root=run) as svc:
        c = CriticClient(f"127.0.0.1:{svc.server.port}", cfg.rpc)
        info = c.info()
        assert (info.step, info.loaded_from) == (2, "checkpoints/iter_000002/critic")
        assert info.incarnation != first
        assert torch.equal(c.values(b), expected)
    with serve(on_free_ports(cfg, "critic"), root=tmp_path / "empty") as svc:
        info = CriticClient(f"127.0.0.1:{svc.server.port}", cfg.rpc).info()
        assert (info.step, info.loaded_from) == (0, "")


def test_a_run_without_a_critic_gets_an_idle_critic_server(cfg, tmp_path):
    """adv_estimator grpo uses no critic: the critic server Docker Compose and Kubernetes always
    start is healthy but loads no model (here: none exists) and answers no Critic call."""
    from services.common.rpc import health

    idle = on_free_ports(cfg, "critic").model_copy(update={"adv_estimator": "grpo"})
    idle.model.path = str(tmp_path / "no-model")
    with serve(idle, root=tmp_path / "run") as svc:
        address = f"127.0.0.1:{svc.server.port}"
        assert health.check(address, "rlhf.v1.Critic", tls_ca=None)
        c = CriticClient(address, idle.rpc)
        expect_code(lambda: c.values(_batch()), grpc.StatusCode.UNIMPLEMENTED)
        c.close()
