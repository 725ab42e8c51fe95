"""The edges an outsider found in the gateway after the first hardening (issue 54), each the request
that triggered it and the answer now: content that is not text bounded as text, stop strings
bounded, a session id that cannot travel in a header refused before any work, a request that can
never fit a 400 naming the bound (not a 429 to retry), sessions kept only once a turn of theirs
succeeds, and a completions prompt tokenised as the trainer tokenises it. The real service over
real HTTP in front of a real generation server (the tiny model)."""

import json
import time

import httpx
import pytest

from services.common.config import config_from_dict
from services.common.model_files import load_tokenizer
from services.common.rpc.errors import Reason
from services.gateway.server import serve as serve_gateway
from services.generation.backend import HFBackend
from services.generation.server import serve
from tests.grpc_helpers import TOKEN, on_free_ports
from tests.http_helpers import error_of

AUTH = {"Authorization": f"Bearer {TOKEN}", "content-type": "application/json"}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "abc="}], "max_tokens": 2, "temperature": 0}
MAX_REQUEST_TOKENS = 100  # n=4 x (a few prompt tokens + 32) is more


def _cfg(model_dir, max_request_tokens):
    return config_from_dict(
        {
            "model": {"path": model_dir, "device": "cpu"},
            "prompt_length": 64,
            "response_length": 32,
            "rpc": {
                "auth_token": TOKEN,
                "max_samples_per_prompt": 4,
                "max_request_tokens": max_request_tokens,
                "gateway": {"port": 0, "max_request_bytes": 16 << 20, "max_session_id_bytes": 128},
            },
            "generation": {"batch_window_ms": 1},
        }
    )


class Up:
    """A generation server (its own max_request_tokens) and `rlhf serve gateway` in front of it
    (the gateway's)."""

    def __init__(self, model_dir, server_tokens, gateway_tokens):
        self.gen = serve(
            on_free_ports(_cfg(model_dir, server_tokens), "generation"), backend=HFBackend(model_dir, "cpu")
        ).start()
        cfg = _cfg(model_dir, gateway_tokens)
        cfg.rpc.generation.port = self.gen.server.port
        self.gw = serve_gateway(cfg).start()
        self.base = f"http://127.0.0.1:{self.gw.port}"
        self.sessions = self.gw.handler.sessions

    def post(self, path, body):
        return httpx.post(self.base + path, content=json.dumps(body).encode(), headers=AUTH, timeout=120)

    def close(self):
        self.gw.stop()
        self.gen.stop()


@pytest.fixture(scope="module")
def up(tiny_model_dir):
    u = Up(tiny_model_dir, 4_194_304, MAX_REQUEST_TOKENS)
    yield u
    u.close()


def test_content_that_is_not_text_is_refused_or_bounded_as_text_before_the_template(up):
    """`content: [0] * 2500000` (7.5 MB) was rendered by the chat template and tokenised whole
    (16-57 s, 3.4 GB): now a 413 before it is parsed (more JSON values than any request needs), and
    under that bound a 400 naming the field, at once; numbers inside content parts count
    as the text they would render as."""
    t0 = time.perf_counter()
    e = error_of(
        up.post("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": [0] * 2_500_000}]}), 413
    )
    assert e["code"] == "request_too_large" and "JSON values" in e["message"]  # not even parsed
    e = error_of(
        up.post("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": [0] * 200_000}]}), 400
    )
    assert e["param"] == "messages[0].content" and "content parts" in e["message"]
    parts = [{"type": "text", "text": "a", "n": [0] * 100_000}]
    e = error_of(up.post("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": parts}]}), 400)
    assert e["code"] == "context_length_exceeded" and e["param"] == "messages"
    error_of(up.post("/v1/chat/completions", {**CHAT, "messages": ["abc="]}), 400, param="messages[0]")
    assert time.perf_counter() - t0 < 30  # was minutes of one core; the checks are linear in the body
    assert up.post("/v1/chat/completions", CHAT).status_code == 200  # and the gateway serves on


def test_stop_strings_are_bounded_by_what_a_reply_can_be(up):
    """Four 2 MB stop strings were taken (13-23 s, 1.4 GB); one longer than a whole reply can be
    never matches: 400 naming `stop`."""
    longest = up.gw.handler.limits.max_tokens * up.gw.handler.limits.token_chars
    e = error_of(up.post("/v1/chat/completions", {**CHAT, "stop": ["x" * (longest + 1)]}), 400, param="stop")
    assert f"({longest} characters)" in e["message"]
    assert up.post("/v1/chat/completions", {**CHAT, "stop": ["x" * longest]}).status_code == 200


@pytest.mark.parametrize("sid", [" s-space", "s-space ", " "])
def test_a_session_id_that_cannot_travel_in_a_header_is_refused_before_any_work(up, sid):
    """A leading or trailing space: the turn was sampled and recorded, then the answer could not
    be sent (an illegal x-session-id header); now a 400 and no session."""
    before = len(up.sessions)
    e = error_of(up.post("/v1/chat/completions", {**CHAT, "session_id": sid}), 400, param="session_id")
    assert "no space at either end" in e["message"]
    assert up.sessions.find(sid) is None and len(up.sessions) == before
    ok = up.post("/v1/chat/completions", {**CHAT, "session_id": "s a"})  # a space inside travels
    assert ok.status_code == 200 and ok.headers["x-session-id"] == "s a"


def test_a_request_that_can_never_fit_is_400_naming_the_bound(up):
    """n x (prompt + max_tokens) over rpc.max_request_tokens was a 429 "the generation server is
    full", which clients retry for ever: now a 400 naming the bound, before any sampling."""
    before = len(up.sessions)
    e = error_of(
        up.post("/v1/chat/completions", {**CHAT, "n": 4, "max_tokens": 32, "session_id": "s-huge"}),
        400,
        param="n",
        code="request_too_large",
    )
    assert f"rpc.max_request_tokens={MAX_REQUEST_TOKENS}" in e["message"]
    assert up.sessions.find("s-huge") is None and len(up.sessions) == before


def test_a_server_with_a_smaller_bound_than_the_gateway_is_a_400_too(tiny_model_dir):
    """The generation server's own bound (its `Reason.REQUEST_TOO_LARGE`, RESOURCE_EXHAUSTED) is
    a 400 at the gateway too, whatever the gateway's own bound says."""
    u = Up(tiny_model_dir, MAX_REQUEST_TOKENS, 4_194_304)
    try:
        e = error_of(u.post("/v1/chat/completions", {**CHAT, "n": 4, "max_tokens": 32}), 400, code="request_too_large")
        assert f"rpc.max_request_tokens={MAX_REQUEST_TOKENS}" in e["message"]
        assert Reason.REQUEST_TOO_LARGE.value == "REQUEST_TOO_LARGE"
    finally:
        u.close()


def test_sessions_are_kept_only_once_a_turn_of_theirs_succeeds(up):
    """A refused request started its (empty) session, which counted toward max_sessions and could
    evict real ones: now a session is kept only once a turn of it is taken."""
    before = len(up.sessions)
    too_long = {**CHAT, "session_id": "s-refused", "messages": [{"role": "user", "content": "ab=" * 40}]}
    error_of(up.post("/v1/chat/completions", too_long), 400, code="context_length_exceeded")
    error_of(up.post("/v1/completions", {"prompt": "", "max_tokens": 2, "session_id": "s-refused"}), 400)
    assert up.sessions.find("s-refused") is None and len(up.sessions) == before
    ok = up.post("/v1/chat/completions", {**CHAT, "session_id": "s-refused"})
    assert ok.status_code == 200 and up.sessions.find("s-refused") is not None
    assert len(up.sessions) == before + 1 and up.sessions.bytes >= up.sessions.find("s-refused").bytes


def test_the_next_turn_of_a_forgotten_session_is_refused_not_started_afresh(up):
    """An evicted session's next turn silently started a new session whose record lacked the
    earlier turns (their sampled tokens out of the loss mask): now a 410 naming the bound that
    forgot it, which the openai client does not retry."""
    limit = up.sessions.limit
    up.sessions.limit = 1  # each new session evicts the one before
    try:
        assert up.post("/v1/chat/completions", {**CHAT, "session_id": "forgot-a"}).status_code == 200
        assert up.post("/v1/chat/completions", {**CHAT, "session_id": "forgot-b"}).status_code == 200
        assert up.sessions.find("forgot-a") is None
        again = {
            **CHAT,
            "session_id": "forgot-a",
            "messages": CHAT["messages"] + [{"role": "assistant", "content": "x"}],
        }
        e = error_of(up.post("/v1/chat/completions", again), 410, code="session_evicted", param="session_id")
        assert "max_sessions" in e["message"] and "new session id" in e["message"]
        assert up.sessions.find("forgot-a") is None
    finally:
        up.sessions.limit = limit
    assert up.post("/v1/chat/completions", {**CHAT, "session_id": "forgot-c"}).status_code == 200


def test_a_completions_prompt_is_tokenised_as_the_trainer_tokenises_it(up, tiny_model_dir):
    """The text of /v1/completions was tokenised without the special tokens the generation server
    and the trainer add (`<s>` on the tiny model): an agent was sampled on another context than
    single-turn training uses."""
    tok = load_tokenizer(tiny_model_dir)
    r = up.post("/v1/completions", {"prompt": "abcd=", "max_tokens": 4, "temperature": 0})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["prompt_token_ids"] == tok("abcd=")["input_ids"]
    assert choice["prompt_token_ids"][0] == tok.bos_token_id
    as_ids = up.post("/v1/completions", {"prompt": tok("abcd=")["input_ids"], "max_tokens": 4, "temperature": 0})
    assert as_ids.json()["choices"][0]["text"] == choice["text"]  # the same context, the same greedy reply


def test_a_top_p_the_wire_rounds_to_zero_and_a_malformed_tool_call_are_named(up):
    """`top_p: 1e-300` was reported as 0.0 (the float32 the generation server is sent); malformed
    `tool_calls` were blamed on the chat template. Each is now a 400 naming its own field."""
    e = error_of(up.post("/v1/chat/completions", {**CHAT, "top_p": 1e-300}), 400, param="top_p")
    assert "1e-300 rounds to 0" in e["message"]
    assert up.post("/v1/chat/completions", {**CHAT, "top_p": 1e-30}).status_code == 200
    bad_calls = [{"function": 5}], [{"function": {"name": "f", "arguments": {"a": 1}}}], "call f"
    for calls in bad_calls:
        said = {"role": "assistant", "content": None, "tool_calls": calls}
        messages = [{"role": "user", "content": "abc="}, said, {"role": "user", "content": "again"}]
        e = error_of(up.post("/v1/chat/completions", {**CHAT, "messages": messages}), 400)
        assert e["param"] == "messages[1].tool_calls" and "chat template" not in e["message"], e
