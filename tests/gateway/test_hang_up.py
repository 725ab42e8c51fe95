"""A client that hangs up cancels its turn (issue 54, item 8: ten dropped streams kept the gateway
and the generation server busy 28 s and recorded 160 trajectories nobody received): the gateway
cancels the turn's Generate, the generation server stops sampling it at its next step, and the
session records nothing. The real gateway over real HTTP and a real generation server; its engine
is the tiny model made slow (`SlowEngine`, a stand-in for a long reply on a real model: each
decoding step takes a second)."""

import json
import threading
import time

import httpx
import pytest

from services.gateway.server import serve as serve_gateway
from services.generation.backend import HFBackend
from services.generation.server import serve
from tests.gateway.test_edges import AUTH, _cfg
from tests.grpc_helpers import on_free_ports
from tests.waits import wait_until

STEP_S = 1.0


class SlowEngine:
    """The HF backend of the tiny model, each decoding step `STEP_S` long; `stopped` is set when
    the server's stop check (nobody waits any more) ends a batch, `steps` counts the steps run."""

    def __init__(self, inner: HFBackend):
        self.inner, self.stopped, self.steps = inner, threading.Event(), 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def generate(self, prompts, params, stop=None, between=None):
        def slow_stop() -> bool:
            time.sleep(STEP_S)
            self.steps += 1
            if stop is not None and stop():
                self.stopped.set()
                return True
            return False

        return self.inner.generate(prompts, params, slow_stop, between)


@pytest.fixture
def slow(tiny_model_dir):
    engine = SlowEngine(HFBackend(tiny_model_dir, "cpu"))
    gen = serve(on_free_ports(_cfg(tiny_model_dir, 4_194_304), "generation"), backend=engine).start()
    cfg = _cfg(tiny_model_dir, 4_194_304)
    cfg.rpc.generation.port = gen.server.port
    gw = serve_gateway(cfg).start()
    yield engine, gw, f"http://127.0.0.1:{gw.port}"
    gw.stop()
    gen.stop()


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_that_hangs_up_cancels_its_turn_and_records_nothing(slow, stream):
    engine, gw, base = slow
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "abcdefgh="}],
        "max_tokens": 32,
        "stream": stream,
    }
    headers = {**AUTH, "x-session-id": "hung-up"}
    with pytest.raises(httpx.ReadTimeout):  # the client gives up after half a step and closes
        waits = httpx.Timeout(60.0, read=0.5)  # connecting may take long on a busy machine; the answer may not
        httpx.post(base + "/v1/chat/completions", content=json.dumps(body).encode(), headers=headers, timeout=waits)
    wait_until(engine.stopped.is_set, "the generation server stopping the abandoned turn", 30)
    assert engine.steps <= 5, engine.steps  # stopped within a step or so of the hang-up, not 32
    wait_until(lambda: gw.handler.sessions.find("hung-up") is None and len(gw.handler.sessions) == 0, "no session", 10)
    answer = httpx.get(base + "/v1/sessions/hung-up", headers=AUTH, timeout=30)
    assert answer.status_code == 404  # nothing recorded of a turn nobody received
