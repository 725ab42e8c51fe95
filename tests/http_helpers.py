"""What the tests of the HTTP surfaces share: the one error shape asserted, requests written as
bytes (a body announced and never sent, a chunked one) on a fresh connection, and schemathesis
run over an OpenAPI schema."""

import socket
import time


def error_of(r, status, param="-", code="-") -> dict:
    """The answer's error, asserted to be `status` in OpenAI's shape (and `param`, `code` when given)."""
    assert r.status_code == status, r.text[:500]
    assert r.headers["content-type"].startswith("application/json")
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    e = body["error"]
    assert isinstance(e["message"], str) and e["message"] and isinstance(e["type"], str)
    assert e["code"] is None or isinstance(e["code"], str)
    assert e["param"] is None or isinstance(e["param"], str)
    if param != "-":
        assert e["param"] == param, e
    if code != "-":
        assert e["code"] == code, e
    return e


def raw(port: int, request: bytes, timeout: float = 10.0) -> tuple[int, dict, bytes, float]:
    """A request written as bytes on a fresh connection: the status, headers and body of its
    answer, and the seconds it took; the server is not waited for beyond what it sends."""
    t0 = time.perf_counter()
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        try:
            s.sendall(request)
        except OSError:
            pass
        data = b""
        while True:
            try:
                chunk = s.recv(65536)
            except OSError:
                break
            if not chunk:
                break
            data += chunk
            head, sep, body = data.partition(b"\r\n\r\n")
            if sep:
                headers = dict(
                    line.decode().lower().split(": ", 1) for line in head.split(b"\r\n")[1:] if b": " in line
                )
                if len(body) >= int(headers.get("content-length", 0)):
                    return int(head.split()[1]), headers, body, time.perf_counter() - t0
    raise AssertionError(f"no whole answer: {data[:300]!r}")


def head(path: str, *lines: str) -> bytes:
    return (
        "\r\n".join([f"POST {path} HTTP/1.1", "Host: x", "Content-Type: application/json", *lines]) + "\r\n\r\n"
    ).encode()


def fuzz_schema(schema, base_url: str, headers: dict, examples: int) -> int:
    """schemathesis against every operation of `schema` (loaded with schemathesis.openapi), valid
    and invalid requests (its positive and negative modes), `examples` of each, derandomized (the
    same at every run), sent to `base_url` with `headers`; every default check of schemathesis
    (not_a_server_error, status_code_conformance, content_type_conformance,
    response_schema_conformance, response_headers_conformance, negative_data_rejection,
    ignored_auth, ...) but positive_data_acceptance: a schema gives the types, not the limits of
    a deployment (prompt_length, n, a session's bytes, a batch's texts), so a request it allows
    may be refused with a 4xx saying which. AssertionError with every operation's failure; else
    how many requests were sent."""
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis.errors import Unsatisfiable
    from schemathesis.generation import GenerationMode
    from schemathesis.specs.openapi.checks import positive_data_acceptance

    sent, failures = [0], []
    for result in schema.get_all_operations():
        operation = result.ok()
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):

            @given(case=operation.as_strategy(mode))
            @settings(
                max_examples=examples,
                deadline=None,
                database=None,
                derandomize=True,
                phases=[Phase.explicit, Phase.generate],
                suppress_health_check=list(HealthCheck),
            )
            def fuzz(case):
                sent[0] += 1
                case.call_and_validate(
                    base_url=base_url, headers=headers, timeout=60, excluded_checks=[positive_data_acceptance]
                )

            try:
                fuzz()
            except Unsatisfiable:  # no invalid request exists (an operation without parameters)
                continue
            except (Exception, BaseExceptionGroup) as e:  # noqa: F821  (one operation's failure; the others go on)
                failures.append(f"{operation.label} ({mode.value}): {type(e).__name__}: {str(e)[:2000]}")
    assert not failures, "\n\n".join(failures)
    return sent[0]


def openapi_schemas(model_dir: str) -> dict[str, str]:
    """The OpenAPI schema each HTTP service serves, as the text it sends (`rlhf serve gateway` and
    `rlhf serve reward`'s HTTP API, started as those commands start them on free ports, with a
    token): what a refactor must leave byte-identical (benchmarks/fingerprint.py)."""
    import httpx

    from services.common.config import config_from_dict
    from services.gateway.server import serve as serve_gateway
    from services.reward.scorer import RuleScorer
    from services.reward.server import serve as serve_reward
    from tests.grpc_helpers import TOKEN, on_free_ports

    auth = {"Authorization": f"Bearer {TOKEN}"}
    cfg = config_from_dict(
        {"model": {"path": model_dir, "device": "cpu"}, "rpc": {"auth_token": TOKEN, "gateway": {"port": 0}}}
    )
    out = {}
    gateway = serve_gateway(cfg).start()
    try:
        out["gateway"] = httpx.get(f"http://127.0.0.1:{gateway.port}/openapi.json", headers=auth).text
    finally:
        gateway.stop()
    scorer = RuleScorer([("exact_match", 1.0, {})])
    with serve_reward(on_free_ports(cfg, "reward", http=True), scorer) as svc:
        out["reward"] = httpx.get(f"http://127.0.0.1:{svc.server.http_port}/openapi.json", headers=auth).text
    return out
