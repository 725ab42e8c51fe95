"""A Generate whose caller has gone stops costing the server anything, and a retry never runs a
second copy of work still running: a real `hf` server on a loopback port, called through gRPC.
No check is timed: the test holds a big batch at a decoding step until the server has seen its
caller leave (or until the test releases it), so what happens next never depends on how fast
the machine is."""

import threading
import time
from concurrent.futures import Future

import grpc
import pytest

from services.common.config import config_from_dict
from services.common.rpc.errors import ResourceExhausted
from services.common.rpc.gen import generation_pb2 as gpb
from services.common.types import SamplingParams
from services.generation.backend import GenerationStopped
from services.generation.batching import InFlight
from services.generation.client import IDEMPOTENCY_KEY, GenerationClient
from services.generation.server import serve
from tests.grpc_helpers import TOKEN, on_free_ports
from tests.waits import wait_until

MAX_NEW = 64
# temperature 10 samples nearly uniformly: among 512 rows some never draw EOS, so the uncancelled
# request decodes all MAX_NEW steps (seeded: the same every time)
BIG = gpb.GenerateRequest(
    prompts=[gpb.Prompt(tokens=gpb.TokenIds(ids=[1, 4, 5, 6, 30]))] * 64,
    params=gpb.SamplingParams(n=8, temperature=10.0, max_new_tokens=MAX_NEW, seed=1),
)
BIG_ROWS = 64 * 8


def big(seed=1):
    req = gpb.GenerateRequest()
    req.CopyFrom(BIG)
    req.params.seed = seed
    return req


@pytest.fixture(scope="module")
def cfg(tiny_model_dir):
    return config_from_dict(
        {
            "model": {"path": tiny_model_dir, "device": "cpu"},
            "prompt_length": 32,
            "response_length": MAX_NEW,
            "rpc": {"auth_token": TOKEN, "max_samples_per_prompt": 8},
            "generation": {"batch_window_ms": 50},
        }
    )


class Calls:
    """The backend's generate calls, as they start and end (rows, start, end, decoding steps asked
    whether to stop, what ended them). After `hold(step)`, the next big batch waits at that
    decoding step (`held` is set) until its callers have all left (its `stop()` is True) or the
    test calls `release()`."""

    def __init__(self, backend):
        self.real, self.lock = backend.generate, threading.Lock()
        self.log: list[dict] = []
        self.changed = threading.Condition(self.lock)
        self.hold_at: int | None = None
        self.held, self.go = threading.Event(), threading.Event()
        backend.generate = self

    def hold(self, step: int) -> None:
        self.held.clear()
        self.go.clear()
        self.hold_at = step

    def release(self) -> None:
        self.hold_at = None
        self.go.set()

    def __call__(self, prompts, params, stop=None):
        call = {"rows": len(prompts) * params.n, "start": time.perf_counter(), "end": None, "steps": 0, "outcome": None}

        def counted():
            call["steps"] += 1
            if call["rows"] == BIG_ROWS and call["steps"] == self.hold_at:
                self.hold_at = None
                self.held.set()
                deadline = time.monotonic() + 120
                while not stop() and not self.go.is_set() and time.monotonic() < deadline:
                    time.sleep(0.005)
            return stop()

        with self.lock:
            self.log.append(call)
            self.changed.notify_all()
        try:
            res = self.real(prompts, params, stop=counted if stop is not None else None)
            call["outcome"] = "done"
            return res
        except GenerationStopped:
            call["outcome"] = "stopped"
            raise
        finally:
            with self.lock:
                call["end"] = time.perf_counter()
                self.changed.notify_all()

    def big(self) -> list[dict]:
        with self.lock:
            return [c for c in self.log if c["rows"] == BIG_ROWS]

    def wait(self, pred, timeout=120.0):
        with self.lock:
            assert self.changed.wait_for(lambda: pred(self.log), timeout), self.log

    def wait_big_started(self, count):
        self.wait(lambda log: sum(c["rows"] == BIG_ROWS for c in log) >= count)

    def wait_idle(self):
        self.wait(lambda log: all(c["end"] is not None for c in log))


@pytest.fixture(scope="module")
def served(cfg):
    with serve(on_free_ports(cfg, "generation")) as svc:
        c = GenerationClient(f"127.0.0.1:{svc.server.port}", cfg.rpc)
        calls = Calls(svc.servicer.backend)
        yield svc.servicer, c, calls
        c.close()


def small_answers(client) -> None:
    res = client.generate([[1, 4, 5, 30]], SamplingParams(max_new_tokens=4))
    assert len(res.completions) == 1


def keyed(client, key):
    return client.metadata + ((IDEMPOTENCY_KEY, key),)


def work(servicer, key: str):
    """The server's in-flight work under idempotency key `key` (its table adds the request's digest)."""
    found = [w for k, w in list(servicer.in_flight._by_key.items()) if k.startswith(f"{key}:")]
    return found[0] if found else None


def test_the_big_request_uncancelled_decodes_every_step(served):
    """What the cancelled ones are measured against: left alone, it decodes all MAX_NEW steps."""
    servicer, client, calls = served
    resp = client.stub.Generate(BIG, metadata=client.metadata)
    assert max(len(c.token_ids) for r in resp.results for c in r.completions) == MAX_NEW
    assert calls.big()[-1]["outcome"] == "done" and calls.big()[-1]["steps"] == MAX_NEW


def test_a_cancelled_generate_frees_the_server(served):
    """The big request is cancelled while it decodes: its batch stops at the next step (held at
    step 2 until the server sees the caller gone), and a small request behind it answers."""
    servicer, client, calls = served
    before = len(calls.big())
    calls.hold(2)
    fut = client.stub.Generate.future(BIG, metadata=client.metadata)
    assert calls.held.wait(120)
    fut.cancel()
    small_answers(client)
    calls.wait_idle()
    stopped = calls.big()[before]
    assert stopped["outcome"] == "stopped" and stopped["steps"] == 2, stopped
    assert len(servicer.in_flight) == 0


def test_a_generate_past_its_deadline_frees_the_server(served):
    servicer, client, calls = served
    before = len(calls.big())
    calls.hold(2)
    with pytest.raises(grpc.RpcError) as e:
        client.stub.Generate(BIG, metadata=client.metadata, timeout=2.0)
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    small_answers(client)
    calls.wait_idle()
    calls.release()
    # it was stopped while held (or, on a machine too busy to start it in time, never ran)
    assert all(c["outcome"] == "stopped" and c["steps"] <= 2 for c in calls.big()[before:]), calls.big()[before:]


def test_a_request_whose_caller_left_while_it_queued_never_runs(served):
    servicer, client, calls = served
    before = len(calls.big())
    calls.hold(2)
    running = client.stub.Generate.future(big(seed=1), metadata=client.metadata)
    assert calls.held.wait(120)
    # seeded: a batch of its own; keyed, so the test can see its caller leave
    queued = client.stub.Generate.future(big(seed=2), metadata=keyed(client, "queued"))
    wait_until(lambda: work(servicer, "queued") is not None, "the queued request in the server")
    queued.cancel()
    wait_until(
        lambda: not any(c.is_active() for c in work(servicer, "queued").contexts),
        "the server to see the queued caller gone",
    )
    calls.release()
    assert len(running.result(timeout=120).results) == 64
    small_answers(client)  # the batcher took the cancelled job from its queue before this one
    calls.wait_idle()
    assert [c["outcome"] for c in calls.big()[before:]] == ["done"]


def test_a_retry_waits_for_the_running_work_instead_of_running_it_again(served):
    """The worker's retry (same key, same request) arrives while the first call's work runs: it
    attaches; the first caller then leaves, and the work goes on for the retry. One batch ran."""
    servicer, client, calls = served
    before = len(calls.big())
    calls.hold(2)
    first = client.stub.Generate.future(BIG, metadata=keyed(client, "batch-1"))
    assert calls.held.wait(120)
    retry = client.stub.Generate.future(BIG, metadata=keyed(client, "batch-1"))
    wait_until(lambda: len(work(servicer, "batch-1").contexts) >= 2, "the retry to attach")
    first.cancel()
    wait_until(lambda: not work(servicer, "batch-1").contexts[0].is_active(), "the server to see the first caller gone")
    calls.release()
    resp = retry.result(timeout=120)
    assert len(resp.results) == 64 and max(len(c.token_ids) for r in resp.results for c in r.completions) == MAX_NEW
    calls.wait_idle()
    assert [c["outcome"] for c in calls.big()[before:]] == ["done"]  # one copy, never stopped
    assert len(servicer.in_flight) == 0


def test_a_retry_after_the_work_stopped_starts_anew_and_a_key_never_mixes_requests(served):
    servicer, client, calls = served
    before = len(calls.big())
    calls.hold(2)
    first = client.stub.Generate.future(big(seed=3), metadata=keyed(client, "batch-2"))
    assert calls.held.wait(120)
    first.cancel()
    calls.wait(lambda log: [c for c in log if c["rows"] == BIG_ROWS][before]["end"] is not None)
    assert calls.big()[before]["outcome"] == "stopped" and len(servicer.in_flight) == 0
    # the same key on another request is other work: both run
    again = client.stub.Generate.future(big(seed=3), metadata=keyed(client, "batch-2"))
    other = client.stub.Generate.future(big(seed=4), metadata=keyed(client, "batch-2"))
    a, b = again.result(timeout=120), other.result(timeout=120)
    assert [list(c.token_ids) for r in a.results for c in r.completions] != [
        list(c.token_ids) for r in b.results for c in r.completions
    ]
    calls.wait_idle()
    assert [c["outcome"] for c in calls.big()[before:]] == ["stopped", "done", "done"]


# ---------------------------------------------------------------------------------------------- InFlight alone
class Ctx:
    def __init__(self):
        self.active = True

    def is_active(self):
        return self.active


def test_in_flight_attaches_while_a_caller_lives_and_forgets_abandoned_work():
    table = InFlight()
    started: list = []

    def start(stopped):
        f = Future()
        started.append((stopped, f))
        return f

    a, b, c = Ctx(), Ctx(), Ctx()
    results = {}
    ta = threading.Thread(target=lambda: results.setdefault("a", table.run("k", a, start)))
    ta.start()
    while not started:
        time.sleep(0.001)
    tb = threading.Thread(target=lambda: results.setdefault("b", table.run("k", b, start)))
    tb.start()
    while len(table._by_key["k"].contexts) < 2:
        time.sleep(0.001)
    stopped, fut = started[0]
    a.active = False
    assert not stopped()  # b still waits
    fut.set_result("R")
    ta.join(5), tb.join(5)
    assert results == {"a": "R", "b": "R"} and len(started) == 1 and len(table) == 0

    # work whose every caller left is abandoned for good and leaves the table at once: a retry
    # with the key starts anew
    tc = threading.Thread(target=lambda: results.setdefault("c", _raises(lambda: table.run("k", c, start))))
    tc.start()
    while len(started) < 2:
        time.sleep(0.001)
    stopped, fut = started[1]
    c.active = False
    assert stopped() and len(table) == 0
    c.active = True
    assert stopped()  # sticky: the batch has been told to stop
    fut.set_exception(GenerationStopped("stopped"))
    tc.join(5)
    assert "caller left" in str(results["c"])
    d = Ctx()
    td = threading.Thread(target=lambda: results.setdefault("d", table.run("k", d, start)))
    td.start()
    while len(started) < 3:
        time.sleep(0.001)
    started[2][1].set_result("R2")
    td.join(5)
    assert results["d"] == "R2"


def _raises(fn):
    try:
        fn()
    except Exception as e:  # the test reads it
        return e
    return None


# ---------------------------------------------------------------------------------------------- vLLM's hook
class FakeEngine:
    """vLLM's LLMEngine as the backend's engine thread drives it: requests that never finish."""

    def __init__(self):
        self.requests, self.aborted = {}, []

    def has_unfinished_requests(self):
        return bool(self.requests)

    def add_request(self, rid, prompt, sp):
        self.requests[rid] = prompt

    def step(self):
        time.sleep(0.005)
        return []

    def abort_request(self, rids):
        self.aborted += list(rids)
        for r in rids:
            self.requests.pop(r, None)


def test_vllm_backend_aborts_the_requests_of_a_job_nobody_waits_for():
    import itertools
    import queue

    from services.generation import vllm_backend as vb  # imports no vLLM until an engine is built

    b = vb.VLLMBackend.__new__(vb.VLLMBackend)
    b.engine, b.policy_version, b.broken, b.eos_token_id = FakeEngine(), 0, None, 2
    b._sampling_params, b._output_kind = (lambda **kw: kw), None
    b._q, b._ids, b._inflight, b._held, b._calls, b._closed = queue.Queue(), itertools.count(), {}, [], [], False
    b._thread = threading.Thread(target=b._loop, daemon=True)
    b._thread.start()
    gone = threading.Event()
    params = SamplingParams(n=2, max_new_tokens=8)
    dropped = b.submit([[1, 4], [1, 5]], params, stopped=gone.is_set)
    kept = b.submit([[1, 6]], params)
    deadline = time.time() + 10
    while len(b.engine.requests) < 3:
        assert time.time() < deadline
        time.sleep(0.005)
    gone.set()
    with pytest.raises(GenerationStopped):
        dropped.result(timeout=10)
    assert sorted(b.engine.aborted) == ["0-0", "0-1"] and list(b.engine.requests) == ["1-0"]
    assert not kept.done()
    late = b.submit([[1, 7]], params, stopped=gone.is_set)  # gone before it was admitted: never added
    with pytest.raises(GenerationStopped):
        late.result(timeout=10)
    assert list(b.engine.requests) == ["1-0"]
    b.close()
    with pytest.raises(Exception, match="stopping"):
        kept.result(timeout=10)


def test_work_whose_start_is_refused_leaves_no_entry_behind():
    """A call refused as it starts (a full queue) leaves nothing under its key: its retry starts
    anew, instead of finding work without a future (an INTERNAL error for good)."""
    table = InFlight()

    def refused(stopped):
        raise ResourceExhausted("the queue is full")

    with pytest.raises(ResourceExhausted):
        table.run("k", Ctx(), refused)
    assert len(table) == 0
    done: Future = Future()
    done.set_result("R")
    assert table.run("k", Ctx(), lambda stopped: done) == "R"
