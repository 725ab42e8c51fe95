"""A verifiers environment as `rollout.environment` (verifiers:REF) and its dataset as the prompts
(`data.train: verifiers`): a real vf.SingleTurnEnv over an in-memory dataset with a Rubric of two
reward functions (tests/rollout/vf_reverse_env.py). Each session is the environment's rollout
against the worker's endpoint (real HTTP, a real generation server, a real Redis), its trajectory
token-exact, its reward the rubric's with each function's score as a component; a rollout that
fails, or a reward function that raised, is a dead letter saying so, never a reward of 0."""

import json
import signal
from pathlib import Path

import pytest

pytest.importorskip("verifiers")

from services.common import environments  # noqa: E402
from services.common.config import ConfigError, config_from_dict  # noqa: E402
from services.common.replay import ReplayStore  # noqa: E402
from services.common.replay.records import group_from_proto  # noqa: E402
from services.common.types import PromptRecord  # noqa: E402
from services.rollout.worker import RolloutWorker  # noqa: E402
from services.training.data import config_prompts  # noqa: E402
from services.training.sources.synthetic import reverse_task  # noqa: E402
from tests.rollout import vf_reverse_env as vre  # noqa: E402
from tests.rollout.test_worker import _claim_all, _feed, _generation, _trajectories  # noqa: E402

HELPER = Path(vre.__file__)


def ref(fn: str = "load_environment", options: str = "") -> str:
    return f"verifiers:{HELPER}:{fn}" + (f"?{options}" if options else "")


def records(cfg, tokenizer) -> list[PromptRecord]:
    """The training rows of the run's verifiers environment, through the registry of kinds."""
    return [PromptRecord(**r) for r in environments.records(cfg.rollout.environment, "train", tokenizer)]


def _worker(make_cfg, env: str, response_length: int = 16, **rollout):
    cfg = make_cfg(
        prompt_length=32,
        response_length=response_length,
        data={"train": "verifiers"},
        rollout={"retries": 2, "retry_backoff_s": 0.05, "environment": env, "agent_timeout_s": 120, **rollout},
    )
    return cfg, RolloutWorker(cfg, ReplayStore.from_config(cfg), name="w1")


def test_each_session_is_a_rollout_of_the_environment_scored_by_its_rubric(make_cfg):
    """The worker's sessions are the environment's rollouts: the prompt it sent is the dataset row's,
    rendered as the record says, token for token; each sample's reward is what the rubric gives the
    reply the policy sampled (recomputed here from the sampled tokens), its components the
    per-function scores; the environment's max_tokens bounds each reply. A prompt of another
    source (synthetic:reverse) is a row made of its record: its prompt the user's message, its
    label the answer."""
    cfg, worker = _worker(make_cfg, ref(options="n=20"))
    store = ReplayStore.from_config(cfg)
    tok = worker.tokenizer
    fed = records(cfg, tok)[:3] + reverse_task("train", 1)
    try:
        with _generation(cfg):
            uids = _feed(store, fed)
            assert sum(worker.process(b) for b in _claim_all(store, "w1", 4)) == 4 and store.read_dead() == []
            groups = {g.uid: g for g in (group_from_proto(m) for _, m in _trajectories(store))}
            assert sorted(groups) == sorted(uids)
            for record in fed:
                g = groups[f"0:{record.id}"]
                question = record.metadata["verifiers"]["question"] if "verifiers" in record.metadata else record.prompt
                assert tok.decode(g.prompt_ids) == f"user: {question}\nassistant: "
                assert record.prompt == question or record.prompt == tok.decode(g.prompt_ids)
                assert len(g.completions) == 2  # the group size: one session each
                for c, s in zip(g.completions, g.scores):
                    assert c.loss_mask is None or set(c.loss_mask) == {1}  # one turn, all the policy's
                    assert 0 < len(c.token_ids) <= 6 and len(c.log_probs) == len(c.token_ids)
                    reply = [{"role": "assistant", "content": tok.decode(c.token_ids, skip_special_tokens=True)}]
                    exact = vre.exact(reply, record.label)
                    in_place = vre.in_place(reply, record.label, {"letters": len(record.label)})
                    assert s.reward == pytest.approx(exact + 0.5 * in_place)
                    # an empty reply (the untrained policy may sample its stop token first) is
                    # verifiers' aborted turn: num_turns 0
                    turns = 1.0 if reply[0]["content"] else 0.0
                    assert s.components == pytest.approx(
                        {"exact": exact, "in_place": in_place, "num_turns": turns, "agent": s.reward}
                    )
    finally:
        worker.stop()
        worker.close()


def test_a_rollout_that_fails_or_cannot_be_scored_is_a_dead_letter_never_a_zero(make_cfg):
    """In one batch: the environment raising, the rollout stopped on a vf.Error, a reward function
    that raised (verifiers alone would score it 0.0) and a NaN reward are dead letters saying
    which; the good prompt's group is appended from the same run."""
    bad = {"xab=": "raised RuntimeError: the environment's tool crashed",
           "yab=": "the rollout stopped on an error: ToolCallError: the sandbox refused the question",
           "abz=": "a reward function raised: Error calling reward function exact: the checker broke",
           "abw=": "the rubric gave reward nan, not a finite number"}  # fmt: skip
    cfg, worker = _worker(make_cfg, ref(options=f"n=1&extra={','.join(bad)}"))
    store = ReplayStore.from_config(cfg)
    fed = records(cfg, worker.tokenizer)
    assert len(fed) == 5
    try:
        with _generation(cfg):
            _feed(store, fed)
            (batch,) = _claim_all(store, "w1", 5)
            assert worker.process(batch) == 1
            question = {f"0:{r.id}": r.metadata["verifiers"]["question"] for r in fed}
            dead = {question[task.uid]: why for _, task, why in store.read_dead()}
            assert sorted(dead) == sorted(bad)
            for q, why in bad.items():
                assert why in dead[q], dead[q]
            (good,) = [group_from_proto(m) for _, m in _trajectories(store)]
            assert question[good.uid] == "aaa="
    finally:
        worker.stop()
        worker.close()


@pytest.mark.parametrize("response_length, max_turns", [(96, 3), (48, 16)])
def test_a_multi_turn_environment_plays_until_the_endpoint_ends_the_episode(make_cfg, response_length, max_turns):
    """A MultiTurnEnv that never ends: the endpoint refuses the turn past rollout.max_turns (3), or
    one with no room left in response_length (48 tokens: two replies and the messages between);
    that ends the episode, truncated, and the rubric scores it as it stands (so does an empty
    reply: the sample keeps its tokens, the rubric sees the turns before it). The environment's
    messages between the replies are masked out of the loss (log-prob 0)."""
    cfg, worker = _worker(make_cfg, ref("load_multiturn"), response_length=response_length, max_turns=max_turns)
    store = ReplayStore.from_config(cfg)
    fed = records(cfg, worker.tokenizer)[:1]
    try:
        with _generation(cfg):
            _feed(store, fed)
            assert sum(worker.process(b) for b in _claim_all(store, "w1", 1)) == 1 and store.read_dead() == []
            (g,) = [group_from_proto(m) for _, m in _trajectories(store)]
            for c, s in zip(g.completions, g.scores):
                mask, turns = c.loss_mask, s.components["num_turns"]
                assert mask is not None and len(mask) == len(c.token_ids) == len(c.log_probs)
                runs = [m for i, m in enumerate(mask) if i == 0 or m != mask[i - 1]]
                replies = runs.count(1)
                assert runs == [1, 0] * (replies - 1) + [1], mask  # reply, "again=", reply, ...
                assert all(lp == 0.0 for lp, m in zip(c.log_probs, mask) if m == 0)
                if replies == turns + 1:  # an empty reply ended it (verifiers' rollout leaves it out)
                    last = c.token_ids[len(mask) - mask[::-1].index(0) if 0 in mask else 0 :]
                    assert worker.tokenizer.decode(last, skip_special_tokens=True) == ""
                else:
                    assert replies == turns
                assert replies <= 3 if max_turns == 3 else turns < 3
                assert s.reward == pytest.approx(0.1 * turns) == s.components["replies"]
    finally:
        worker.stop()
        worker.close()


def test_an_empty_reply_is_scored_and_an_outage_is_an_outage():
    """verifiers stops a rollout on an empty reply (EmptyModelResponseError): here the episode ends
    there and is scored, as the policy sampled it; a turn that reached no server raises the client's
    own error, which AgentHost counts as an outage (the prompt stays pending)."""
    import asyncio

    import openai
    import verifiers as vf

    from services.agents.verifiers_env import _check_rollout

    _check_rollout({"error": vf.EmptyModelResponseError("Model returned no content")})

    async def unreachable():
        async with openai.AsyncOpenAI(base_url="http://127.0.0.1:9/v1", api_key="k", max_retries=0) as client:
            try:
                await client.models.list()
            except openai.APIConnectionError as e:
                try:
                    raise vf.ModelError() from e
                except vf.ModelError as wrapped:
                    return wrapped

    with pytest.raises(openai.APIConnectionError):
        _check_rollout({"error": asyncio.run(unreachable())})


def test_train_local_on_a_verifiers_environment(tiny_model_dir, local_session_cfg, tmp_path):
    """`rlhf train --local` for 2 iterations with the environment's dataset as prompts: every
    prompt's sessions scored, the rubric's functions in the metrics (reward/<name> and
    eval/<name>), the held-out rows none of the training ones; the run's SIGTERM handler is
    its own (verifiers' Environment would install one that exits)."""
    from services.local import run_local

    before = signal.getsignal(signal.SIGTERM)
    cfg = local_session_cfg(
        prompt_length=32,
        response_length=16,
        data={"train": "verifiers", "eval_size": 4},
        rollout={"environment": ref(options="n=40"), "agent_timeout_s": 120},
    )
    summary = run_local(cfg, tmp_path / "run")
    assert summary["iterations"] == 2
    assert signal.getsignal(signal.SIGTERM) is before
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == [0, 1, 2]
    for r in rows:
        assert r["eval/failed"] == 0.0 and 0.0 < r["eval/num_turns"] <= 1.0  # 0 for an empty reply
        assert r["eval/agent"] == pytest.approx(r["eval/exact"] + 0.5 * r["eval/in_place"])
    for r in rows[1:]:
        assert r["rollout/samples"] == 8 and r["rollout/prompts_left_out"] == 0
        assert r["reward/agent"] == pytest.approx(r["reward/exact"] + 0.5 * r["reward/in_place"])
        assert r["reward/agent"] == pytest.approx(r["reward/score_mean"])
    generations = (tmp_path / "run" / "generations").glob("*.jsonl")
    held = {json.loads(line)["prompt"] for p in generations for line in p.read_text().splitlines()}
    train = {r.prompt for r in config_prompts(cfg, "train", _tokenizer(tiny_model_dir))}
    assert len(held) == 4 and not held & train


def _tokenizer(path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def _cfg(env: str, **data):
    return config_from_dict(
        {"prompt_length": 32, "data": {"train": "verifiers", "eval_size": 8, **data}, "rollout": {"environment": env}}
    )


def test_held_out_prompts_are_never_training_prompts(tiny_model_dir):
    """Without an eval_dataset, a fifth of the dataset (by a hash of the prompt) is held out and
    the rest trained on; with one, its first data.eval_size rows, less any that is a training
    row; records are the row's chat prompt rendered, its answer, the row as JSON."""
    tok = _tokenizer(tiny_model_dir)
    split = _cfg(ref(options="n=40"))
    train, held = config_prompts(split, "train", tok), config_prompts(split, "eval", tok)
    assert len(train) == 32 and len(held) == 8 and not {r.prompt for r in held} & {r.prompt for r in train}
    row = train[0].metadata["verifiers"]
    assert json.loads(json.dumps(row)) == row and row["prompt"] == [{"role": "user", "content": row["question"]}]
    assert train[0].label == row["answer"] == row["question"][:3][::-1]

    own = _cfg(ref(options="n=40&eval_n=12&overlap=3"))  # 3 of its eval rows are training rows
    train, held = config_prompts(own, "train", tok), config_prompts(own, "eval", tok)
    assert len(train) == 40 and len(held) == 8 and not {r.prompt for r in held} & {r.prompt for r in train}
    assert all(r.id.startswith("verifiers-eval-") for r in held)


def test_mistakes_are_named_before_the_run():
    """A source `verifiers` without a verifiers environment, a reference that does not read, and
    (the pre-flight checks) a factory that is missing, returns no Environment, or scores groups."""
    from services.cli.preflight import agent_errors

    with pytest.raises(ConfigError, match="data.train: `verifiers` takes the prompts of a verifiers environment"):
        config_from_dict({"data": {"train": "verifiers"}})
    with pytest.raises(ConfigError, match="option 'n' is not KEY=VALUE"):
        _cfg(ref(options="n"))
    problems = {
        "load_nope": "has no 'load_nope'",
        "load_nothing": "returned str, not a verifiers Environment",
        "load_grouped": "group reward functions (relative)",
    }
    for fn, why in problems.items():
        (error,) = agent_errors(_cfg(ref(fn)))
        assert error.startswith("rollout.environment: ") and why in error, error
    assert agent_errors(_cfg(ref())) == []
