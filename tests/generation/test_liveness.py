"""Liveness and readiness of the generation server are two answers of its gRPC health service
(what deploy/k8s/base/generation.yaml probes): readiness (`rlhf.v1.Generation`) goes off for a
moment during every weight swap; liveness ("") fails only when the process can no longer make
progress: its vLLM engine marked broken (a reload that failed midway, an engine core that died),
or the thread that runs every batch and swap gone. Then Kubernetes restarts it.

The vLLM backend runs here on `FakeEngine`, a fake standing in for vLLM's `LLMEngine` (the real
engine's tests carry the `vllm` mark and run in .venv-vllm)."""

import threading
import time
from types import SimpleNamespace

import grpc
import pytest
import torch

from services.common.model_files import load_causal_lm, load_tokenizer
from services.common.rpc import health
from services.common.types import SamplingParams
from services.generation.client import GenerationClient
from services.generation.server import serve
from services.generation.vllm_backend import VLLMBackend
from tests.grpc_helpers import expect_code, held_backend, on_free_ports


class FakeEngine:
    """A fake of vLLM's `LLMEngine`, just what `VLLMBackend` calls: every request finishes at its
    first step with two tokens; a reload (`collective_rpc`) raises when `fail_reload` is set; a
    step raises `step_error` when set."""

    def __init__(self):
        self.requests: dict = {}
        self.fail_reload = False
        self.step_error: BaseException | None = None
        self.engine_core = SimpleNamespace(shutdown=lambda: None)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def add_request(self, rid, prompt, sp) -> None:
        self.requests[rid] = sp

    def abort_request(self, rids) -> None:
        for r in rids:
            self.requests.pop(r, None)

    def step(self):
        if self.step_error is not None:
            raise self.step_error
        out = []
        for rid, sp in self.requests.items():
            comps = [
                SimpleNamespace(
                    index=i,
                    token_ids=[5, 6],
                    finish_reason="length",
                    logprobs=[{5: SimpleNamespace(logprob=-1.0)}, {6: SimpleNamespace(logprob=-2.0)}],
                )
                for i in range(sp.n)
            ]
            out.append(SimpleNamespace(request_id=rid, finished=True, outputs=comps))
        self.requests.clear()
        return out

    def collective_rpc(self, name, args=(), kwargs=None):
        if self.fail_reload:
            raise RuntimeError("fake device lost in the middle of the reload")

    def reset_prefix_cache(self) -> None:
        pass


class EngineDeadError(RuntimeError):
    """Named as vLLM's (vllm.v1.engine.exceptions.EngineDeadError): its engine core process died."""


def fake_vllm_backend(model_dir: str) -> VLLMBackend:
    """A `VLLMBackend` on a `FakeEngine` (nothing of vLLM imported)."""
    b = VLLMBackend.__new__(VLLMBackend)
    b.inprocess, b.engine_version, b.device, b.dtype = True, "vllm (fake engine)", "cpu", "float32"
    b.tokenizer = load_tokenizer(model_dir)
    b.eos_token_id, b.pad_token_id = b.tokenizer.eos_token_id, b.tokenizer.pad_token_id
    model = load_causal_lm(model_dir)
    b.vocab_size = model.config.vocab_size
    b._specs = {k: (tuple(v.shape), v.dtype) for k, v in model.state_dict().items()}
    b._sampling_params, b._output_kind = (lambda **kw: SimpleNamespace(**kw)), None
    b.engine = FakeEngine()
    b._run_engine()
    return b


@pytest.fixture
def served(cfg, tiny_model_dir):
    backend = fake_vllm_backend(tiny_model_dir)
    with serve(on_free_ports(cfg, "generation"), backend=backend) as svc:
        client = GenerationClient(f"127.0.0.1:{svc.server.port}", cfg.rpc)
        yield svc, backend, client
        client.close()


def _alive(svc) -> bool:
    """SERVING (True) or NOT_SERVING (False) for liveness; no answer in 30 s fails the test."""
    return _serving(svc, "")


def _ready(svc) -> bool:
    return _serving(svc, health.readiness_name("generation"))


def _serving(svc, service: str) -> bool:
    got = health.status(f"127.0.0.1:{svc.server.port}", service, timeout_s=30)
    assert got in ("SERVING", "NOT_SERVING"), got
    return got == "SERVING"


def _zeros(backend) -> dict:
    return {k: torch.zeros(shape, dtype=dtype) for k, (shape, dtype) in backend.parameter_specs().items()}


def test_a_working_engine_is_alive_and_ready_and_a_good_swap_keeps_it_so(served):
    svc, backend, client = served
    assert _alive(svc) and _ready(svc)
    res = client.generate([[1, 4, 5]], SamplingParams(n=2, max_new_tokens=2))
    assert [c.token_ids for c in res.completions[0]] == [[5, 6], [5, 6]]
    client.update_weights(_zeros(backend), 1)
    assert backend.policy_version == 1 and _alive(svc) and _ready(svc)


def test_an_engine_broken_by_a_failed_reload_fails_liveness(served, caplog):
    svc, backend, client = served
    backend.engine.fail_reload = True
    expect_code(lambda: client.update_weights(_zeros(backend), 1), grpc.StatusCode.INTERNAL, "fake device lost")
    assert backend.broken and "failed while loading policy version 1" in backend.broken
    assert not _alive(svc) and not _ready(svc)  # liveness too: only a restart brings the engine back
    assert any("liveness fails" in r.getMessage() and "policy version 1" in r.getMessage() for r in caplog.records)
    expect_code(
        lambda: client.generate([[1, 4, 5]], SamplingParams(max_new_tokens=2)),
        grpc.StatusCode.UNAVAILABLE,
        "failed while loading policy version 1",
    )


def test_an_engine_whose_core_died_fails_liveness(served):
    svc, backend, client = served
    backend.engine.step_error = EngineDeadError("EngineCore encountered an issue (fake)")
    expect_code(
        lambda: client.generate([[1, 4, 5]], SamplingParams(max_new_tokens=2)), grpc.StatusCode.INTERNAL, "EngineCore"
    )
    assert backend.broken and not _alive(svc)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_an_engine_thread_that_exited_fails_liveness(served):
    svc, backend, client = served
    assert _alive(svc)

    def gone():  # raised by the engine thread's loop outside its guarded step: the thread ends
        raise RuntimeError("fake: the engine went away")

    backend.engine.has_unfinished_requests = gone
    deadline = time.monotonic() + 10
    while backend._thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not backend._thread.is_alive()
    assert not _alive(svc)
    assert "engine thread has exited" in svc.server.liveness()


def test_readiness_goes_off_during_a_swap_while_liveness_stays_on(cfg):
    """The hf backend: a swap waits for the running batch; meanwhile the server is alive, not ready."""
    backend, started, release = held_backend(cfg.model.path, 30)
    with serve(on_free_ports(cfg, "generation"), backend=backend) as svc:
        client = GenerationClient(f"127.0.0.1:{svc.server.port}", cfg.rpc)
        try:
            t = threading.Thread(target=client.generate, args=([[1, 4, 5]], SamplingParams(max_new_tokens=2)))
            t.start()
            assert started.wait(120)
            state = {k: v.clone() for k, v in backend.model.state_dict().items()}
            push = threading.Thread(target=client.update_weights, args=(state, 1))
            push.start()
            deadline = time.monotonic() + 10
            while _ready(svc) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert not _ready(svc) and _alive(svc)
            release.set()
            push.join(30)
            t.join(30)
            assert backend.policy_version == 1 and _ready(svc) and _alive(svc)
        finally:
            release.set()
            client.close()
