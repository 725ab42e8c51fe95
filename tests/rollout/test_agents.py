"""Agent rollouts (`rollout.agent`): the worker runs a user's agent function per sample against its
own OpenAI-compatible endpoint (real HTTP, the official `openai` client, a real generation server
over gRPC, a real Redis); the replay buffer gets each session's token-exact trajectory with its
loss mask and the agent's reward. An agent that raises, hangs past its timeout or returns a
non-finite reward ends as a dead letter saying so, never a reward of 0."""

import json
import math

import pytest

from services.common.replay import ReplayStore
from services.common.replay.records import group_from_proto
from services.rollout.worker import RolloutWorker
from services.training.sources.synthetic import reverse_task
from tests.rollout.test_worker import _claim_all, _feed, _generation, _trajectories

AGENTS = '''
import asyncio, time

def two_turns(client, sample):
    """Answers, is told to try again, answers again; the reward: how long the second answer is."""
    messages = [{"role": "user", "content": sample.prompt}]
    first = client.chat.completions.create(model="p", messages=messages, max_tokens=4, temperature=1.0)
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "again="}]
    second = client.chat.completions.create(model="p", messages=messages, max_tokens=4, temperature=1.0)
    return float(len(second.choices[0].message.content))

async def async_two_turns(client, sample):
    messages = [{"role": "user", "content": sample.prompt}]
    first = await client.chat.completions.create(model="p", messages=messages, max_tokens=4)
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "again="}]
    await client.chat.completions.create(model="p", messages=messages, max_tokens=4)
    return 1.0

def raises(client, sample):
    client.chat.completions.create(model="p", messages=[{"role": "user", "content": "a="}], max_tokens=2)
    raise RuntimeError("the tool crashed")

def hangs(client, sample):
    time.sleep(30)
    return 1.0

def picky(client, sample):
    """Fails on the prompt with id "bad" only."""
    client.chat.completions.create(model="p", messages=[{"role": "user", "content": sample.prompt}], max_tokens=2)
    if sample.id == "bad":
        raise RuntimeError("the bad prompt broke the tool")
    return 1.0

def wraps(client, sample):
    """Reports any failure of its requests as its own (as an agent framework may)."""
    try:
        client.chat.completions.create(model="p", messages=[{"role": "user", "content": sample.prompt}], max_tokens=2)
    except Exception as e:
        raise RuntimeError(f"my framework failed: {e}") from None
    return 1.0

class Steps:
    """An environment: the prompt, then "again=" after each reply; a quarter for each reply, done
    after the third (or never, with `Steps.endless`)."""

    endless = False
    max_tokens = 4

    def reset(self, sample):
        self.turns = 0
        return sample.prompt

    def step(self, reply):
        self.turns += 1
        return "again=", 0.25, self.turns == 3 and not self.endless


class Endless(Steps):
    endless = True

def nan(client, sample):
    client.chat.completions.create(model="p", messages=[{"role": "user", "content": "a="}], max_tokens=2)
    return float("nan")
'''


@pytest.fixture
def agents_file(tmp_path):
    path = tmp_path / "agents.py"
    path.write_text(AGENTS)
    return path


def _worker(make_cfg, agents_file, fn, **rollout):
    cfg = make_cfg(
        prompt_length=128,
        response_length=64,
        rollout={"retries": 2, "retry_backoff_s": 0.05, "agent": f"{agents_file}:{fn}", **rollout},
    )
    return cfg, RolloutWorker(cfg, ReplayStore.from_config(cfg), name="w1")


@pytest.mark.parametrize("fn", ["two_turns", "async_two_turns"])
def test_each_sample_is_a_token_exact_agent_session(make_cfg, agents_file, fn):
    cfg, worker = _worker(make_cfg, agents_file, fn)
    store = ReplayStore.from_config(cfg)
    try:
        with _generation(cfg):
            uids = _feed(store, reverse_task("train", 2))
            produced = sum(worker.process(b) for b in _claim_all(store, "w1", 2))
            assert produced == 2 and store.read_dead() == []
            groups = [group_from_proto(m) for _, m in _trajectories(store)]
            assert sorted(g.uid for g in groups) == sorted(uids)
            for g in groups:
                assert len(g.completions) == 2  # the group size: one session each
                for c, s in zip(g.completions, g.scores):
                    mask = c.loss_mask
                    assert mask is not None and len(mask) == len(c.token_ids) == len(c.log_probs)
                    runs = [m for i, m in enumerate(mask) if i == 0 or m != mask[i - 1]]
                    assert runs == [1, 0, 1], mask  # sampled, the environment's "again=", sampled
                    assert all(lp == 0.0 for lp, m in zip(c.log_probs, mask) if m == 0)
                    assert math.isfinite(s.reward) and s.components == {"agent": s.reward}
                if fn == "two_turns":
                    tok = worker.tokenizer
                    second = [t for t, m in zip(c.token_ids, mask) if m][-4:]
                    assert s.reward == len(tok.decode(second, skip_special_tokens=True)) or s.reward >= 0
    finally:
        worker.stop()
        worker.close()


@pytest.mark.parametrize(
    "fn, timeout_s, why",
    [  # only the hanging agent meets its timeout: the others have time for a turn on a loaded machine
        ("raises", 120, "raised RuntimeError: the tool crashed"),
        ("hangs", 2, "ran past rollout.agent_timeout_s=2"),
        ("nan", 120, "returned nan, not a finite number"),
    ],
)
def test_an_agent_that_fails_ends_as_a_dead_letter_saying_why(make_cfg, agents_file, fn, timeout_s, why):
    cfg, worker = _worker(make_cfg, agents_file, fn, agent_timeout_s=timeout_s)
    store = ReplayStore.from_config(cfg)
    try:
        with _generation(cfg):
            uids = _feed(store, reverse_task("train", 1))
            assert sum(worker.process(b) for b in _claim_all(store, "w1", 1)) == 0
            dead = store.read_dead()
            assert [t.uid for _, t, _ in dead] == uids
            assert why in dead[0][2], dead[0][2]
            assert _trajectories(store) == []  # nothing with a made-up reward
    finally:
        worker.stop()
        worker.close()


def test_the_agent_is_checked_before_the_run_starts(agents_file, tmp_path):
    from services.cli.preflight import agent_errors
    from services.common.config import config_from_dict

    def errors(ref):
        return agent_errors(config_from_dict({"rollout": {"agent": ref}}))

    assert errors(f"{agents_file}:two_turns") == []
    assert "no such file" in errors(f"{tmp_path}/missing.py:run")[0]
    assert "has no 'nope'" in errors(f"{agents_file}:nope")[0]
    (tmp_path / "one.py").write_text("def run(client):\n    return 1.0\n")
    assert errors(f"{tmp_path}/one.py:run") == [
        f"rollout.agent: '{tmp_path}/one.py:run' takes (client); it must take (client, sample)"
    ]


def test_a_conversation_longer_than_the_learner_takes_is_a_dead_letter(make_cfg, agents_file):
    """The session's budget is response_length: the endpoint refuses the turn that has no room
    left (400), and the agent's session ends as a dead letter saying so."""
    cfg = make_cfg(
        prompt_length=128,
        response_length=6,
        rollout={"retries": 2, "retry_backoff_s": 0.05, "agent": f"{agents_file}:two_turns"},
    )
    worker = RolloutWorker(cfg, ReplayStore.from_config(cfg), name="w1")
    store = ReplayStore.from_config(cfg)
    try:
        with _generation(cfg):
            _feed(store, reverse_task("train", 1))
            assert sum(worker.process(b) for b in _claim_all(store, "w1", 1)) == 0
            (dead,) = store.read_dead()
            assert "no room for another reply in response_length=6" in dead[2], dead[2]
    finally:
        worker.stop()
        worker.close()


def _mask_runs(mask):
    return [m for i, m in enumerate(mask) if i == 0 or m != mask[i - 1]]


def _groups_of(make_cfg, rollout, n_prompts=1):
    """Groups the worker produces for `n_prompts` prompts with `rollout` (and the dead letters)."""
    cfg = make_cfg(prompt_length=128, response_length=64, rollout={"retries": 2, "retry_backoff_s": 0.05, **rollout})
    worker = RolloutWorker(cfg, ReplayStore.from_config(cfg), name="w1")
    store = ReplayStore.from_config(cfg)
    try:
        with _generation(cfg):
            _feed(store, reverse_task("train", n_prompts))
            sum(worker.process(b) for b in _claim_all(store, "w1", n_prompts))
            return [group_from_proto(m) for _, m in _trajectories(store)], store.read_dead()
    finally:
        worker.stop()
        worker.close()


def test_an_environment_is_played_turn_by_turn(make_cfg, agents_file):
    """rollout.environment: reset's message, then the policy's reply and step's message by turns;
    the steps' rewards summed; the environment's messages masked out."""
    groups, dead = _groups_of(make_cfg, {"environment": f"{agents_file}:Steps"})
    assert dead == [] and len(groups) == 1
    for c, score in zip(groups[0].completions, groups[0].scores):
        assert _mask_runs(c.loss_mask) == [1, 0, 1, 0, 1]  # three replies, two "again=" between
        assert score.reward == 0.75


def test_a_session_has_at_most_max_turns(make_cfg, agents_file):
    """An endless environment is cut at rollout.max_turns (its rewards so far); an agent that asks
    for more turns is refused by the endpoint and dead-lettered."""
    groups, dead = _groups_of(make_cfg, {"environment": f"{agents_file}:Endless", "max_turns": 2})
    assert dead == [] and len(groups) == 1
    assert all(_mask_runs(c.loss_mask) == [1, 0, 1] for c in groups[0].completions)
    assert all(s.reward == 0.5 for s in groups[0].scores)
    groups, dead = _groups_of(make_cfg, {"agent": f"{agents_file}:two_turns", "max_turns": 1})
    assert groups == [] and len(dead) == 1
    assert "turn 2, more than this endpoint's max_turns=1" in dead[0][2], dead[0][2]


AGENT_SERVICE = {}  # how the test's agent service answers: {"reward": "answer" | "post" | "none" | "fail"}


def _agent_service():
    """An agent service of the user's, over real HTTP: it is POSTed a session, talks two turns to
    the endpoint it is handed with the official client, and reports its reward as the test says."""
    import httpx
    import openai
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse

    from services.common.lifecycle import HTTPServerThread

    app = FastAPI()

    @app.post("/run")
    def run(task: dict):
        AGENT_SERVICE.setdefault("keys", {})[task["session_id"]] = task["api_key"]
        client = openai.OpenAI(base_url=task["base_url"], api_key=task["api_key"], default_headers=task["headers"])
        messages = [{"role": "user", "content": task["sample"]["prompt"]}]
        first = client.chat.completions.create(model="p", messages=messages, max_tokens=3)
        messages += [
            {"role": "assistant", "content": first.choices[0].message.content},
            {"role": "user", "content": "b="},
        ]
        client.chat.completions.create(model="p", messages=messages, max_tokens=3)
        how = AGENT_SERVICE["reward"]
        if how == "fail":
            return JSONResponse({"error": "the sandbox broke"}, status_code=500)
        if how == "post":
            auth = {"Authorization": f"Bearer {task['api_key']}"}
            httpx.post(task["reward_url"], json={"reward": 0.25}, headers=auth).raise_for_status()
            return {}
        return {"reward": 0.75} if how == "answer" else {}

    http = HTTPServerThread(app, "127.0.0.1", 0, name="agent-service")
    return http, f"http://127.0.0.1:{http.start()}/run"


@pytest.mark.parametrize(
    "how, reward, why",
    [
        ("answer", 0.75, None),
        ("post", 0.25, None),
        ("none", None, "gave session"),
        ("fail", None, "answered 500"),
    ],
)
def test_an_agent_service_over_http_runs_each_session(make_cfg, how, reward, why):
    """rollout.agent_url: the worker POSTs each session to the user's service, which talks to the
    worker's endpoint and answers its reward or posts it to the session; a service that answers
    an error or gives no reward ends the prompt as a dead letter saying so."""
    AGENT_SERVICE["reward"] = how
    http, url = _agent_service()
    try:
        groups, dead = _groups_of(make_cfg, {"agent_url": url})
    finally:
        http.stop()
    keys = AGENT_SERVICE.pop("keys")  # each session its own key, not the run's token
    assert len(set(keys.values())) == len(keys) == 2 and all(k.startswith("sk-session-") for k in keys.values())
    if why is None:
        assert dead == [] and len(groups) == 1
        for c, s in zip(groups[0].completions, groups[0].scores):
            assert _mask_runs(c.loss_mask) == [1, 0, 1] and s.reward == reward
    else:
        assert groups == [] and len(dead) == 1 and why in dead[0][2], dead[0][2]


def test_rlhf_eval_runs_the_agent_and_shows_the_conversation(
    make_cfg, agents_file, tmp_path, untrained_model_dir, monkeypatch
):
    """`rlhf eval` with rollout.agent: one session per held-out prompt against the model in this
    process (no generation server started), the agent's reward as the score, each row's
    conversation as policy and environment runs; the baseline side by side."""
    import services.generation.server as generation_server
    from services.cli.eval_model import run_eval

    def no_server(*args, **kwargs):
        raise AssertionError("rlhf eval started a generation server")

    monkeypatch.setattr(generation_server, "serve", no_server)

    cfg = make_cfg(
        prompt_length=128,
        response_length=64,
        rollout={"agent": f"{agents_file}:two_turns"},
        data={"eval": "synthetic:reverse", "eval_size": 3},
        generation={"eval_temperature": 0.0},
    )
    said = []
    summary = run_eval(cfg, untrained_model_dir, untrained_model_dir, tmp_path, say=said.append)
    assert summary["reward"].startswith("the agent's") and summary["model"]["prompts"] == 3
    assert summary["model"]["failed"] == 0.0 and summary["compared"]["same"] == 3  # greedy: the same model agrees
    rows = [json.loads(line) for line in (tmp_path / "model.jsonl").read_text().splitlines()]
    for r in rows:
        assert [x["by"] for x in r["transcript"]] == ["policy", "environment", "policy"] and r["turns"] == 2
        assert "again=" in r["transcript"][1]["text"] and r["response"] == "".join(x["text"] for x in r["transcript"])
        assert r["reward"] == r["components"]["agent"]
    assert any("model" in line and "baseline" in line for line in said)


def test_the_learners_eval_runs_the_agent_on_the_server_at_its_version(make_cfg, agents_file, tmp_path):
    """The learner's held-out eval with rollout.agent (`LearnerLoop.evaluate`): one session per
    held-out prompt, every turn on a generation server at the policy's version, through an
    endpoint of the learner's own; the agent's reward as `eval/reward_mean`, the conversations
    in the generations."""
    from services.learner.run import LearnerLoop

    cfg = make_cfg(
        prompt_length=128,
        response_length=64,
        rollout={"agent": f"{agents_file}:two_turns"},
        data={"eval": "synthetic:reverse", "eval_size": 3},
        generation={"eval_temperature": 0.0},
    )
    with _generation(cfg):
        loop = LearnerLoop(cfg, tmp_path / "run")
        try:
            out = loop.evaluate()
        finally:
            loop.close()
    rows = out.pop("generations")
    assert sorted(out) == ["eval/agent", "eval/failed", "eval/reward_mean", "eval/unscored"]
    assert out["eval/failed"] == 0.0 and out["eval/unscored"] == 0.0
    assert len(rows) == 3 and [r["sample"] for r in rows] == [0, 0, 0]
    assert out["eval/reward_mean"] == pytest.approx(sum(r["reward"] for r in rows) / 3)
    for r in rows:
        assert [x["by"] for x in r["transcript"]] == ["policy", "environment", "policy"] and r["turns"] == 2


def test_train_local_trains_an_agent_in_one_process_and_a_config_gives_one_kind(
    agents_file, tmp_path, tiny_model_dir, local_session_cfg
):
    """`rlhf train --local` with rollout.agent: the agent's sessions run on an endpoint in the
    process, sampled by its backend (no generation server); the policy trains on them and the
    held-out eval runs the agent. A config names one of agent,
    environment, agent_url; an environment that does not load is named as such."""
    import torch
    from safetensors.torch import load_file

    from services.cli.preflight import agent_errors
    from services.common.config import ConfigError, config_from_dict
    from services.local import run_local

    cfg = local_session_cfg(
        prompt_length=128,
        response_length=64,
        actor_lr=1e-3,
        rollout={"agent": f"{agents_file}:two_turns", "agent_timeout_s": 120},
    )
    run_dir = tmp_path / "run"
    summary = run_local(cfg, run_dir)
    assert summary["iterations"] == 2
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == [0, 1, 2]
    trained = [r for r in rows if r["iteration"] > 0]
    assert all(r["rollout/samples"] == 8 and r["rollout/prompts_left_out"] == 0 for r in trained)
    assert all(r["rollout/tokens"] > 0 and r["eval/failed"] == 0.0 for r in trained)
    start, final = (
        load_file(str(tiny_model_dir) + "/model.safetensors"),
        load_file(str(run_dir / "final" / "model.safetensors")),
    )
    assert any(not torch.equal(start[k], final[k]) for k in start)  # it trained
    with pytest.raises(ConfigError, match="give one of agent, environment, agent_url"):
        config_from_dict({"rollout": {"agent": f"{agents_file}:two_turns", "environment": f"{agents_file}:Steps"}})
    missing = agent_errors(config_from_dict({"rollout": {"environment": f"{agents_file}:Nope"}}))
    assert missing and missing[0].startswith("rollout.environment: ") and "has no 'Nope'" in missing[0]


def test_one_prompt_whose_sessions_fail_is_dead_lettered_alone(make_cfg, agents_file):
    """A batch's prompts run at once; the one whose agent raises is dead-lettered, the others'
    groups are appended from the same run (not redone one by one)."""
    from services.common.types import PromptRecord

    cfg, worker = _worker(make_cfg, agents_file, "picky")
    store = ReplayStore.from_config(cfg)
    try:
        with _generation(cfg):
            _feed(store, [PromptRecord("good", "ab=", "ba"), PromptRecord("bad", "cd=", "dc")])
            (batch,) = _claim_all(store, "w1", 2)
            assert worker.process(batch) == 1
            (dead,) = store.read_dead()
            assert dead[1].uid == "0:bad" and "the bad prompt broke the tool" in dead[2]
            assert [group_from_proto(m).uid for _, m in _trajectories(store)] == ["0:good"]
    finally:
        worker.stop()
        worker.close()


def test_an_agent_that_fails_because_no_server_answered_leaves_its_prompt_pending(make_cfg, agents_file):
    """No generation server: the endpoint answers 503, the agent reports it as its own error; the
    session is still an outage (the endpoint saw it), so the prompt stays pending, no dead letter."""
    cfg, worker = _worker(make_cfg, agents_file, "wraps")
    store = ReplayStore.from_config(cfg)
    try:
        _feed(store, reverse_task("train", 1))
        assert sum(worker.process(b) for b in _claim_all(store, "w1", 1)) == 0
        assert store.read_dead() == [] and _trajectories(store) == []
        down = {"service": "rollout", "kind": "no_generation_server"}
        assert worker.metrics.registry.get_sample_value("rlhf_rollout_errors_total", down) >= 1
    finally:
        worker.stop()
        worker.close()


def test_only_an_agent_service_is_handed_an_advertised_address(agents_file, tiny_model_dir):
    """In-process agents talk to the endpoint where it listens; an agent service elsewhere is
    handed rpc.advertise_host, or for a wildcard bind this host's own address."""
    import socket

    from services.agents.host import agent_host
    from services.common.config import config_from_dict
    from services.common.model_files import load_tokenizer
    from services.common.types import SamplingParams

    tok = load_tokenizer(tiny_model_dir)

    def host_of(rollout, rpc=None):
        cfg = config_from_dict({"model": {"path": tiny_model_dir}, "rollout": rollout, "rpc": rpc or {}})
        host = agent_host(cfg, tok, servers=None, params=SamplingParams(), port=0)
        host.close()
        return host.base_url.split("//")[1].rsplit(":", 1)[0]

    here = {"endpoint_host": "0.0.0.0"}
    assert host_of({"agent": f"{agents_file}:two_turns", **here}, {"advertise_host": "10.9.8.7"}) == "127.0.0.1"
    assert host_of({"agent_url": "http://agents:8000/run", **here}) == socket.gethostbyname(socket.gethostname())
    assert host_of({"agent_url": "http://agents:8000/run", **here}, {"advertise_host": "10.9.8.7"}) == "10.9.8.7"


def test_an_agents_sessions_are_read_by_the_teacher(agents_file, tmp_path, local_session_cfg):
    """On-policy distillation of an agent (`train --local`): every session's tokens are scored by
    the teacher (the frozen initial model, the label as a hint) and trained on; the environment's
    tokens carry no advantage (masked as always)."""
    from services.local import run_local

    cfg = local_session_cfg(
        prompt_length=128,
        response_length=64,
        rollout={"agent": f"{agents_file}:two_turns", "agent_timeout_s": 120},
        distill={"enabled": True, "hint": "so {label}", "reward_weight": 1.0, "top_k": 1},
    )
    run_dir = tmp_path / "run"
    assert run_local(cfg, run_dir)["iterations"] == 2
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in rows if r["iteration"] > 0]
    # the hinted teacher reads the sessions otherwise than the student: a KL estimate, not 0
    assert all(math.isfinite(r["distill/reverse_kl"]) and r["distill/reverse_kl"] != 0 for r in trained)
    assert all(0 <= r["distill/teacher_top1_agree"] <= 1 for r in trained)
    assert all(r["time/teacher_s"] > 0 and r["rollout/prompts_left_out"] == 0 for r in trained)
