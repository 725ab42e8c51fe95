"""NeMo Gym's token fields on the gateway, through the official `openai` client over real HTTP, in
front of a real generation server (the tiny model): every choice carries `prompt_token_ids`,
`generation_token_ids` and `generation_log_probs` (the session's trajectory, token for token);
an assistant message that carries them back goes on from those tokens (in its session, without
one, in a new session), the next prompt the echoed tokens and the template's tokens of the new
messages; malformed fields are 400s in the one error shape; the per-session URL form
`/sessions/{id}/v1/...` serves a session with auth decided before the body is read; a session
without a reward is unscored, never 0 (the gateway's record, the agent host's groups, the eval's
rows)."""

import json
import math
import threading

import httpx
import openai
import pytest

from services.agents.host import AgentFailed, AgentHost, Unscored
from services.agents.routes import build_app, session_key
from services.agents.sampler import AgentSampler
from services.common.config import config_from_dict
from services.common.lifecycle import HTTPServerThread
from services.common.types import PromptRecord, SampleGroup, SamplingParams
from services.training.evaluate import Evaluator
from tests.gateway.test_gateway import Running
from tests.grpc_helpers import TOKEN
from tests.http_helpers import error_of, head, raw

AUTH = {"Authorization": f"Bearer {TOKEN}"}
FIELDS = ("prompt_token_ids", "generation_token_ids", "generation_log_probs")
FIRST = [{"role": "user", "content": "abc="}]
AFTER = [{"role": "user", "content": "again="}]


@pytest.fixture(scope="module")
def up(tiny_model_dir):
    cfg = config_from_dict(
        {
            "model": {"path": tiny_model_dir, "device": "cpu"},
            "prompt_length": 64,
            "response_length": 192,
            "rpc": {"auth_token": TOKEN, "max_samples_per_prompt": 8},
            "generation": {"batch_window_ms": 5},
        }
    )
    r = Running(cfg, tiny_model_dir)
    r.base = r.url.removesuffix("/v1")
    yield r
    r.close()


def chat(client, messages, session=None, **kw):
    headers = {"x-session-id": session} if session else {}
    kw = {"max_tokens": 6, "temperature": 0, **kw}
    return client.chat.completions.create(model="tiny", messages=messages, extra_headers=headers, **kw)


def record(up, sid) -> dict:
    r = httpx.get(f"{up.url}/sessions/{sid}", headers=AUTH)
    assert r.status_code == 200, r.text
    return r.json()


def fields(obj) -> tuple[list, list, list]:
    return tuple(getattr(obj, k) for k in FIELDS)


def echoed(message) -> dict:
    """The assistant message as a client sends it back: as it got it, the token fields included."""
    out = message.model_dump(exclude_none=True)
    assert all(k in out for k in FIELDS)
    return out


def environment(tok, before, reply, after) -> list[int]:
    """The template's tokens of `after` following the assistant's `reply` to `before` (what the
    tiny model's template writes after the reply, up to the next generation prompt)."""
    full = tok.apply_chat_template(
        before + [{"role": "assistant", "content": reply}] + after, tokenize=False, add_generation_prompt=True
    )
    start = len(tok.apply_chat_template(before, tokenize=False, add_generation_prompt=True)) + len(reply)
    return tok(full[start:], add_special_tokens=False)["input_ids"]


def test_every_choice_carries_the_tokens_of_its_trajectory(up):
    out = chat(up.client, FIRST, "tf-n", n=3, temperature=1.0)
    trajectories = record(up, "tf-n")["trajectories"]  # pending: one per choice
    assert len(trajectories) == len(out.choices) == 3
    for choice, t in zip(out.choices, trajectories):
        prompt, generation, log_probs = fields(choice.message)
        assert t["token_ids"] == prompt + generation and t["log_probs"][len(prompt) :] == log_probs
        assert t["loss_mask"] == [0] * len(prompt) + [1] * len(generation)
        assert up.tok.decode(generation, skip_special_tokens=True) == choice.message.content
        assert all(isinstance(x, float) and x <= 0 for x in log_probs)
    assert out.usage.prompt_tokens == len(prompt)
    done = up.client.completions.create(
        model="tiny", prompt="user: xyz=\nassistant: ", max_tokens=4, extra_headers={"x-session-id": "tf-c"}
    )
    (t,) = record(up, "tf-c")["trajectories"]
    prompt, generation, log_probs = fields(done.choices[0])
    assert t["token_ids"] == prompt + generation and t["log_probs"][len(prompt) :] == log_probs
    stream = chat(up.client, FIRST, "tf-stream", stream=True)
    first = next(c for c in stream if c.choices)
    (t,) = record(up, "tf-stream")["trajectories"]
    assert first.choices[0].delta.prompt_token_ids + first.choices[0].delta.generation_token_ids == t["token_ids"]


def test_sending_them_back_goes_on_token_exact_in_the_session(up):
    r1 = chat(up.client, FIRST, "tf-echo")
    p1, g1, _ = fields(r1.choices[0].message)
    r2 = chat(up.client, FIRST + [echoed(r1.choices[0].message)] + AFTER, "tf-echo")
    p2, g2, lp2 = fields(r2.choices[0].message)
    env = environment(up.tok, FIRST, r1.choices[0].message.content, AFTER)
    assert p2 == p1 + g1 + env
    (t,) = record(up, "tf-echo")["trajectories"]  # one segment: it went on
    assert t["turns"] == 2 and t["token_ids"] == p2 + g2 and t["log_probs"][len(p2) :] == lp2
    assert t["loss_mask"] == [0] * len(p1) + [1] * len(g1) + [0] * len(env) + [1] * len(g2)


def test_sending_them_back_without_a_session_goes_on_from_them(up):
    """A client without a session header (each request a fresh session), and a new session built
    from another's turn: the next prompt is the echoed tokens and the new messages', as in the
    session they came from; the echoed tokens are context in the new session (mask 0)."""
    r1 = chat(up.client, FIRST)
    p1, g1, _ = fields(r1.choices[0].message)
    messages = FIRST + [echoed(r1.choices[0].message)] + AFTER
    r2 = chat(up.client, messages)
    p2, g2, _ = fields(r2.choices[0].message)
    assert p2 == p1 + g1 + environment(up.tok, FIRST, r1.choices[0].message.content, AFTER)
    assert r2.session_id != r1.session_id
    (t,) = record(up, r2.session_id)["trajectories"]
    assert t["token_ids"] == p2 + g2 and t["loss_mask"] == [0] * len(p2) + [1] * len(g2) and t["turns"] == 1
    # the same turn, sent to another (new) session, and to the one it came from: the same prompt
    r3 = chat(up.client, messages, "tf-rebuilt")
    assert fields(r3.choices[0].message)[0] == p2
    r4 = chat(up.client, messages, r1.session_id)
    assert fields(r4.choices[0].message)[0] == p2
    assert [x["turns"] for x in record(up, r1.session_id)["trajectories"]] == [2]  # its own turn: it went on


def test_tokens_the_session_did_not_sample_start_a_new_segment(up):
    r1 = chat(up.client, FIRST, "tf-forged")
    p1, g1, lp1 = fields(r1.choices[0].message)
    assert len(g1) >= 2
    forged = {**echoed(r1.choices[0].message), "generation_token_ids": g1[:-1], "generation_log_probs": lp1[:-1]}
    r2 = chat(up.client, FIRST + [forged] + AFTER, "tf-forged")
    p2 = fields(r2.choices[0].message)[0]
    assert p2 == p1 + g1[:-1] + environment(up.tok, FIRST, r1.choices[0].message.content, AFTER)
    first, second = record(up, "tf-forged")["trajectories"]
    assert first["token_ids"] == p1 + g1 and second["token_ids"][: len(p2)] == p2
    assert second["loss_mask"][: len(p2)] == [0] * len(p2)  # what a client sent is never the policy's sample


def test_the_session_in_the_path(up):
    """`/sessions/{id}/v1` as the client's base URL: chat, completions and models, the session
    the path names (an id with slashes too); a header naming another session is refused."""
    client = openai.OpenAI(base_url=f"{up.base}/sessions/tf-path/v1", api_key=TOKEN, max_retries=0)
    r1 = chat(client, FIRST)
    assert r1.session_id == "tf-path"
    r2 = chat(client, FIRST + [echoed(r1.choices[0].message)] + AFTER)
    (t,) = record(up, "tf-path")["trajectories"]
    assert (
        t["turns"] == 2
        and t["token_ids"][: len(r2.choices[0].message.prompt_token_ids)] == fields(r2.choices[0].message)[0]
    )
    assert [m.id for m in client.models.list().data] == ["tiny"]
    slashed = openai.OpenAI(base_url=f"{up.base}/sessions/u-1/0/ab12/v1", api_key=TOKEN, max_retries=0)
    done = slashed.completions.create(model="tiny", prompt="user: xyz=\nassistant: ", max_tokens=2)
    assert done.session_id == "u-1/0/ab12" and record(up, "u-1/0/ab12")["trajectories"][0]["turns"] == 1
    with pytest.raises(openai.BadRequestError) as refused:
        chat(client, FIRST, session="tf-other")
    assert refused.value.body["param"] == "x-session-id"
    error_of(httpx.post(f"{up.base}/sessions//v1/chat/completions", json={"messages": FIRST}, headers=AUTH), 400)


def test_the_session_in_the_path_is_authorized_before_the_body_is_read(up):
    """A rollout worker's endpoint (session keys): the key of the session the path names opens it
    there, and no other; a wrong key with a body announced as 10 GB is refused at once (401), and
    the right one gets the size limit's 413 at once: neither reads the body."""
    http = HTTPServerThread(build_app(up.gateway, TOKEN, session_secret="s3cret"), "127.0.0.1", 0, name="path-keyed")
    port = http.start()
    base = f"http://127.0.0.1:{port}"
    key = session_key("s3cret", "tf-key")
    try:
        mine = openai.OpenAI(base_url=f"{base}/sessions/tf-key/v1", api_key=key, max_retries=0)
        assert chat(mine, FIRST).session_id == "tf-key"
        assert [m.id for m in mine.models.list().data] == ["tiny"]
        other = openai.OpenAI(base_url=f"{base}/sessions/tf-key-b/v1", api_key=key, max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            chat(other, FIRST)
        with pytest.raises(openai.AuthenticationError):
            other.models.list()
        with pytest.raises(openai.BadRequestError):  # authorized for the path's session, not the header's
            chat(mine, FIRST, session="tf-key-b")
        huge = "Content-Length: 10000000000"
        status, _, body, seconds = raw(
            port, head("/sessions/tf-key/v1/chat/completions", "Authorization: Bearer x", huge)
        )
        assert status == 401 and seconds < 5 and json.loads(body)["error"]["code"] == "invalid_api_key"
        status, _, body, seconds = raw(
            port, head("/sessions/tf-key-b/v1/completions", f"Authorization: Bearer {key}", huge)
        )
        assert status == 401 and seconds < 5
        status, _, body, seconds = raw(
            port, head("/sessions/tf-key/v1/chat/completions", f"Authorization: Bearer {key}", huge)
        )
        assert status == 413 and seconds < 5 and json.loads(body)["error"]["code"] == "request_too_large"
    finally:
        http.stop()


def _bad(message: dict, vocab: int, too_long: int) -> list[tuple[str, dict, str]]:
    """(case, the assistant message as sent, the param named)."""
    p, g, lp = (message[k] for k in FIELDS)
    at = "messages[1]."
    return [
        ("a float id", {**message, "prompt_token_ids": [1.5] + p}, at + "prompt_token_ids"),
        ("a string id", {**message, "prompt_token_ids": ["3"] + p}, at + "prompt_token_ids"),
        ("a bool id", {**message, "generation_token_ids": [True] + g[1:]}, at + "generation_token_ids"),
        ("outside the vocabulary", {**message, "prompt_token_ids": p + [vocab]}, at + "prompt_token_ids"),
        ("negative", {**message, "generation_token_ids": [-1] + g[1:]}, at + "generation_token_ids"),
        ("outside int32", {**message, "prompt_token_ids": [2**31] + p}, at + "prompt_token_ids"),
        ("an empty prompt", {**message, "prompt_token_ids": []}, at + "prompt_token_ids"),
        ("not a list", {**message, "prompt_token_ids": "abc"}, at + "prompt_token_ids"),
        ("null", {**message, "generation_token_ids": None}, at + "generation_token_ids"),
        ("a NaN log-prob", {**message, "generation_log_probs": [math.nan] + lp[1:]}, at + "generation_log_probs"),
        ("an inf log-prob", {**message, "generation_log_probs": lp[:-1] + [-math.inf]}, at + "generation_log_probs"),
        ("a string log-prob", {**message, "generation_log_probs": ["x"] + lp[1:]}, at + "generation_log_probs"),
        ("log-probs not a list", {**message, "generation_log_probs": {"a": 1}}, at + "generation_log_probs"),
        ("one log-prob short", {**message, "generation_log_probs": lp[:-1]}, at + "generation_log_probs"),
        ("one id more", {**message, "generation_token_ids": g + [5]}, at + "generation_log_probs"),
        ("too long", {**message, "prompt_token_ids": [5] * too_long}, at + "prompt_token_ids"),
        (
            "one field missing",
            {k: v for k, v in message.items() if k != "generation_log_probs"},
            at + "generation_log_probs",
        ),
    ]


def test_malformed_token_fields_are_400s_in_the_one_shape(up):
    message = echoed(chat(up.client, FIRST).choices[0].message)
    cases = _bad(message, len(up.tok), up.gateway.limits.max_context + 1)
    for case, bad, param in cases:
        body = {"model": "tiny", "messages": FIRST + [bad] + AFTER, "max_tokens": 2}
        r = httpx.post(
            f"{up.url}/chat/completions",
            content=json.dumps(body, allow_nan=True).encode(),
            headers={**AUTH, "content-type": "application/json"},
            timeout=60,
        )
        e = error_of(r, 400, param=param)
        assert len(r.content) < 1000, case  # the input is not echoed
        if case == "too long":
            assert e["code"] == "context_length_exceeded"
    on_a_user_message = [{**FIRST[0], **{k: message[k] for k in FIELDS}}]
    r = httpx.post(f"{up.url}/chat/completions", json={"messages": on_a_user_message}, headers=AUTH, timeout=60)
    error_of(r, 400, param="messages[0].prompt_token_ids")
    assert len(up.tok) < 2**31  # a token id in the vocabulary is an int32 on the wire


def test_a_session_without_a_reward_is_unscored_never_0(up):
    chat(up.client, FIRST, "tf-reward")
    shown = record(up, "tf-reward")
    assert shown["reward"] is None and shown["unscored"] is True
    for bad in (math.nan, -math.inf, None, "1"):
        r = httpx.post(
            f"{up.url}/sessions/tf-reward/reward",
            content=json.dumps({"reward": bad}, allow_nan=True).encode(),
            headers={**AUTH, "content-type": "application/json"},
        )
        error_of(r, 400, param="reward")
    assert record(up, "tf-reward")["unscored"] is True
    assert httpx.post(f"{up.url}/sessions/tf-reward/reward", json={"reward": 0.0}, headers=AUTH).status_code == 200
    shown = record(up, "tf-reward")
    assert shown["reward"] == 0.0 and shown["unscored"] is False


def test_an_agent_without_a_reward_is_a_dead_letter_and_an_unscored_eval_row(up):
    """An agent whose session gives no reward (None, NaN) fails its prompt as `Unscored` (an
    AgentFailed: the worker dead-letters it), never a group with a reward of 0; in an eval its row
    counts 0 as any failure does, marked `unscored` (a failure of another kind is not)."""

    def agent(client, sample):
        client.chat.completions.create(model="policy", messages=[{"role": "user", "content": sample.prompt}])
        return {"none": None, "nan": math.nan, "one": 1.0}.get(sample.label, sample.label)

    host = AgentHost(
        agent, up.tok, up.pool, SamplingParams(temperature=1.0, max_new_tokens=4),
        model_name="tiny", max_tokens=16, token=None, generate_timeout_s=60, timeout_s=120,
    )  # fmt: skip
    try:
        items = [(PromptRecord(f"p-{label}", "abc=", label), f"u-{label}", 2) for label in ("none", "nan", "one")]
        out = host.groups(items)
        assert [type(x) for x in out] == [Unscored, Unscored, SampleGroup]
        assert all(isinstance(x, AgentFailed) for x in out[:2]) and "not a finite number" in str(out[0])
        assert [s.reward for s in out[2].scores] == [1.0, 1.0]
        for reward in (None, math.nan, math.inf, "1", True):
            assert isinstance(AgentHost._checked("s", reward), Unscored)
        rows = Evaluator(AgentSampler(up.cfg, host, up.tok, None, threading.Event(), group_size=1, backoff_s=0)).rows(
            [PromptRecord("e-none", "abc=", "none"), PromptRecord("e-one", "abc=", "one")]
        )
        assert [(r["reward"], r["components"]["failed"], r["unscored"]) for r in rows] == [
            (0.0, 1.0, True),
            (1.0, 0.0, False),
        ]
    finally:
        host.close()


def test_the_overhead_of_the_fields_in_bytes(up, capsys):
    """What the fields add to an answer (printed: the report's number), and that it is what their
    JSON is: a turn's prompt and its reply's ids and log-probs."""
    r = httpx.post(
        f"{up.url}/chat/completions",
        json={"model": "tiny", "messages": FIRST, "max_tokens": 8, "temperature": 0},
        headers=AUTH,
    )
    body = r.json()
    message = body["choices"][0]["message"]
    extra = len(json.dumps({k: message[k] for k in FIELDS})) - 2
    without = len(
        json.dumps(
            {
                **body,
                "choices": [{**body["choices"][0], "message": {k: v for k, v in message.items() if k not in FIELDS}}],
            }
        )
    )
    assert 0 < extra < len(r.content) and len(r.content) > without
    with capsys.disabled():
        print(
            f"\ntoken fields: {extra} bytes of a {len(r.content)}-byte answer "
            f"({len(message['prompt_token_ids'])} prompt tokens, {len(message['generation_token_ids'])} generated)"
        )


def test_a_template_that_rewrites_earlier_turns_cannot_go_on_from_echoed_tokens(tiny_model_dir):
    """A chat template that renders an assistant turn one way while it is the last message and
    another once more follow (as templates that drop earlier turns' reasoning do): the echoed
    tokens cannot be told apart from the new messages', so the request is refused (the gateway
    answers 400 naming the message), never re-templated behind the client's back."""
    from services.agents.chat_tokens import ChatTokens, NotTokenExact
    from services.agents.sessions import Echo, Session
    from services.common.model_files import load_tokenizer

    tok = load_tokenizer(tiny_model_dir)
    tok.chat_template = (
        "{% for m in messages %}{{ m['role'] }}: "
        "{% if m['role'] == 'assistant' and not loop.last %}(said){% else %}{{ m['content'] }}{% endif %}\n"
        "{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}"
    )
    prompt = tok(tok.apply_chat_template(FIRST, tokenize=False, add_generation_prompt=True), add_special_tokens=False)
    generation = tok("cb", add_special_tokens=False)["input_ids"]
    echo = Echo(1, prompt["input_ids"], generation, [-0.5] * len(generation), len(prompt["input_ids"]))
    messages = FIRST + [{"role": "assistant", "content": "cb"}] + AFTER
    with pytest.raises(NotTokenExact) as refused:
        Session("s").plan(ChatTokens(tok), messages, None, echo)
    assert refused.value.index == 1


def test_a_session_whose_turns_came_from_two_versions_keeps_each_turns_version():
    """A session's trajectory as a sample: each turn's tokens carry the version that sampled that
    turn (the environment's tokens after it too; they are out of the loss), so the learner's
    staleness bound judges each turn by its own; one version in all: none."""
    from services.agents.sessions import as_sample, turn_versions

    traj = {
        "token_ids": [1, 2, 3, 10, 11, 4, 5, 12, 13, 14],
        "loss_mask": [0, 0, 0, 1, 1, 0, 0, 1, 1, 1],
        "log_probs": [0.0] * 10,
        "policy_versions": [3, 5],
        "finish_reason": "stop",
    }
    prompt, c = as_sample(traj)
    assert prompt == [1, 2, 3] and c.token_ids == [10, 11, 4, 5, 12, 13, 14]
    assert c.token_versions == [3, 3, 3, 3, 5, 5, 5]
    assert as_sample({**traj, "policy_versions": [4, 4]})[1].token_versions is None
    assert turn_versions([1, 1, 0, 1], [1, 2, 3]) is None  # runs and turns disagree: the group's one version
