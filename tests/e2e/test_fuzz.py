"""Fuzz every RPC of the generation, reward and critic servers (and the learner's Status and
PullWeights) over real gRPC on loopback, with the valid bearer token.

The request messages are built from descriptors compiled from proto/rlhf/v1/*.proto at test time
(grpc_tools.protoc into a temporary directory), not from the committed stubs, and sent as raw
bytes: random field values (extreme, negative, NaN/inf, non-UTF-8 bytes, long strings, deeply
nested JSON), near-valid token batches, tensors, prompts and weight pushes with one thing wrong,
and bytes that are not a message at all. About 2,300 requests from a seeded random.Random, and
600 more whose declared tensor shapes overflow 64 bits (an empty tensor beside huge dimensions, a
product that wraps to 0, ...) for Critic Train/Values and PushWeights, and Generate requests whose
sizes do: each of those must be refused with INVALID_ARGUMENT (Generate: or RESOURCE_EXHAUSTED).

Every answer must be OK or a deliberate status (INVALID_ARGUMENT, RESOURCE_EXHAUSTED, ...):
INTERNAL, UNKNOWN, UNAVAILABLE or DATA_LOSS, and an OK Values answer with non-finite values,
fail the test, listed by method with a request summary. Afterwards every server must still be
SERVING and answer a known-good request correctly.
"""

import contextlib
import importlib
import math
import random
import re
import sys
import time
from collections import defaultdict
from pathlib import Path

import grpc
import numpy as np
import pytest

from services.common.rpc import health
from services.common.rpc.server import RPCServer
from tests.e2e.fuzz_requests import Fuzz, summary
from tests.grpc_helpers import TOKEN, on_free_ports

ROOT = Path(__file__).resolve().parents[2]
SEED = 20250101
DEADLINE_S = 30.0  # per request: an answer on a busy machine comes well within it
MD = (("authorization", f"Bearer {TOKEN}"),)
FAILING = {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN, grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DATA_LOSS}
SERVICES = {"generation": "Generation", "reward": "Reward", "critic": "Critic"}
# requests per method (about 10% of them raw bytes); an RPC not listed gets DEFAULT_COUNT
COUNTS = {
    "Generation/Generate": 500,
    "Generation/GetInfo": 40,
    "Generation/PushWeights": 200,
    "Reward/Score": 500,
    "Critic/Values": 450,
    "Critic/Train": 350,
    "Critic/Save": 60,
    "Critic/Load": 60,
    "Critic/Info": 40,
    "Learner/Status": 40,
    "Learner/PullWeights": 60,
}
DEFAULT_COUNT = 60
GARBAGE_SHARE = 0.1
# requests whose declared tensor shapes (or Generate's sizes) overflow 64-bit arithmetic, on top:
# each must be refused with one of the codes listed, never INTERNAL (torch's "Stride calculation
# overflowed", "numel: integer multiplication overflow") nor OK
OVERFLOW_COUNTS = {"Critic/Train": 200, "Critic/Values": 150, "Generation/PushWeights": 150, "Generation/Generate": 100}
OVERFLOW_CODES = {"Generation/Generate": {"INVALID_ARGUMENT", "RESOURCE_EXHAUSTED"}}


# ------------------------------------------------------------------ protos, compiled here
@pytest.fixture(scope="module")
def pb(tmp_path_factory):
    """proto/rlhf/v1 compiled by protoc now, imported as package `rlhf_fuzz_v1` from a temp dir."""
    import grpc_tools
    from grpc_tools import protoc

    tmp = tmp_path_factory.mktemp("fuzz-protos")
    protos = sorted((ROOT / "proto" / "rlhf" / "v1").glob("*.proto"))
    include = str(Path(grpc_tools.__file__).parent / "_proto")
    args = [
        "protoc",
        f"-I{ROOT / 'proto'}",
        f"-I{include}",
        f"--python_out={tmp}",
        *[str(p.relative_to(ROOT / "proto")) for p in protos],
    ]
    assert protoc.main(args) == 0, "protoc failed"
    pkg = tmp / "rlhf_fuzz_v1"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    for f in (tmp / "rlhf" / "v1").glob("*_pb2.py"):
        (pkg / f.name).write_text(
            re.sub(r"^from rlhf\.v1 import", "from rlhf_fuzz_v1 import", f.read_text(), flags=re.M)
        )
    sys.path.insert(0, str(tmp))
    try:
        mods = {p.stem: importlib.import_module(f"rlhf_fuzz_v1.{p.stem}_pb2") for p in protos}
    finally:
        sys.path.remove(str(tmp))
    assert not any(m.__name__.startswith("services.") for m in mods.values())
    return mods


# ------------------------------------------------------------------ servers
class FakeLearner:
    """What LearnerServicer needs of the learner: a status, the latest weights snapshot and the
    fencing identity its pushes carry."""

    def __init__(self, state):
        self.publisher = type("Publisher", (), {"snapshot": (3, state)})()
        self.sink = type("PushSink", (), {"run_id": "fuzz-run", "fence_epoch": 1})()  # the pushes' fencing identity

    def status(self):
        return {
            "iteration": 3,
            "total_iterations": 10,
            "policy_version": 3,
            "state": "training",
            "last_reward": 0.5,
            "uptime_s": 1.0,
        }


@pytest.fixture(scope="module")
def servers(cfg, tmp_path_factory):
    """Generation, reward and critic servers as `serve(cfg)` starts them, and the learner's gRPC
    servicer on an RPCServer; cwd is a temp directory (Critic.Save writes relative paths)."""
    from services.common.rpc.gen import learner_pb2_grpc
    from services.critic.server import serve as serve_critic
    from services.generation.server import serve as serve_generation
    from services.learner.server import LearnerServicer
    from services.reward.server import serve as serve_reward

    work = tmp_path_factory.mktemp("fuzz-cwd") / "a" / "b" / "c"
    work.mkdir(parents=True)
    (work / "a-file").write_text("not a directory\n")
    with pytest.MonkeyPatch.context() as mp, contextlib.ExitStack() as stack:
        mp.chdir(work)
        gen = stack.enter_context(serve_generation(on_free_ports(cfg, "generation")))
        rew = stack.enter_context(serve_reward(on_free_ports(cfg, "reward")))
        cri = stack.enter_context(serve_critic(on_free_ports(cfg, "critic")))
        state = {k: v.clone() for k, v in gen.servicer.backend.model.state_dict().items()}
        learner = RPCServer("learner", cfg.rpc, port=0, host="127.0.0.1")
        learner_pb2_grpc.add_LearnerServicer_to_server(LearnerServicer(FakeLearner(state)), learner.grpc)
        learner.start()
        learner.set_ready(True)
        stack.callback(learner.stop, 0)
        ports = {
            "generation": gen.server.port,
            "reward": rew.server.port,
            "critic": cri.server.port,
            "learner": learner.port,
        }
        yield {"ports": ports, "state": state, "generation": gen, "work": work}


# ------------------------------------------------------------------ the test
def _methods(pb):
    for mod, svc in (*SERVICES.items(), ("learner", "Learner")):
        for m in pb[mod].DESCRIPTOR.services_by_name[svc].methods:
            yield mod, svc, m


@pytest.mark.filterwarnings("ignore:invalid value encountered in cast:RuntimeWarning")
def test_fuzz_every_rpc(servers, pb, cfg):
    rng = random.Random(SEED)
    channels = {
        k: grpc.insecure_channel(
            f"127.0.0.1:{p}",
            [("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20)],
        )
        for k, p in servers["ports"].items()
    }
    gpb, cpb = pb["generation"], pb["critic"]
    info = gpb.GenerationInfo.FromString(
        channels["generation"].unary_unary("/rlhf.v1.Generation/GetInfo")(
            gpb.InfoRequest().SerializeToString(), metadata=MD, timeout=DEADLINE_S
        )
    )
    state = {k: v.float().numpy() for k, v in servers["state"].items()}
    fuzz = Fuzz(pb, rng, info.vocab_size, cfg.prompt_length, cfg.response_length, state)

    plan = []
    for mod, svc, m in _methods(pb):
        if svc == "Learner" and m.name not in ("Status", "PullWeights"):
            continue
        plan += [(mod, svc, m, False)] * COUNTS.get(f"{svc}/{m.name}", DEFAULT_COUNT)
        plan += [(mod, svc, m, True)] * OVERFLOW_COUNTS.get(f"{svc}/{m.name}", 0)
    rng.shuffle(plan)
    assert {f"{s}/{m.name}" for _, s, m, _ in plan} >= {
        "Generation/Generate",
        "Generation/PushWeights",
        "Generation/GetInfo",
        "Reward/Score",
        "Critic/Values",
        "Critic/Train",
        "Critic/Save",
        "Critic/Load",
        "Critic/Info",
        "Learner/Status",
        "Learner/PullWeights",
    }

    failures = defaultdict(list)  # (method, code, details) -> request summaries
    codes = defaultdict(lambda: defaultdict(int))
    reasons = defaultdict(lambda: defaultdict(int))  # method -> refusal (numbers as N) -> count
    t0 = time.perf_counter()
    overflow_codes = defaultdict(lambda: defaultdict(int))  # method -> code -> count, overflowing shapes only
    for mod, svc, m, overflow in plan:
        path = f"/rlhf.v1.{svc}/{m.name}"
        garbage = not overflow and rng.random() < GARBAGE_SHARE
        if overflow:
            payload = (
                fuzz.overflow_push()
                if m.client_streaming
                else fuzz.overflow_generate()
                if svc == "Generation"
                else fuzz.overflow_critic(m.input_type)
            )
            wire = [p.SerializeToString() for p in payload] if m.client_streaming else payload.SerializeToString()
        elif m.client_streaming:
            payload = [fuzz.garbage(m.input_type) for _ in range(rng.randint(1, 3))] if garbage else fuzz.push()
            wire = [p if isinstance(p, bytes) else p.SerializeToString() for p in payload]
        else:
            payload = fuzz.garbage(m.input_type) if garbage else fuzz.request(m.input_type)
            wire = payload if isinstance(payload, bytes) else payload.SerializeToString()
        ch = channels[mod]
        try:
            if m.client_streaming:
                reply = ch.stream_unary(path)(iter(wire), metadata=MD, timeout=DEADLINE_S)
            elif m.server_streaming:
                reply = list(ch.unary_stream(path)(wire, metadata=MD, timeout=DEADLINE_S))
            else:
                reply = ch.unary_unary(path)(wire, metadata=MD, timeout=DEADLINE_S)
            code, details = grpc.StatusCode.OK, ""
        except grpc.RpcError as e:
            code, details = e.code(), e.details() or ""
        codes[path][code.name] += 1
        if overflow:
            overflow_codes[path][code.name] += 1
            if code.name not in OVERFLOW_CODES.get(f"{svc}/{m.name}", {"INVALID_ARGUMENT"}):
                failures[(path, f"{code.name} (overflowing shape)", details[:160])].append(summary(payload))
        if code != grpc.StatusCode.OK:
            reasons[path][re.sub(r"-?\d+", "N", details)[:70]] += 1
        if code in FAILING:
            failures[(path, code.name, details[:160])].append(summary(payload))
        elif code == grpc.StatusCode.OK and m.name == "Values":
            v = np.frombuffer(cpb.ValuesResponse.FromString(reply).values.data, dtype=np.float32)
            if not np.isfinite(v).all():
                failures[(path, "OK", "non-finite values")].append(summary(payload))
        elif code == grpc.StatusCode.OK and m.name == "PushWeights":
            fuzz.policy_version = max(
                fuzz.policy_version, pb["common"].PushWeightsResponse.FromString(reply).policy_version
            )
    took = time.perf_counter() - t0
    print(f"\nfuzz: {len(plan)} requests in {took:.1f}s")
    for path, by_code in sorted(codes.items()):
        print(f"  {path}: " + ", ".join(f"{c}={n}" for c, n in sorted(by_code.items())))
        for why, n in sorted(reasons[path].items(), key=lambda kv: -kv[1])[:3]:
            print(f"      {n:4d} x {why}")
    print("overflowing shapes:")
    for path, by_code in sorted(overflow_codes.items()):
        print(f"  {path}: {sum(by_code.values())} sent: " + ", ".join(f"{c}={n}" for c, n in sorted(by_code.items())))
    assert set(overflow_codes) == {f"/rlhf.v1.{k}" for k in OVERFLOW_COUNTS}

    # every server is still alive and ready, and answers a known-good request correctly
    for kind, port in servers["ports"].items():
        address = f"127.0.0.1:{port}"
        assert health.status(address, "", timeout_s=30) == "SERVING", kind
        assert health.status(address, health.readiness_name(kind), timeout_s=30) == "SERVING", kind
    _known_good(pb, channels, fuzz)
    for ch in channels.values():
        ch.close()

    if failures:
        lines = []
        for (path, code, details), reqs in sorted(failures.items(), key=lambda kv: -len(kv[1])):
            lines.append(f"{path} -> {code} x{len(reqs)}: {details}\n    e.g. {reqs[0]}")
        pytest.fail(
            f"{sum(len(r) for r in failures.values())} of {len(plan)} fuzz requests failed:\n" + "\n".join(lines),
            pytrace=False,
        )


def _known_good(pb, channels, fuzz):
    gpb, rpb, cpb, lpb = pb["generation"], pb["reward"], pb["critic"], pb["learner"]
    req = gpb.GenerateRequest(
        prompts=[gpb.Prompt(tokens=gpb.TokenIds(ids=[1, 4, 5, 30])), gpb.Prompt(text="abc=")],
        params=gpb.SamplingParams(n=2, max_new_tokens=4, seed=1),
    )
    out = gpb.GenerateResponse.FromString(
        channels["generation"].unary_unary("/rlhf.v1.Generation/Generate")(
            req.SerializeToString(), metadata=MD, timeout=30
        )
    )
    assert len(out.results) == 2 and all(len(r.completions) == 2 for r in out.results)
    assert all(
        1 <= len(c.token_ids) == len(c.log_probs) <= 4 and all(math.isfinite(x) for x in c.log_probs)
        for r in out.results
        for c in r.completions
    )

    req = rpb.ScoreRequest(
        samples=[
            rpb.RewardSample(prompt="abc=", response="cba", label="cba"),
            rpb.RewardSample(prompt="abc=", response="cbx", label="cba"),
        ]
    )
    out = rpb.ScoreResponse.FromString(
        channels["reward"].unary_unary("/rlhf.v1.Reward/Score")(req.SerializeToString(), metadata=MD, timeout=30)
    )
    assert [s.reward for s in out.scores] == [1.0, 0.0]

    ids, attn, pos, rmask, P = fuzz.valid_batch(B=2, P=5, T=3)
    batch = pb["common"].TokenBatch(
        input_ids=fuzz.raw_tensor(ids),
        attention_mask=fuzz.raw_tensor(attn),
        position_ids=fuzz.raw_tensor(pos),
        response_mask=fuzz.raw_tensor(rmask),
        prompt_width=P,
    )
    out = cpb.ValuesResponse.FromString(
        channels["critic"].unary_unary("/rlhf.v1.Critic/Values")(
            cpb.ValuesRequest(batch=batch).SerializeToString(), metadata=MD, timeout=30
        )
    )
    values = np.frombuffer(out.values.data, dtype=np.float32)
    assert out.values.dtype == "float32" and list(out.values.shape) == [2, 3] and values.size == 6
    assert np.isfinite(values).all(), values

    status = lpb.LearnerStatus.FromString(
        channels["learner"].unary_unary("/rlhf.v1.Learner/Status")(
            lpb.StatusRequest().SerializeToString(), metadata=MD, timeout=30
        )
    )
    assert status.iteration == 3 and status.state == "training"
