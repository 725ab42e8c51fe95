"""`rlhf serve gateway` as a public API (issue 42's probe, each case a test): the real service over
real HTTP, in front of a real generation server (the tiny model), with the run's token and small
limits. Auth is decided before a byte of the body is read; every error is OpenAI's shape
(`{"error": {"message", "type", "param", "code"}}`, `param` the field, `code` a string or null),
never a 500 for any input, and the connection stays usable after it; values the wire cannot carry
(NaN, Infinity, an int64 seed, int32 token ids) are 400s naming the field; a request, a session
id, a session and all sessions are bounded in bytes; /health says whether a generation server
answers; /metrics counts what happened."""

import json
import math
import time

import httpx
import pytest

from services.agents.session_store import Sessions
from services.agents.sessions import Session
from services.common.config import config_from_dict
from services.gateway.server import serve as serve_gateway
from services.generation.backend import HFBackend
from services.generation.server import serve
from tests.grpc_helpers import TOKEN, on_free_ports
from tests.http_helpers import error_of, head, raw

AUTH = {"Authorization": f"Bearer {TOKEN}"}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "abc="}], "max_tokens": 2, "temperature": 0}
MAX_REQUEST = 262_144


@pytest.fixture(scope="module")
def hcfg(tiny_model_dir):
    return config_from_dict(
        {
            "model": {"path": tiny_model_dir, "device": "cpu"},
            "prompt_length": 64,
            "response_length": 32,
            "rpc": {
                "auth_token": TOKEN,
                "max_samples_per_prompt": 4,
                "gateway": {
                    "port": 0,
                    "max_request_bytes": MAX_REQUEST,
                    "max_session_id_bytes": 128,
                    "max_session_bytes": 65_536,
                    "max_sessions_bytes": 1_048_576,
                },
            },
            "generation": {"batch_window_ms": 1},
        }
    )


class Up:
    """A generation server and `rlhf serve gateway` in front of it (the configured server)."""

    def __init__(self, cfg, model_dir):
        self.gen = serve(on_free_ports(cfg, "generation"), backend=HFBackend(model_dir, "cpu")).start()
        cfg = cfg.model_copy(deep=True)
        cfg.rpc.generation.port = self.gen.server.port
        self.gw = serve_gateway(cfg).start()
        self.port = self.gw.port
        self.base = f"http://127.0.0.1:{self.port}"

    def close(self):
        self.gw.stop()
        self.gen.stop()


@pytest.fixture(scope="module")
def up(hcfg, tiny_model_dir):
    u = Up(hcfg, tiny_model_dir)
    yield u
    u.close()


def post(up, path, body, headers=AUTH, client=None):
    data = body if isinstance(body, bytes) else json.dumps(body, allow_nan=True).encode()
    return (client or httpx).post(
        up.base + path, content=data, headers={"content-type": "application/json", **headers}, timeout=60
    )


BAD_VALUES = [  # (path, body, the param named)
    ("/v1/chat/completions", {**CHAT, "temperature": math.nan}, "temperature"),
    ("/v1/chat/completions", {**CHAT, "temperature": math.inf}, "temperature"),
    ("/v1/chat/completions", {**CHAT, "temperature": -math.inf}, "temperature"),
    ("/v1/chat/completions", {**CHAT, "top_p": math.nan}, "top_p"),
    ("/v1/chat/completions", {**CHAT, "seed": 2**63}, "seed"),
    ("/v1/chat/completions", {**CHAT, "seed": -(2**63) - 1}, "seed"),
    ("/v1/chat/completions", {**CHAT, "seed": True}, "seed"),  # strict JSON types: true is not 1
    ("/v1/chat/completions", {**CHAT, "n": 1.5}, "n"),
    ("/v1/chat/completions", {**CHAT, "stream": 1}, "stream"),
    ("/v1/chat/completions", {**CHAT, "n": 10**6}, "n"),
    ("/v1/chat/completions", {**CHAT, "max_tokens": 0}, "max_tokens"),
    ("/v1/chat/completions", {**CHAT, "messages": []}, "messages"),
    ("/v1/chat/completions", {**CHAT, "stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ("/v1/chat/completions", {"model": "tiny"}, "messages"),
    ("/v1/completions", {"prompt": [1, 2**31], "max_tokens": 2}, "prompt"),
    ("/v1/completions", {"prompt": [1, -1], "max_tokens": 2}, "prompt"),
    ("/v1/completions", {"prompt": [1, 10**6], "max_tokens": 2}, "prompt"),  # within int32, outside the vocabulary
    ("/v1/completions", {"prompt": [], "max_tokens": 2}, "prompt"),
    ("/v1/sessions/s-values/reward", {"reward": math.nan}, "reward"),
    ("/v1/sessions/s-values/reward", {"reward": -math.inf}, "reward"),
]


@pytest.mark.parametrize("path,body,param", BAD_VALUES, ids=[f"{p}:{json.dumps(b)[:60]}" for p, b, _ in BAD_VALUES])
def test_a_value_the_wire_cannot_carry_is_400_naming_its_field_and_401_without_the_token(up, path, body, param):
    if "s-values" in path:
        assert post(up, "/v1/chat/completions", {**CHAT, "session_id": "s-values"}).status_code == 200
    error_of(post(up, path, body), 400, param=param)
    anonymous = post(up, path, body, headers={})
    error_of(anonymous, 401, param=None, code="invalid_api_key")
    assert anonymous.headers["www-authenticate"] == "Bearer"


def test_the_connection_is_usable_after_every_kind_of_error(up, monkeypatch):
    """One keep-alive connection (the client may not open another): a 400 of a NaN, a 401, a 404,
    a 405, a body that is not JSON, and a 500 of an exception inside a route (the same shape;
    the next request is answered on the same connection)."""
    calls = {"n": 0}

    def broken(*a, **k):
        calls["n"] += 1
        raise RuntimeError("a bug")

    monkeypatch.setattr(up.gw.handler, "completion", broken)
    with httpx.Client(limits=httpx.Limits(max_connections=1, max_keepalive_connections=1), timeout=60) as c:
        for _ in range(3):
            error_of(post(up, "/v1/chat/completions", {**CHAT, "temperature": math.nan}, client=c), 400)
            error_of(post(up, "/v1/chat/completions", CHAT, headers={}, client=c), 401)
            error_of(c.get(up.base + "/nowhere", headers=AUTH), 404, param=None)
            error_of(c.get(up.base + "/v1/chat/completions", headers=AUTH), 405, param=None)
            error_of(post(up, "/v1/chat/completions", b"{not json", client=c), 400, param=None, code=None)
            e = error_of(post(up, "/v1/completions", {"prompt": "ab=", "max_tokens": 2}, client=c), 500)
            assert e["type"] == "server_error" and "a bug" not in e["message"]
            assert c.get(up.base + "/v1/models", headers=AUTH).status_code == 200
    assert calls["n"] == 3


def test_auth_and_the_size_limit_come_before_the_body(up):
    """A client that announces 10 GB and sends none of it is answered at once: 401 without the
    token, 413 with it; a chunked body is cut off at the limit (413). The answers are the shape."""
    status, _, body, seconds = raw(up.port, head("/v1/chat/completions", "Content-Length: 10000000000"))
    assert status == 401 and seconds < 5 and json.loads(body)["error"]["code"] == "invalid_api_key"
    status, headers, body, seconds = raw(
        up.port, head("/v1/chat/completions", f"Authorization: Bearer {TOKEN}", "Content-Length: 10000000000")
    )
    assert status == 413 and seconds < 5 and headers["connection"] == "close"
    assert json.loads(body)["error"]["code"] == "request_too_large"
    piece = b"x" * 65536
    chunked = head("/v1/chat/completions", f"Authorization: Bearer {TOKEN}", "Transfer-Encoding: chunked")
    chunked += b"".join(b"%x\r\n%s\r\n" % (len(piece), piece) for _ in range(MAX_REQUEST // len(piece) + 2))
    status, _, body, _ = raw(up.port, chunked + b"0\r\n\r\n")
    assert status == 413 and json.loads(body)["error"]["code"] == "request_too_large"
    # just under the limit is read and answered (here: the text cannot fit prompt_length)
    text = "y" * (MAX_REQUEST - 200)
    e = error_of(post(up, "/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": text}]}), 400)
    assert e["code"] == "context_length_exceeded" and e["param"] == "messages"
    # an anonymous invalid body is not parsed, validated or echoed
    r = post(up, "/v1/chat/completions", {"messages": "z" * 100_000}, headers={})
    error_of(r, 401)
    assert len(r.content) < 500


def test_the_schema_is_behind_the_token_and_the_doc_pages_are_off(up):
    for path in ("/openapi.json", "/docs", "/redoc", "/metrics", "/v1/models", "/v1/sessions/x"):
        error_of(httpx.get(up.base + path), 401, code="invalid_api_key")
    schema = httpx.get(up.base + "/openapi.json", headers=AUTH)
    assert schema.status_code == 200 and "/v1/chat/completions" in schema.json()["paths"]
    error_of(httpx.get(up.base + "/docs", headers=AUTH), 404)
    error_of(httpx.get(up.base + "/redoc", headers=AUTH), 404)
    assert httpx.get(up.base + "/health").status_code == 200  # probes need no token


def test_a_prompt_too_long_is_refused_on_its_text_then_on_its_tokens_before_any_generate(up):
    """Text that cannot fit (more characters than prompt_length + response_length tokens of
    the longest token) is refused before it is tokenised; text that might fit is tokenised
    and refused on its token count by the gateway itself (not the generation server)."""
    chars = up.gw.handler.limits.token_chars * (64 + 32) + 1
    t0 = time.perf_counter()
    e = error_of(
        post(up, "/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": "q" * chars}]}), 400
    )
    assert e["code"] == "context_length_exceeded" and "characters" in e["message"] and time.perf_counter() - t0 < 2
    e = error_of(post(up, "/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": "ab=" * 40}]}), 400)
    assert e["code"] == "context_length_exceeded" and "prompt_length=64" in e["message"]
    e = error_of(post(up, "/v1/completions", {"prompt": "ab=" * 40, "max_tokens": 2}), 400)
    assert e["param"] == "prompt" and "prompt_length=64" in e["message"]
    e = error_of(post(up, "/v1/completions", {"prompt": [5] * 65, "max_tokens": 2}), 400)
    assert e["param"] == "prompt" and e["code"] == "context_length_exceeded"


def test_session_ids_are_bounded_and_printable(up):
    long = "s" * 129
    error_of(post(up, "/v1/chat/completions", {**CHAT, "session_id": long}), 400, param="session_id")
    error_of(post(up, "/v1/chat/completions", CHAT, headers={**AUTH, "x-session-id": long}), 400, param="x-session-id")
    error_of(post(up, "/v1/chat/completions", {**CHAT, "session_id": "a\nb"}), 400, param="session_id")
    error_of(post(up, "/v1/chat/completions", {**CHAT, "session_id": "caf\u00e9"}), 400, param="session_id")
    error_of(httpx.get(f"{up.base}/v1/sessions/{long}", headers=AUTH), 400)
    ok = post(up, "/v1/chat/completions", {**CHAT, "session_id": "s" * 128})
    assert ok.status_code == 200 and ok.headers["x-session-id"] == "s" * 128
    assert len(up.gw.handler.sessions) >= 1


def test_a_session_keeps_only_what_it_compares_and_is_refused_past_its_bytes(up):
    """A message's fields other than role, content and tool calls are not kept (what sessions
    compare); a field of 100 KB is text the prompt cannot hold (400 before tokenising). A
    session that starts a new segment at every request grows until it holds more than
    max_session_bytes, then its turns are refused (400 session_too_large) and it can be ended."""
    junk = {**CHAT, "session_id": "s-junk", "messages": [{"role": "user", "content": "abc=", "x": "j" * 300}]}
    assert post(up, "/v1/chat/completions", junk).status_code == 200
    session = up.gw.handler.sessions.find("s-junk")
    assert session.bytes < 8_000 and session.segments[-1].messages == [{"role": "user", "content": "abc="}]
    junk["messages"][0]["x"] = "j" * 100_000
    error_of(post(up, "/v1/chat/completions", junk), 400, param="messages", code="context_length_exceeded")
    codes = []
    for i in range(200):
        messages = [{"role": "user", "content": f"{i}" + "ab=" * 8}]  # never the one before: a new segment
        r = post(up, "/v1/chat/completions", {**CHAT, "session_id": "s-grows", "messages": messages})
        codes.append(r.status_code)
        if r.status_code != 200:
            error_of(r, 400, param="session_id", code="session_too_large")
            break
    assert codes[-1] == 400 and codes.count(200) >= 5, codes
    grown = up.gw.handler.sessions.find("s-grows")
    assert 65_536 < grown.bytes < 65_536 + 16_384  # the limit plus one turn at most
    assert httpx.delete(f"{up.base}/v1/sessions/s-grows", headers=AUTH).status_code == 200
    assert post(up, "/v1/chat/completions", {**CHAT, "session_id": "s-grows"}).status_code == 200  # a new one


def test_sessions_are_evicted_by_bytes_and_by_count_the_longest_idle_first():
    sessions = Sessions(limit=3, max_bytes=10_000, max_session_bytes=5_000)
    a, b = sessions.get("a"), sessions.get("b")
    assert sessions.bytes == a.bytes + b.bytes and a.bytes == Session("a").bytes
    b.bytes = 4_000
    sessions.resized(b)
    sessions.get("a")  # a is now the more recently used: b is the longest idle
    c = sessions.get("c")
    c.bytes = 5_000  # the three hold about 1k + 4k + 5k: over 10k, so b goes (c is the one in use)
    sessions.resized(c)
    assert sessions.find("b") is None and sessions.evicted["bytes"] == 1 and sessions.bytes == a.bytes + c.bytes
    sessions.get("d")
    sessions.get("e")  # over the count of 3: a, the longest idle now, goes
    assert sessions.find("a") is None and sessions.evicted["count"] == 1
    assert sessions.over_limit(c) is False
    c.bytes = 5_001
    assert sessions.over_limit(c) is True
    assert sessions.end("c") is c and sessions.bytes == sum(sessions.find(s).counted for s in ("d", "e"))
    assert sessions.evicted == {"idle": 0, "count": 1, "bytes": 1}  # an ended session is not evicted


def scrape(up) -> str:
    r = httpx.get(up.base + "/metrics", headers=AUTH)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    return r.text


def sample(text: str, name: str, **labels) -> float:
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            if all(f'{k}="{v}"' in line for k, v in labels.items()):
                return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no {name} {labels}")


def test_metrics_count_requests_by_route_and_code_sessions_bytes_and_turns(up):
    before = scrape(up)
    assert post(up, "/v1/chat/completions", {**CHAT, "session_id": "s-metrics"}).status_code == 200
    post(up, "/v1/chat/completions", CHAT, headers={})
    httpx.get(f"{up.base}/v1/sessions/{'x' * 40}", headers=AUTH)
    after = scrape(up)

    def grew(name, **labels):
        try:
            old = sample(before, name, **labels)
        except AssertionError:
            old = 0.0
        return sample(after, name, **labels) - old

    assert grew("rlhf_http_requests_total", path="/v1/chat/completions", code="200") == 1
    assert grew("rlhf_http_requests_total", path="/v1/chat/completions", code="401") == 1
    assert grew("rlhf_http_requests_total", path="/v1/sessions/{id}", code="404") == 1
    assert grew("rlhf_gateway_turn_seconds_count") == 1
    assert sample(after, "rlhf_gateway_sessions", service="gateway") == len(up.gw.handler.sessions)
    assert sample(after, "rlhf_gateway_session_bytes") == up.gw.handler.sessions.bytes > 0
    assert sample(after, "rlhf_gateway_sessions_evicted_total", reason="bytes") >= 0
    assert sample(after, "process_resident_memory_bytes", service="gateway") > 1e6


def test_health_is_503_while_no_generation_server_answers(hcfg, tiny_model_dir):
    u = Up(hcfg, tiny_model_dir)
    try:
        ok = httpx.get(u.base + "/health")
        assert ok.status_code == 200 and ok.json()["status"] == "ok"
        u.gen.stop()
        time.sleep(1.1)  # what /health caches
        down = httpx.get(u.base + "/health")
        e = error_of(down, 503, code="no_generation_server")
        assert e["type"] == "service_unavailable"
        error_of(post(u, "/v1/chat/completions", CHAT), 503, code="no_generation_server")
    finally:
        u.close()
