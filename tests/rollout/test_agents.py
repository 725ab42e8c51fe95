"""Agent rollouts (`rollout.agent`): the worker runs a user's agent function per sample against its
own OpenAI-compatible endpoint (real HTTP, the official `openai` client, a real generation server
over gRPC, a real Redis); the replay buffer gets each session's token-exact trajectory with its
loss mask and the agent's reward. An agent that raises, hangs past its timeout or returns a
non-finite reward ends as a dead letter saying so, never a reward of 0."""

import math

import pytest

from services.common.replay import ReplayStore
from services.common.replay.records import group_from_proto
from services.rollout.worker import RolloutWorker
from services.training.data import reverse_task
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
    "fn, why",
    [
        ("raises", "raised RuntimeError: the tool crashed"),
        ("hangs", "ran past rollout.agent_timeout_s=2"),
        ("nan", "returned nan, not a finite number"),
    ],
)
def test_an_agent_that_fails_ends_as_a_dead_letter_saying_why(make_cfg, agents_file, fn, why):
    cfg, worker = _worker(make_cfg, agents_file, fn, agent_timeout_s=2)
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
