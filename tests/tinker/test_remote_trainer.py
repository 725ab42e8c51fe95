"""`tinker.trainer`: the Tinker API's training models live in a real trainer of its own (`rlhf serve
tinker-trainer`, gRPC over loopback, the tiny model), driven through the official SDK: a step lowers
the cross-entropy of its batch there, and the API holds no model of its own; a trained model's
sampler weights come from there and sample what it says; a state saved through it loads back into a
new model there; the trainer restarted between forward_backward and optim_step: the step is refused
with what to do, never half applied; an op sent twice steps once; what breaks the trainer's contract
is INVALID_ARGUMENT, a model it does not hold FAILED_PRECONDITION with its reason."""

from __future__ import annotations

import math
import time

import grpc
import numpy as np
import pytest
import tinker
from tinker import types

from services.common.config import config_from_dict
from services.common.rpc.errors import Reason, reason_of
from services.common.rpc.gen import trainer_pb2 as tpb
from services.tinker.server import serve
from services.tinker.trainer_server import serve as serve_trainer
from services.tinker.trainers import OverGrpc, RemoteModel, TrainerClient
from services.tinker.training import TrainingModel
from tests.grpc_helpers import TOKEN
from tests.tinker.test_tinker_api import KEY, _cfg, _datum, _loss, _proto

GREEDY = types.SamplingParams(max_tokens=6, temperature=0.0)


def _trainer_cfg(tiny_model_dir, root, port: int = 0):
    base = _cfg(tiny_model_dir, root).model_dump()
    base["rpc"]["tinker_trainer"] = {"host": "127.0.0.1", "port": port, "metrics_port": None}
    return config_from_dict(base)


def _api_cfg(tiny_model_dir, root, address: str):
    base = _cfg(tiny_model_dir, root).model_dump()
    base["tinker"] = {**base["tinker"], "trainer": address}
    return config_from_dict(base)


@pytest.fixture(scope="module")
def trainer(tiny_model_dir, tmp_path_factory):
    with serve_trainer(_trainer_cfg(tiny_model_dir, tmp_path_factory.mktemp("trainer"))) as svc:
        svc.address = f"127.0.0.1:{svc.server.port}"
        yield svc


@pytest.fixture(scope="module")
def api(tiny_model_dir, tmp_path_factory, trainer):
    svc = serve(_api_cfg(tiny_model_dir, tmp_path_factory.mktemp("tinker"), trainer.address)).start()
    svc.url = f"http://127.0.0.1:{svc.port}"
    yield svc
    svc.stop()


@pytest.fixture(scope="module")
def client(api):
    with tinker.ServiceClient(base_url=api.url, api_key=KEY) as sc:
        yield sc


def _stub(address: str, cfg):
    return TrainerClient(address, cfg.rpc)


def test_a_step_lowers_the_cross_entropy_in_the_trainer(client, api, trainer, tok):
    tc = client.create_lora_training_client(base_model="tiny", rank=8, seed=0).result()
    model_id = tc.get_info().model_id
    assert isinstance(api.api.models[model_id].model, RemoteModel)  # the API holds a handle, no weights
    assert isinstance(trainer.servicer.models[model_id].model, TrainingModel)
    batch = [_datum(tok, "abc=cba"), _datum(tok, "hello=olleh")]
    before = _loss(tc, batch)
    out = tc.forward_backward(batch, "cross_entropy").result()
    assert math.isclose(out.metrics["loss:sum"], before, rel_tol=1e-5)
    assert trainer.servicer.models[model_id].model.pending == 2
    metrics = tc.optim_step(types.AdamParams(learning_rate=1e-3)).result().metrics
    assert metrics["step:max"] == 1.0 and metrics["datums:sum"] == 2.0
    assert _loss(tc, batch) < before


def test_sampler_weights_come_from_the_trainer_and_sample_what_it_says(client, tok):
    prompt = tok.encode("hello=")
    base = client.create_sampling_client(base_model="tiny").result()
    before = base.sample(types.ModelInput.from_ints(prompt), 1, GREEDY).result().sequences[0]
    tc = client.create_lora_training_client(base_model="tiny", rank=8, seed=1).result()
    for _ in range(3):
        tc.forward_backward([_datum(tok, "hello=zzzzzz")], "cross_entropy")
        tc.optim_step(types.AdamParams(learning_rate=0.05)).result()
    after = tc.save_weights_and_get_sampling_client().sample(types.ModelInput.from_ints(prompt), 1, GREEDY)
    seq = after.result().sequences[0]
    assert seq.tokens != before.tokens or not np.allclose(seq.logprobs, before.logprobs, atol=1e-3)
    scored = types.Datum(
        model_input=types.ModelInput.from_ints(prompt + seq.tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": prompt[1:] + seq.tokens,
            "weights": [1.0] * (len(prompt) + len(seq.tokens) - 1),
        },
    )
    own = tc.forward([scored], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()
    np.testing.assert_allclose(seq.logprobs, own[len(prompt) - 1 :], atol=1e-4)


def test_a_state_saved_through_the_trainer_loads_into_a_new_model(client, trainer, tok):
    batch = [_datum(tok, "abc=cba")]
    tc = client.create_lora_training_client(base_model="tiny", rank=4, seed=3).result()
    tc.forward_backward(batch, "cross_entropy")
    tc.optim_step(types.AdamParams(learning_rate=0.05))
    saved = tc.save_state("step1").result().path
    loss = _loss(tc, batch)
    held = len(trainer.servicer.models)
    loaded = client.create_training_client_from_state_with_optimizer(saved).result()
    assert len(trainer.servicer.models) == held + 1
    assert math.isclose(_loss(loaded, batch), loss, rel_tol=1e-5)


def test_a_trainer_restarted_between_forward_backward_and_optim_step_refuses_the_step(tiny_model_dir, tmp_path, tok):
    first = serve_trainer(_trainer_cfg(tiny_model_dir, tmp_path / "t")).__enter__()
    port = first.server.port
    api = serve(_api_cfg(tiny_model_dir, tmp_path / "tinker", f"127.0.0.1:{port}")).start()
    second = None
    try:
        with tinker.ServiceClient(base_url=f"http://127.0.0.1:{api.port}", api_key=KEY) as sc:
            batch = [_datum(tok, "abc=cba")]
            tc = sc.create_lora_training_client(base_model="tiny", rank=4, seed=4).result()
            tc.forward_backward(batch, "cross_entropy")
            tc.optim_step(types.AdamParams(learning_rate=0.05))
            saved = tc.save_state("step1").result().path
            loss = _loss(tc, batch)
            tc.forward_backward(batch, "cross_entropy").result()  # gradients the restart loses
            first.stop()
            second = serve_trainer(_trainer_cfg(tiny_model_dir, tmp_path / "t", port)).__enter__()
            with pytest.raises(Exception, match="restarted since this model was made.*half a step"):
                tc.optim_step(types.AdamParams(learning_rate=0.01)).result()
            assert second.servicer.models == {}  # nothing was stepped, or made again behind the client's back
            loaded = sc.create_training_client_from_state_with_optimizer(saved).result()
            assert math.isclose(_loss(loaded, batch), loss, rel_tol=1e-5)
    finally:
        api.stop()
        (second or first).stop()


def test_an_op_sent_twice_steps_once(trainer, tok):
    cfg = trainer.servicer.cfg
    stub = _stub(trainer.address, cfg)
    kw = {"metadata": stub.metadata, "timeout": 60}
    stub.stub.Create(tpb.TrainerCreate(model="twice", spec=tpb.TrainerModelSpec(rank=4, targets=["q_proj"])), **kw)
    body = _proto("twice", 1, [_datum(tok, "abc=cba")])
    fb = tpb.TrainerForwardBackward(model="twice", op="fb-1", request=body, backward=True)
    assert stub.stub.ForwardBackward(fb, **kw) == stub.stub.ForwardBackward(fb, **kw)
    held = trainer.servicer.models["twice"].model
    assert held.pending == 1  # the repeat was answered, not computed
    step = tpb.TrainerOptimStep(model="twice", op="step-1", learning_rate=0.01, beta1=0.9, beta2=0.999, eps=1e-8)
    first = stub.stub.OptimStep(step, **kw)
    assert stub.stub.OptimStep(step, **kw) == first and held.steps == 1
    # the op's id again with another request: refused, not answered with the first one's result
    other = tpb.TrainerOptimStep(model="twice", op="step-1", learning_rate=0.5, beta1=0.9, beta2=0.999, eps=1e-8)
    with pytest.raises(grpc.RpcError) as e:
        stub.stub.OptimStep(other, **kw)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "used already" in e.value.details()
    assert held.steps == 1
    assert stub.stub.Drop(tpb.TrainerModelRef(model="twice"), **kw).steps == 1
    stub.close()


def _step(**given) -> tpb.TrainerOptimStep:
    settings = {"learning_rate": 0.01, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, **given}
    return tpb.TrainerOptimStep(model="bad", op="o", **settings)


def _state_stream(model: str, data: bytes, total: int | None = None) -> list:
    header = tpb.TrainerStateHeader(model=model, total_bytes=len(data) if total is None else total)
    return [tpb.TrainerStateChunk(header=header), tpb.TrainerStateChunk(data=data)]


@pytest.mark.parametrize(
    "call, words",
    [
        (lambda s, kw: s.Create(tpb.TrainerCreate(model="x", spec=tpb.TrainerModelSpec(rank=999)), **kw), "spec.rank"),
        (
            lambda s, kw: s.Create(
                tpb.TrainerCreate(model="x", spec=tpb.TrainerModelSpec(rank=2, targets=["evil"])), **kw
            ),
            "no layer",
        ),
        (lambda s, kw: s.Create(tpb.TrainerCreate(model="", spec=tpb.TrainerModelSpec()), **kw), "model:"),
        (
            lambda s, kw: s.OptimStep(tpb.TrainerOptimStep(model="bad", op="o", learning_rate=float("nan")), **kw),
            "learning_rate",
        ),
        (lambda s, kw: s.ForwardBackward(tpb.TrainerForwardBackward(model="bad", op="o", request=b"\xff"), **kw), ""),
        (lambda s, kw: s.ForwardBackward(tpb.TrainerForwardBackward(model="bad", op="", request=b""), **kw), "op"),
        (lambda s, kw: s.OptimStep(_step(beta1=1.0), **kw), "beta1"),
        (lambda s, kw: s.OptimStep(_step(eps=0.0), **kw), "eps"),
        (lambda s, kw: s.OptimStep(_step(grad_clip_norm=float("inf")), **kw), "grad_clip_norm"),
        (
            lambda s, kw: s.Create(
                tpb.TrainerCreate(model="y", spec=tpb.TrainerModelSpec(rank=2, targets=["lm_head"])), **kw
            ),
            "lm_head",
        ),
        (
            lambda s, kw: s.Create(
                tpb.TrainerCreate(model="bad", spec=tpb.TrainerModelSpec(rank=4, targets=["q_proj"])), **kw
            ),
            "another spec",
        ),
        (lambda s, kw: s.LoadState(iter(_state_stream("bad", b"not a state")), **kw), "not a saved state"),
        (lambda s, kw: s.LoadState(iter(_state_stream("bad", b"x" * 10, total=5)), **kw), "more than"),
    ],
)
def test_what_breaks_the_contract_is_invalid_argument(trainer, call, words):
    stub = _stub(trainer.address, trainer.servicer.cfg)
    kw = {"metadata": stub.metadata, "timeout": 60}
    stub.stub.Create(tpb.TrainerCreate(model="bad", spec=tpb.TrainerModelSpec(rank=2, targets=["q_proj"])), **kw)
    with pytest.raises(grpc.RpcError) as e:
        call(stub.stub, kw)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and words in e.value.details(), e.value.details()
    stub.stub.Drop(tpb.TrainerModelRef(model="bad"), **kw)
    stub.close()


def test_a_model_not_held_is_a_failed_precondition_and_no_token_no_answer(trainer):
    stub = _stub(trainer.address, trainer.servicer.cfg)
    with pytest.raises(grpc.RpcError) as e:
        stub.stub.OptimStep(tpb.TrainerOptimStep(model="never", op="o"), metadata=stub.metadata, timeout=60)
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION and reason_of(e.value) is Reason.MODEL_NOT_HELD
    with pytest.raises(grpc.RpcError) as e:
        stub.stub.Info(tpb.TrainerInfoRequest(), timeout=60)
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    stub.close()


def test_a_trainer_of_another_model_is_refused_at_start(trainer, tiny_model_dir, tmp_path):
    cfg = _api_cfg(tiny_model_dir, tmp_path, trainer.address)
    cfg.tinker.max_request_bytes = trainer.servicer.t.max_request_bytes * 2
    with pytest.raises(ValueError, match="cannot serve this API: it reads requests of at most"):
        OverGrpc(cfg, trainer.address)
    assert TOKEN in cfg.rpc.resolved_auth_token()


def test_the_trainer_trains_as_the_api_does_in_its_own_process(client, tiny_model_dir, tmp_path, tok):
    """The same LoRA (seed), the same batches of the RL loss with per-token advantages, the same
    Adam steps: the losses and the sampled log-probs in the trainer are the in-process ones
    (tolerance: the same kernels on the same tensors, in another process)."""
    batch = [
        types.Datum(
            model_input=types.ModelInput.from_ints(ids[:-1]),
            loss_fn_inputs={
                "target_tokens": ids[1:],
                "logprobs": [-1.0] * (len(ids) - 1),
                "advantages": [adv] * (len(ids) - 1),
            },
        )
        for ids, adv in ((tok.encode("abc=cba"), 1.0), (tok.encode("hello=olleh"), -0.5))
    ]
    local = serve(_cfg(tiny_model_dir, tmp_path / "local")).start()
    try:
        with tinker.ServiceClient(base_url=f"http://127.0.0.1:{local.port}", api_key=KEY) as here:
            runs = []
            for sc in (here, client):
                tc = sc.create_lora_training_client(base_model="tiny", rank=4, seed=7).result()
                losses = []
                for _ in range(3):
                    losses.append(tc.forward_backward(batch, "importance_sampling").result().metrics["loss:sum"])
                    tc.optim_step(types.AdamParams(learning_rate=0.02)).result()
                losses.append(_loss(tc, [_datum(tok, "abc=cba")]))
                runs.append(losses)
    finally:
        local.stop()
    np.testing.assert_allclose(runs[0], runs[1], rtol=1e-4, atol=1e-5)
    assert runs[0][0] != runs[0][2]  # the steps moved the model


def test_models_are_released_with_their_session_and_a_new_api_drops_the_olds(
    client, api, trainer, tok, tiny_model_dir, tmp_path
):
    """A finished session's models are dropped on the trainer; an API process that restarted (a new
    owner) drops, with its first model, those its predecessor left there."""
    with tinker.ServiceClient(base_url=api.url, api_key=KEY) as sc:
        model_id = sc.create_lora_training_client(base_model="tiny", rank=2, seed=5).result().get_info().model_id
        assert model_id in trainer.servicer.models
    deadline = time.monotonic() + 60
    while model_id in trainer.servicer.models and time.monotonic() < deadline:
        time.sleep(0.5)
    assert model_id not in trainer.servicer.models
    kept = client.create_lora_training_client(base_model="tiny", rank=2, seed=6).result().get_info().model_id
    again = serve(_api_cfg(tiny_model_dir, tmp_path / "again", trainer.address)).start()
    try:
        with tinker.ServiceClient(base_url=f"http://127.0.0.1:{again.port}", api_key=KEY) as sc:
            new = sc.create_lora_training_client(base_model="tiny", rank=2, seed=7).result().get_info().model_id
            assert set(trainer.servicer.models) == {new} and kept not in trainer.servicer.models
    finally:
        again.stop()


def test_a_call_the_trainer_stayed_away_for_leaves_the_model_refused(tiny_model_dir, tmp_path, tok):
    """The trainer gone past rpc.dependency_wait_s during a forward_backward: that call fails (503),
    and, since whether it ran there cannot be told, the model's next step is refused with what to
    do, even once the trainer is back."""
    first = serve_trainer(_trainer_cfg(tiny_model_dir, tmp_path / "t")).__enter__()
    port = first.server.port
    cfg = _api_cfg(tiny_model_dir, tmp_path / "tinker", f"127.0.0.1:{port}")
    cfg.rpc.dependency_wait_s = 2.0
    api = serve(cfg).start()
    second = None
    try:
        with tinker.ServiceClient(base_url=f"http://127.0.0.1:{api.port}", api_key=KEY) as sc:
            tc = sc.create_lora_training_client(base_model="tiny", rank=4, seed=8).result()
            tc.forward_backward([_datum(tok, "abc=cba")], "cross_entropy").result()
            first.stop()
            with pytest.raises(Exception, match="try again once it is back"):
                tc.forward_backward([_datum(tok, "abc=cba")], "cross_entropy").result()
            second = serve_trainer(_trainer_cfg(tiny_model_dir, tmp_path / "t", port)).__enter__()
            with pytest.raises(Exception, match="may or may not have run there"):
                tc.optim_step(types.AdamParams(learning_rate=0.01)).result()
    finally:
        api.stop()
        (second or first).stop()
