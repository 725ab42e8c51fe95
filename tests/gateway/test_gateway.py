"""The gateway's OpenAI-compatible endpoint, through the official `openai` client, over real HTTP,
in front of real generation servers (gRPC over loopback, the tiny model): chat and completions,
n > 1, stop strings, auth; token-exact sessions (a 3-turn conversation's trajectory is the
sampled tokens and the environment's tokens, and the model's own log-probs of the sampled ones
are the recorded ones); a session whose server dies goes on on another."""

import httpx
import openai
import pytest
import torch

from services.agents.handler import TurnHandler
from services.agents.routes import build_app
from services.agents.session_store import Sessions
from services.agents.sessions import as_sample
from services.agents.turns import TurnSampler
from services.common.config import config_from_dict
from services.common.lifecycle import HTTPServerThread
from services.common.model_files import load_tokenizer
from services.common.servers import ServerPool
from services.common.types import Rollout
from services.generation.backend import HFBackend
from services.generation.client import generation_clients
from services.generation.server import serve
from services.learner.trainer import PolicyTrainer
from tests.grpc_helpers import TOKEN, on_free_ports
from tests.waits import wait_until


@pytest.fixture(scope="module")
def gcfg(tiny_model_dir):
    return config_from_dict(
        {
            "model": {"path": tiny_model_dir, "device": "cpu"},
            "prompt_length": 64,
            "response_length": 192,
            "rpc": {"auth_token": TOKEN, "max_samples_per_prompt": 8},
            "generation": {"batch_window_ms": 5},
        }
    )


class Running:
    """Generation servers and a gateway in front of them (its pool lists the servers alive)."""

    def __init__(self, cfg, model_dir, servers: int = 1):
        self.cfg = cfg
        self.gen = [
            serve(on_free_ports(cfg, "generation"), backend=HFBackend(model_dir, "cpu")).start() for _ in range(servers)
        ]
        self.pool = ServerPool(self._live, generation_clients(cfg.rpc), 0.0)
        self.tok = load_tokenizer(model_dir)
        self.gateway = TurnHandler(self.tok, TurnSampler(self.pool, 60), Sessions(), "tiny", cfg.response_length, 8)
        self.http = HTTPServerThread(build_app(self.gateway, TOKEN), "127.0.0.1", 0, name="gateway-test")
        self.url = f"http://127.0.0.1:{self.http.start()}/v1"
        self.client = openai.OpenAI(base_url=self.url, api_key=TOKEN, max_retries=0, timeout=120)

    def address(self, i: int) -> str:
        return f"127.0.0.1:{self.gen[i].server.port}"

    policy_versions: dict = {}  # server index -> the policy version the registry shows for it (default 0)

    def _live(self):
        return {
            self.address(i): {"policy_version": self.policy_versions.get(i, 0)}
            for i, s in enumerate(self.gen)
            if s.server is not None and s.ready
        }

    def close(self):
        self.http.stop()
        self.pool.close()
        for s in self.gen:
            s.stop()


@pytest.fixture(scope="module")
def one(gcfg, tiny_model_dir):
    r = Running(gcfg, tiny_model_dir)
    yield r
    r.close()


def test_chat_and_completions_through_the_openai_client(one):
    c = one.client
    chat = c.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "abc="}], max_tokens=8, temperature=0, n=1
    )
    assert chat.object == "chat.completion" and chat.choices[0].message.role == "assistant"
    assert chat.system_fingerprint == "policy-v0" and chat.usage.completion_tokens >= 1
    assert chat.choices[0].finish_reason in ("stop", "length")
    many = c.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "hello="}],
        max_tokens=6,
        temperature=1.0,
        n=4,
        logprobs=True,
    )
    assert len(many.choices) == 4 and [ch.index for ch in many.choices] == [0, 1, 2, 3]
    for ch in many.choices:
        assert all(lp.logprob <= 0 for lp in ch.logprobs.content) and len(ch.logprobs.content) >= 1
    done = c.completions.create(model="tiny", prompt="user: xyz=\nassistant: ", max_tokens=8, temperature=0)
    assert done.object == "text_completion" and done.choices[0].finish_reason in ("stop", "length")
    models = c.models.list()
    assert [m.id for m in models.data] == ["tiny"]


def test_a_stop_string_ends_the_text_before_it(one):
    c = one.client
    plain = c.completions.create(model="tiny", prompt="user: abcd=\nassistant: ", max_tokens=8, temperature=0)
    text = plain.choices[0].text
    assert len(text) >= 2, text
    stop = text[1]  # the second character the model writes greedily
    cut = c.completions.create(
        model="tiny", prompt="user: abcd=\nassistant: ", max_tokens=8, temperature=0, stop=[stop]
    )
    assert cut.choices[0].text == text[: text.index(stop)] and cut.choices[0].finish_reason == "stop"


def test_a_request_without_the_token_is_refused(one):
    bad = openai.OpenAI(base_url=one.url, api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "a="}], max_tokens=2)
    assert httpx.get(one.url.replace("/v1", "/health")).status_code == 200  # probes need no token


@pytest.mark.parametrize("run_token", [TOKEN, None])
def test_a_session_key_opens_its_own_session_on_its_own_endpoint_only(one, run_token):
    """What an agent is given instead of the run's token: the key of its session on the endpoint
    that opened it (a rollout worker's, with its own secret) serves that session's requests and
    record, and is refused for another session, for none, and on any other endpoint (the public
    gateway: one.url). Without a run token that endpoint still asks for the key."""
    from services.agents.routes import session_key

    http = HTTPServerThread(build_app(one.gateway, run_token, session_secret="s3cret"), "127.0.0.1", 0, name="keyed")
    url = f"http://127.0.0.1:{http.start()}/v1"
    key = session_key("s3cret", "s-key-a")

    def client(sid=None, base=url, api_key=key):
        headers = {"x-session-id": sid} if sid else {}
        return openai.OpenAI(base_url=base, api_key=api_key, default_headers=headers, max_retries=0)

    ask = {"model": "tiny", "messages": [{"role": "user", "content": "a="}], "max_tokens": 2, "temperature": 0}
    try:
        assert client("s-key-a").chat.completions.create(**ask).choices[0].message.role == "assistant"
        refused = [client("s-key-b"), client(None), client("s-key-a", base=one.url), client("s-key-b", api_key="x")]
        for c in refused:
            with pytest.raises(openai.AuthenticationError):
                c.chat.completions.create(**ask)
        auth = {"Authorization": f"Bearer {key}"}
        assert httpx.get(f"{url}/sessions/s-key-a", headers=auth).status_code == 200
        assert httpx.get(f"{url}/sessions/s-key-b", headers=auth).status_code == 401
        assert httpx.post(f"{url}/sessions/s-key-b/reward", json={"reward": 1.0}, headers=auth).status_code == 401
    finally:
        http.stop()


def test_a_streamed_answer_is_the_same_turn_in_chunks(one):
    """stream=True (clients that always stream): the openai client reads the same reply, finish
    reason and usage as unstreamed, and the session records the turn as it does any other."""
    messages = [{"role": "user", "content": "abc="}]
    kw = {"model": "tiny", "messages": messages, "max_tokens": 6, "temperature": 0}
    plain = one.client.chat.completions.create(**kw, extra_headers={"x-session-id": "plain"})
    stream = one.client.chat.completions.create(
        **kw, stream=True, stream_options={"include_usage": True}, extra_headers={"x-session-id": "streamed"}
    )
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == plain.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == plain.choices[0].finish_reason
    assert chunks[-1].usage.completion_tokens == plain.usage.completion_tokens
    assert chunks[0].system_fingerprint == plain.system_fingerprint
    streamed = one.gateway.sessions.find("streamed").record()["trajectories"][0]
    assert streamed["token_ids"] == one.gateway.sessions.find("plain").record()["trajectories"][0]["token_ids"]
    text = one.client.completions.create(model="tiny", prompt="user: xyz=\nassistant: ", max_tokens=4, stream=True)
    assert "".join(c.choices[0].text for c in text if c.choices)  # completions stream too


def _turn(client, session, messages, **kw):
    return client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=8, temperature=1.0, extra_headers={"x-session-id": session}, **kw
    )


def test_a_three_turn_session_is_token_exact(one, tiny_model_dir):
    c, tok = one.client, one.tok
    messages = [{"role": "user", "content": "abc="}]
    replies = []
    for turn in range(3):
        reply = _turn(c, "s-exact", messages).choices[0].message.content
        replies.append(reply)
        messages = messages + [
            {"role": "assistant", "content": reply},
            {"role": "user", "content": f"again {turn}="},
        ]
    record = httpx.get(f"{one.url}/sessions/s-exact", headers={"Authorization": f"Bearer {TOKEN}"}).json()
    (traj,) = record["trajectories"]
    ids, mask, logp = traj["token_ids"], traj["loss_mask"], traj["log_probs"]
    assert traj["turns"] == 3 and len(ids) == len(mask) == len(logp)
    # the prompt is the template's, tokenised once; then sampled runs and environment runs alternate
    first = tok.apply_chat_template([{"role": "user", "content": "abc="}], tokenize=False, add_generation_prompt=True)
    p0 = tok(first, add_special_tokens=False)["input_ids"]
    assert ids[: len(p0)] == p0 and mask[: len(p0)] == [0] * len(p0)
    runs, start = [], 0
    for i in range(1, len(mask) + 1):
        if i == len(mask) or mask[i] != mask[start]:
            runs.append((mask[start], ids[start:i]))
            start = i
    assert [m for m, _ in runs] == [0, 1, 0, 1, 0, 1]
    for (_, sampled), reply in zip(runs[1::2], replies):  # each sampled run is the reply it returned
        assert tok.decode(sampled, skip_special_tokens=True) == reply
    for (_, env), n in zip(runs[2::2], (0, 1)):  # the environment's runs are its messages, as templated
        assert f"again {n}=" in tok.decode(env)
        assert all(lp == 0.0 for lp, m in zip(logp, mask) if m == 0)
    # the policy's own log-probs of its sampled tokens, recomputed on the whole sequence, are the recorded ones
    model = HFBackend(tiny_model_dir, "cpu").model
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    lps = torch.log_softmax(logits[:-1], -1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]
    sampled_at = [i for i, m in enumerate(mask) if m == 1]
    recomputed = [lps[i - 1].item() for i in sampled_at]
    assert recomputed == pytest.approx([logp[i] for i in sampled_at], abs=1e-4)
    # and the learner, given the session as a sample, computes the same old log-probs, and takes
    # the environment's tokens out of its loss
    prompt, completion = as_sample(traj)
    rollout = Rollout([prompt], [completion.token_ids], [1.0], [0], [completion.log_probs], None, [0])
    rollout.loss_masks = [completion.loss_mask]
    learner = PolicyTrainer(
        config_from_dict(
            {
                "model": {"path": tiny_model_dir, "device": "cpu"},
                "adv_estimator": "reinforce",
                "fuse_old_log_probs": False,
                "prompt_length": 256,
                "response_length": 256,
            }
        )
    )
    exp = learner.make_experience(rollout)
    kept = exp.batch.response_mask[0].bool()
    assert exp.batch.response_mask[0, : len(completion.loss_mask)].tolist() == [float(m) for m in completion.loss_mask]
    assert exp.old_log_probs[0][kept].tolist() == pytest.approx(
        [lp for lp, m in zip(completion.log_probs, completion.loss_mask) if m], abs=1e-4
    )


def test_a_request_that_rewrites_the_history_starts_a_new_segment(one):
    c = one.client
    first = _turn(c, "s-branch", [{"role": "user", "content": "abc="}]).choices[0].message.content
    _turn(
        c,
        "s-branch",
        [
            {"role": "user", "content": "abc="},
            {"role": "assistant", "content": first + " (edited)"},
            {"role": "user", "content": "more="},
        ],
    )
    record = one.gateway.sessions.find("s-branch").record()
    assert [t["turns"] for t in record["trajectories"]] == [1, 1]  # two single-turn segments, each exact


def test_n_choices_are_branches_and_the_next_request_picks_one(one):
    c = one.client
    out = _turn(c, "s-n", [{"role": "user", "content": "abc="}], n=3)
    texts = [ch.message.content for ch in out.choices]
    record = one.gateway.sessions.find("s-n").record()
    assert len(record["trajectories"]) == 3  # pending: each choice its own trajectory
    chosen = texts[2]
    _turn(
        c,
        "s-n",
        [
            {"role": "user", "content": "abc="},
            {"role": "assistant", "content": chosen},
            {"role": "user", "content": "next="},
        ],
    )
    (traj,) = one.gateway.sessions.find("s-n").record()["trajectories"]
    assert traj["turns"] == 2 and chosen in one.tok.decode(traj["token_ids"], skip_special_tokens=True)


def test_a_session_whose_server_dies_goes_on_on_another(gcfg, tiny_model_dir):
    r = Running(gcfg, tiny_model_dir, servers=2)
    try:
        messages = [{"role": "user", "content": "abc="}]
        reply = _turn(r.client, "s-fail", messages).choices[0].message.content
        session = r.gateway.sessions.find("s-fail")
        first_server = session.server
        assert first_server in (r.address(0), r.address(1))
        reply2 = _turn(
            r.client, "s-fail", messages + [{"role": "assistant", "content": reply}, {"role": "user", "content": "x="}]
        )
        assert session.server == first_server  # sticky while it lives
        dead = [r.address(0), r.address(1)].index(first_server)
        r.gen[dead].stop()
        messages = messages + [
            {"role": "assistant", "content": reply},
            {"role": "user", "content": "x="},
            {"role": "assistant", "content": reply2.choices[0].message.content},
            {"role": "user", "content": "y="},
        ]
        _turn(r.client, "s-fail", messages)
        assert session.server == r.address(1 - dead)
        (traj,) = session.record()["trajectories"]
        assert traj["turns"] == 3  # one token-exact trajectory across the two servers
    finally:
        r.close()


def test_a_session_asking_for_a_version_goes_to_a_server_at_it(gcfg, tiny_model_dir):
    """A session opened with min_version (a prompt refed after a push) starts on a server the
    registry shows at that version, not on one still at an older one."""
    r = Running(gcfg, tiny_model_dir, servers=2)
    try:
        r.policy_versions = {1: 3}
        for k in range(4):  # round robin would give server 0 half of the time
            r.gateway.sessions.open(f"s-v{k}", min_version=3)
            _turn(r.client, f"s-v{k}", [{"role": "user", "content": "abc="}])
            assert r.gateway.sessions.find(f"s-v{k}").server == r.address(1)
    finally:
        r.close()


def test_rlhf_serve_gateway_wires_the_endpoint_to_the_configured_server(gcfg, tiny_model_dir):
    """The service `rlhf serve gateway` runs: its tokenizer, the generation server at
    `rpc.generation`, its HTTP port (0: a free one, reported on the LISTENING line)."""
    from services.common.lifecycle import listening_line
    from services.gateway.server import serve as serve_gateway

    with serve(on_free_ports(gcfg, "generation"), backend=HFBackend(tiny_model_dir, "cpu")) as gen:
        cfg = gcfg.model_copy(deep=True)
        cfg.rpc.generation.port = gen.server.port
        cfg.rpc.gateway.port = 0
        with serve_gateway(cfg) as gw:
            line = listening_line(gw)
            assert line.startswith("LISTENING service=gateway http_port=") and gw.ready
            client = openai.OpenAI(base_url=f"http://127.0.0.1:{gw.port}/v1", api_key=TOKEN, max_retries=0)
            out = client.chat.completions.create(
                model="x", messages=[{"role": "user", "content": "abc="}], max_tokens=4, temperature=0
            )
            assert out.choices[0].message.content is not None
            model = client.models.list().data[0]
            assert model.id == tiny_model_dir and model.policy_version == 0  # asked of the configured server


def test_the_end_of_turn_is_added_unless_the_policy_sampled_it(tiny_model_dir):
    """A turn cut by a stop string (or a stop token other than EOS) did not sample its end of
    turn: the environment's tokens start with the template's whole closing; one that sampled EOS
    gets only the rest of it."""
    from services.agents.chat_tokens import ChatTokens
    from services.agents.sessions import Choice

    tok = load_tokenizer(tiny_model_dir)
    tok.chat_template = (
        "{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>\n{% endfor %}"
        "{% if add_generation_prompt %}<s>assistant\n{% endif %}"
    )
    chat = ChatTokens(tok)
    assert chat.closing == "</s>\n" and chat.eos_text == "</s>"
    before = [{"role": "user", "content": "abc="}, {"role": "assistant", "content": "cb"}]
    after = [{"role": "user", "content": "again="}]
    reply = tok("cb", add_special_tokens=False)["input_ids"]
    with_eos = chat.continuation(before, after, Choice(reply + [tok.eos_token_id], [0.0] * 3, "cb", "stop", 0), None)
    cut = chat.continuation(before, after, Choice(reply, [0.0] * 2, "cb", "stop", 0), None)
    assert tok.decode(with_eos).startswith("\n<s>user")
    assert tok.decode(cut).startswith("</s>\n<s>user")


def test_a_turn_that_fails_changes_nothing_and_can_be_sent_again(gcfg, tiny_model_dir):
    r = Running(gcfg, tiny_model_dir, servers=1)
    try:
        messages = [{"role": "user", "content": "abc="}]
        reply = _turn(r.client, "s-retry", messages).choices[0].message.content
        messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": "x="}]
        r.gen[0].stop()  # no generation server left: the turn fails
        with pytest.raises(openai.APIStatusError) as failed:
            _turn(r.client, "s-retry", messages)
        assert failed.value.status_code == 503
        r.gen.append(serve(on_free_ports(gcfg, "generation"), backend=HFBackend(tiny_model_dir, "cpu")).start())
        _turn(r.client, "s-retry", messages)  # the same request again, now a server answers
        (traj,) = r.gateway.sessions.find("s-retry").record()["trajectories"]
        assert traj["turns"] == 2  # it went on token-exact: the failure left no trace
    finally:
        r.close()


def test_health_says_ready_only_when_a_turn_would_be_served(gcfg, tiny_model_dir):
    """After a generation server's restart /health said 200 about 6 s before turns stopped failing
    (the turns' pool still avoided the server that had failed): now what /health finds answering
    is let back at once, and a turn that finds every server avoided asks as /health does."""
    from services.common.servers import RetryPolicy

    r = Running(gcfg, tiny_model_dir, servers=1)
    pool = ServerPool.fixed(r.address(0), generation_clients(gcfg.rpc))  # as a configured server: listed while down
    r.gateway.sampler = TurnSampler(pool, 60)
    r.gateway.sampler.RETRY = RetryPolicy(avoid_s=600.0, each_once=True)  # a failed server stays avoided
    base = r.url.removesuffix("/v1")
    try:
        for ask_health in (True, False):
            port = r.gen[0].server.port
            r.gen[0].stop()
            with pytest.raises(openai.APIStatusError) as failed:
                _turn(r.client, f"s-health-{ask_health}", [{"role": "user", "content": "abc="}])
            assert failed.value.status_code == 503 and pool.avoided()
            cfg = gcfg.model_copy(deep=True)
            cfg.rpc.generation.port = port  # the same address, restarted
            r.gen[0] = serve(cfg, backend=HFBackend(tiny_model_dir, "cpu")).start()
            if ask_health:  # once /health says 200, a turn is served at once
                wait_until(lambda: httpx.get(base + "/health", timeout=30).status_code == 200, "/health 200", 60)
                reply = _turn(r.client, "s-health", [{"role": "user", "content": "abc="}])
            else:  # with nobody asking /health, turns find the server again within seconds, not 600
                reply = wait_until(lambda: _served(r.client, "s-health-2"), "a turn served", 60)
            assert reply.choices[0].message.content is not None and not pool.avoided()
    finally:
        pool.close()
        r.close()


def _served(client, session):
    """A turn's reply, or None when it was refused 503 (no generation server is available)."""
    try:
        return _turn(client, session, [{"role": "user", "content": "abc="}])
    except openai.APIStatusError as e:
        assert e.status_code == 503
        return None
