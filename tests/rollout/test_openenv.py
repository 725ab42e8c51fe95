"""OpenEnv environments as `rollout.environment` (services/agents/openenv.py): a real OpenEnv
server (openenv-core's own `create_app` under uvicorn, in a process of its own:
tests/rollout/openenv_envs.py) played over one WebSocket per session, or an OpenEnv Environment
class in this process. Every session a token-exact conversation through the agent endpoint with
the tiny model, the environment's observations as masked user turns, the episode's reward the
sample's; a server that is down or full is an outage (the prompt stays pending), an environment
that raises is a dead letter with its message, null rewards are unscored (never 0)."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest

pytest.importorskip("openenv.core")

from services.agents.host import AgentFailed, Outage, Unscored, agent_host, session_name  # noqa: E402
from services.agents.openenv import EnvironmentDown, Shape, openenv_agent, text_field  # noqa: E402
from services.common.config import ConfigError, config_from_dict  # noqa: E402
from services.common.model_files import load_tokenizer  # noqa: E402
from services.common.types import PromptRecord, SamplingParams  # noqa: E402
from tests.waits import wait_until  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "openenv_reverse_env.py"
HELPERS = Path(__file__).resolve().parent / "openenv_envs.py"
WORDS = ["abc", "bcd", "cdea", "dab", "eabc", "fgh", "ghab", "hcd"]


@pytest.fixture(scope="module")
def server():
    """The environments of openenv_envs.py on a free port, in a process of their own: their base URL."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.rollout.openenv_envs"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        first = proc.stdout.readline()
        assert first.startswith("port "), first + proc.stdout.read()
        url = f"http://127.0.0.1:{first.split()[1]}"
        threading.Thread(target=lambda: proc.stdout.read(), daemon=True).start()  # its pipe never fills
        wait_until(lambda: _healthy(f"{url}/reverse"), "the OpenEnv server answers /health")
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=2).json() == {"status": "healthy"}
    except httpx.HTTPError:
        return False


def _cfg(model_dir, environment: str, **over):
    return config_from_dict(
        {
            "model": {"path": model_dir, "device": "cpu"},
            "prompt_length": 64,
            "response_length": 48,
            "rollout": {"environment": environment, "agent_timeout_s": 120, "max_turns": 4},
            **over,
        }
    )


@contextlib.contextmanager
def _host(cfg):
    """An AgentHost for `cfg`'s environment, every turn sampled by the tiny model in this process."""
    from services.generation.inprocess import in_process_pool
    from services.generation.policy import make_backend

    tok = load_tokenizer(cfg.model.path)
    backend = make_backend(cfg)
    pool = in_process_pool(backend, cfg)
    host = agent_host(cfg, tok, pool, SamplingParams.for_training(cfg), port=0)
    try:
        yield host, tok, backend
    finally:
        host.close()
        pool.close()


def _records(words=WORDS):
    return [PromptRecord(f"w{i}", f"{w}=", w[::-1]) for i, w in enumerate(words)]


def _runs(ids, mask):
    out, start = [], 0
    for i in range(1, len(mask) + 1):
        if i == len(mask) or mask[i] != mask[start]:
            out.append((mask[start], ids[start:i]))
            start = i
    return out


def _in_place(got: str, label: str) -> float:
    return sum(a == b for a, b in zip(got, label)) / max(len(label), len(got), 1)


# ---------------------------------------------------------------------------------------------- the config
def test_a_config_names_a_server_or_a_class_and_its_mistakes_are_named():
    def error(ref):
        with pytest.raises(ConfigError) as e:
            config_from_dict({"rollout": {"environment": ref}})
        return str(e.value)

    rc = config_from_dict({"rollout": {"environment": "openenv+ws://127.0.0.1:8011/env?max_tokens=8"}}).rollout
    assert rc.environment.startswith("openenv+ws://") and rc.sessions
    assert "openenv+http://HOST:PORT" in error("openenv+ftp://127.0.0.1:8011")
    assert "unknown option 'seed'; the options are observation, action, adapter, max_tokens" in error(
        "openenv+http://127.0.0.1:8011?seed=3"
    )
    assert "openenv:path/to/env.py:Class" in error("openenv:ReverseEnvironment")
    assert "not both" in error("openenv:env.py:E?action=text&adapter=a.py:fn")


def test_the_preflight_loads_the_class_and_says_what_it_lacks(tmp_path):
    from services.cli.preflight import agent_errors

    def errors(ref):
        return agent_errors(config_from_dict({"rollout": {"environment": ref}}))

    assert errors(f"openenv:{EXAMPLE}:ReverseEnvironment") == []
    assert errors("openenv+http://127.0.0.1:9") == []  # a server is not contacted before a session runs
    (tmp_path / "envs.py").write_text(
        "from openenv_reverse_env import ReverseEnvironment\n"
        "class Shared(ReverseEnvironment):\n    SUPPORTS_CONCURRENT_SESSIONS = False\n"
        "class Plain:\n    def reset(self, sample): return ''\n"
    )
    sys.path.insert(0, str(EXAMPLE.parent))
    try:
        (shared,) = errors(f"openenv:{tmp_path}/envs.py:Shared")
        (plain,) = errors(f"openenv:{tmp_path}/envs.py:Plain")
    finally:
        sys.path.remove(str(EXAMPLE.parent))
    assert shared.startswith("rollout.environment: ") and "SUPPORTS_CONCURRENT_SESSIONS = True" in shared
    assert "not an OpenEnv Environment class" in plain


def test_observations_and_replies_map_as_documented():
    """The reply fills the action's one text field (or the one it requires); an action of several
    is named by ?action= or built by an adapter. The message is the observation's one text field,
    else the observation as JSON (or the field ?observation= names)."""
    one = {"properties": {"metadata": {"type": "object"}, "text": {"type": "string"}}, "required": ["text"]}
    assert text_field(one, "env") == "text"
    two = {"properties": {"cmd": {"type": "string"}, "note": {"type": "string"}}, "required": ["cmd"]}
    assert text_field(two, "env") == "cmd"
    with pytest.raises(ValueError, match=r"its action \(x: integer, y: integer\) is not one text field"):
        text_field({"properties": {"x": {"type": "integer"}, "y": {"type": "integer"}}}, "env")
    plain = Shape(None, "text", None)
    assert plain.message({"prompt": "abc=", "tries": 1}) == "abc="
    assert plain.message({"a": "x", "b": "y"}) == '{"a": "x", "b": "y"}'
    assert Shape("b", "text", None).message({"a": "x", "b": [1]}) == "[1]"
    assert plain.action_of("cba", {}) == {"text": "cba"}
    adapted = Shape(None, None, lambda reply, obs: {"x": len(reply), "y": obs["n"]})
    assert adapted.action_of("cba", {"n": 2}) == {"x": 3, "y": 2}


# ---------------------------------------------------------------------------------------------- a server
def test_eight_sessions_at_once_on_a_server_are_token_exact(server, tiny_model_dir):
    """Eight sessions at once, one WebSocket each: each trajectory is the first observation as
    the chat template renders it, then the policy's sampled tokens and the environment's
    ("again=") by turns, the environment's masked out; the policy's own log-probs of its sampled
    tokens, recomputed over the whole sequence, are the recorded ones; the reward is the
    environment's score of the last reply."""
    import torch

    cfg = _cfg(tiny_model_dir, f"openenv+{server}/reverse?max_tokens=6")
    records = _records()
    with _host(cfg) as (host, tok, backend):
        episodes = host.run([(r, session_name(r.id, 0)) for r in records])
        model = backend.model
        for r, e in zip(records, episodes):
            assert e.error is None, e.error
            t = e.trajectory
            ids, mask, logp = t["token_ids"], t["loss_mask"], t["log_probs"]
            first = tok.apply_chat_template(
                [{"role": "user", "content": r.prompt}], tokenize=False, add_generation_prompt=True
            )
            p0 = tok(first, add_special_tokens=False)["input_ids"]
            assert ids[: len(p0)] == p0 and set(mask[: len(p0)]) == {0}
            runs = _runs(ids, mask)
            assert [m for m, _ in runs] == [0, 1] * t["turns"] and t["turns"] in (1, 2)
            if t["turns"] == 2:
                assert "again=" in tok.decode(runs[2][1])  # the second observation, in context, masked
            assert all(lp == 0.0 for lp, m in zip(logp, mask) if m == 0)
            reply = tok.decode(runs[-1][1], skip_special_tokens=True).strip()
            assert e.reward == pytest.approx(_in_place(reply, r.label)), reply
            with torch.no_grad():
                logits = model(torch.tensor([ids])).logits[0].float()
            lps = torch.log_softmax(logits[:-1], -1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]
            sampled = [i for i, m in enumerate(mask) if m == 1]
            assert [lps[i - 1].item() for i in sampled] == pytest.approx([logp[i] for i in sampled], abs=1e-4)


def test_a_server_that_is_down_leaves_the_prompt_pending(make_cfg, tiny_model_dir):
    """No OpenEnv server where the config says: the session is an outage, not its input; the
    worker leaves the prompt pending (no dead letter, no trajectory) and counts it."""
    import socket

    from services.common.replay import ReplayStore
    from services.rollout.worker import RolloutWorker
    from services.training.sources.synthetic import reverse_task
    from tests.rollout.test_worker import _claim_all, _errors, _feed, _trajectories

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = make_cfg(prompt_length=64, response_length=48, rollout={"environment": f"openenv+http://127.0.0.1:{port}"})
    store = ReplayStore.from_config(cfg)
    worker = RolloutWorker(cfg, ReplayStore.from_config(cfg), name="w1")
    try:
        _feed(store, reverse_task("train", 1))
        assert sum(worker.process(b) for b in _claim_all(store, "w1", 1)) == 0
        assert store.read_dead() == [] and _trajectories(store) == []
        assert _errors(worker, "agent_service") >= 1
    finally:
        worker.stop()
        worker.close()


def test_a_full_server_is_an_outage_that_names_the_setting(server, tiny_model_dir):
    """OpenEnv's default of one session at once, taken by another client: the session is asked
    again for a while, then it is an outage whose message says to raise max_concurrent_envs."""
    from websockets.sync.client import connect

    cfg = _cfg(tiny_model_dir, f"openenv+{server}/one")
    with connect(f"ws{server[4:]}/one/ws", proxy=None) as taken, _host(cfg) as (host, _, _):
        taken.send(json.dumps({"type": "reset", "data": {}}))
        taken.recv(timeout=30)
        with pytest.raises(Outage) as e:
            host.groups([(_records()[0], "0:w0", 1)])
    assert isinstance(e.value, EnvironmentDown) and "is full" in str(e.value)
    assert "max_concurrent_envs" in str(e.value) and "SUPPORTS_CONCURRENT_SESSIONS" in str(e.value)


@pytest.mark.parametrize("where", ["server", "class"])
def test_an_environment_that_raises_is_a_dead_letter_with_its_message(server, tiny_model_dir, where):
    ref = f"openenv+{server}/raises" if where == "server" else f"openenv:{HELPERS}:Raises"
    with _host(_cfg(tiny_model_dir, f"{ref}?max_tokens=4")) as (host, _, _):
        (failed,) = host.groups([(_records()[0], "0:w0", 2)])
    assert isinstance(failed, AgentFailed) and "step 1 failed" in str(failed), failed
    assert "the simulator crashed" in str(failed)


def test_null_rewards_are_unscored_never_zero(server, tiny_model_dir):
    with _host(_cfg(tiny_model_dir, f"openenv+{server}/unscored?max_tokens=4")) as (host, _, _):
        (failed,) = host.groups([(_records()[0], "0:w0", 1)])
    assert isinstance(failed, Unscored) and "unscored: no step of the episode gave a reward" in str(failed)


# ---------------------------------------------------------------------------------------------- a class here
def test_a_class_runs_in_this_process(tiny_model_dir):
    """`openenv:file.py:Class`: an instance per session, called as OpenEnv's server calls it."""
    cfg = _cfg(tiny_model_dir, f"openenv:{EXAMPLE}:ReverseEnvironment?max_tokens=4")
    with _host(cfg) as (host, tok, _):
        (group,) = host.groups([(_records()[0], "0:w0", 2)])
    assert not isinstance(group, Exception), group
    for c, s in zip(group.completions, group.scores):
        assert _runs(c.token_ids, c.loss_mask)[0][0] == 1 and 0.0 <= s.reward <= 1.0
        assert s.components == {"agent": s.reward}


# ---------------------------------------------------------------------------------------------- MCP tools
class Scripted:
    """A stand-in for the generation server (no model here writes tool calls): each turn answers
    the next of `replies` as token ids, and records the prompt it was sent."""

    def __init__(self, tok, replies):
        self.tok, self.replies, self.prompts = tok, list(replies), []

    def generate(self, session, prompt, params, first, cancel=None):
        from services.common.types import Completion, GenerationResult

        self.prompts.append(list(prompt))
        ids = self.tok(self.replies.pop(0), add_special_tokens=False)["input_ids"]
        return GenerationResult([[Completion(ids, [-0.5] * len(ids), "stop")]], 0, len(ids), 0.0)


@pytest.mark.parametrize("where", ["server", "class"])
def test_mcp_tools_are_offered_and_called_on_the_episodes_environment(server, tiny_model_dir, where):
    """An environment with MCP tools: they are offered to the policy as OpenAI tools; a reply that
    calls one is answered with the tool's result as a tool message (called on the session's own
    environment: over its WebSocket, or on its instance), in the same token-exact trajectory, and
    the next reply is the action."""
    import openai

    from services.agents.handler import TurnHandler
    from services.agents.routes import build_app
    from services.agents.session_store import Sessions
    from services.common.lifecycle import HTTPServerThread

    tok = load_tokenizer(tiny_model_dir)
    call = '<tool_call>\n{"name": "reverse", "arguments": {"text": "abcd"}}\n</tool_call>'
    sampler = Scripted(tok, [call, "dcba"])
    gateway = TurnHandler(tok, sampler, Sessions(), "tiny", 256, 1)
    http = HTTPServerThread(build_app(gateway, None), "127.0.0.1", 0, name="openenv-tools-test")
    url = f"http://127.0.0.1:{http.start()}/v1"
    ref = f"openenv+{server}/tools" if where == "server" else f"openenv:{EXAMPLE}:ReverseToolsEnvironment"
    run = openenv_agent(ref, max_turns=4, timeout_s=60)
    client = openai.OpenAI(base_url=url, api_key="unused", default_headers={"x-session-id": "t-1"}, max_retries=0)
    try:
        reward = run(client, PromptRecord("w", "abcd=", "dcba"))
    finally:
        http.stop()
    assert reward == 1.0  # the second reply, the word reversed, is the action
    (traj,) = gateway.sessions.find("t-1").record()["trajectories"]
    assert traj["turns"] == 2
    ids, mask = traj["token_ids"], traj["loss_mask"]
    assert tok.decode([t for t, m in zip(ids, mask) if m]).startswith(call)
    context = tok.decode(sampler.prompts[1][len(sampler.prompts[0]) :])
    assert "dcba" in context  # the tool's result, from the environment, before the second reply


# ---------------------------------------------------------------------------------------------- training
def test_train_local_on_a_server_runs_and_logs(server, local_session_cfg, tmp_path):
    """`rlhf train --local` with rollout.environment a server's URL: 2 iterations of GRPO whose
    samples are the environment's episodes (4 prompts x 2 sessions at once), the held-out eval
    through it too; every iteration's metrics logged (the wiring, not learning)."""
    from services.local import run_local

    cfg = local_session_cfg(
        prompt_length=64,
        response_length=48,
        rollout={"environment": f"openenv+{server}/reverse?max_tokens=6", "agent_timeout_s": 120},
    )
    run_dir = tmp_path / "run"
    assert run_local(cfg, run_dir)["iterations"] == 2
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == [0, 1, 2]
    for r in rows[1:]:
        assert r["rollout/samples"] == 8 and r["rollout/prompts_left_out"] == 0 and r["rollout/tokens"] > 0
        assert r["eval/failed"] == 0.0 and 0.0 <= r["eval/reward_mean"] <= 1.0
