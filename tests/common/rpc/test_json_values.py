"""What parsing a request's JSON may cost (issue 54, item 4: an 8 MiB body of `{},` became
2.8 million dicts, ~230 MB, and ten at once 2.7 GB): `Guard` counts a body's JSON values (commas,
`[` and `{` outside strings) before the app parses it, so that a body over `max_json_values` is 413
in the one error shape at the cost of its bytes, while text full of commas and a body at the
bound pass. The app is driven over ASGI in-process so that tracemalloc sees every allocation."""

import asyncio
import json
import tracemalloc

from services.common.rpc.http_guard import MAX_JSON_VALUES, Guard, bearer, json_values

BODY = 8 << 20


def _serve(guard: Guard, body: bytes) -> tuple[int, dict]:
    sent: list[dict] = []
    scope = {
        "type": "http",
        "method": "POST",
        "path": "/echo",
        "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
    }

    async def receive() -> dict:
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(message: dict) -> None:
        sent.append(message)

    asyncio.run(guard(scope, receive, send))
    status = next(m["status"] for m in sent if m["type"] == "http.response.start")
    payload = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return status, json.loads(payload)


def _guard(parsed: list) -> Guard:
    async def app(scope, receive, send):
        message = await receive()
        parsed.append(len(json.loads(message["body"])))
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    return Guard(app, authorized=bearer(None), max_body_bytes=BODY + 1024)


def test_a_body_of_millions_of_tiny_values_is_413_before_it_is_parsed():
    parsed: list = []
    guard = _guard(parsed)
    body = b"[" + b"{}," * (BODY // 3 - 1) + b"{}]"
    tracemalloc.start()
    try:
        status, answer = _serve(guard, body)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert status == 413 and answer["error"]["code"] == "request_too_large"
    assert str(MAX_JSON_VALUES) in answer["error"]["message"]
    assert parsed == []  # the app never saw it
    assert peak < 3 * BODY, peak  # its bytes (a copy without strings at most), not 212 MB of dicts


def test_commas_inside_strings_and_a_body_at_the_bound_pass():
    parsed: list = []
    guard = _guard(parsed)
    text = json.dumps([{"role": "user", "content": "a," * (MAX_JSON_VALUES * 2)}]).encode()
    assert _serve(guard, text)[0] == 200
    escaped = json.dumps(['say \\"a,b\\"' * 50_000, "x"]).encode()  # escaped quotes do not end a string
    assert json_values(escaped, 10) == 2  # its 50,000 commas inside strings are not values
    at_bound = json.dumps(list(range(MAX_JSON_VALUES))).encode()  # one [ and one fewer commas
    assert _serve(guard, at_bound)[0] == 200
    over = json.dumps(list(range(MAX_JSON_VALUES + 1))).encode()
    assert _serve(guard, over)[0] == 413
    assert parsed == [1, MAX_JSON_VALUES]


def test_counting_many_small_strings_copies_nothing():
    """8 MiB of `"ab",`: the count walked it string by string in place (the probe of issue 54 saw
    +282 MB when its strings were cut out as a copy of the body)."""
    body = b"[" + b'"ab",' * (BODY // 5 - 1) + b'"ab"]'
    tracemalloc.start()
    try:
        assert json_values(body, MAX_JSON_VALUES) > MAX_JSON_VALUES
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, peak
