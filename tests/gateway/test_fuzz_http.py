"""A fuzzer no one here wrote against the gateway: schemathesis generates requests from the
OpenAPI schema `rlhf serve gateway` serves (fetched with the token), valid and invalid ones, and
sends them over real HTTP to the real service in front of a real generation server (the tiny
model). Every answer must be no 5xx, of a status and content type the schema documents, its body
matching the schema (the error shape for every error); a request without the token must be
refused (`ignored_auth`) on every route the schema says needs it. Then each route of the schema
is asked without a token and with wrong ones: 401 everywhere but the probes (/health,
/health/live).

About 25 s on two CPU cores (some 1,400 requests); `FUZZ_EXAMPLES` (default 100) sets the
examples per operation and mode."""

import os

import httpx
import pytest

schemathesis = pytest.importorskip("schemathesis")

from services.common.config import config_from_dict  # noqa: E402
from tests.gateway.test_http_hardening import Up  # noqa: E402
from tests.grpc_helpers import TOKEN  # noqa: E402
from tests.http_helpers import fuzz_schema  # noqa: E402

AUTH = {"Authorization": f"Bearer {TOKEN}"}
EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "100"))


@pytest.fixture(scope="module")
def fuzzed(tiny_model_dir):
    cfg = config_from_dict(
        {
            "model": {"path": tiny_model_dir, "device": "cpu"},
            "prompt_length": 64,
            "response_length": 4,  # every turn samples a few tokens at most: the fuzzer's examples stay cheap
            "rpc": {
                "auth_token": TOKEN,
                "max_samples_per_prompt": 2,
                "gateway": {"port": 0, "max_request_bytes": 65_536, "max_sessions": 100},
            },
            "generation": {"batch_window_ms": 1},
        }
    )
    u = Up(cfg, tiny_model_dir)
    yield u
    u.close()


@pytest.fixture(scope="module")
def gateway_schema(fuzzed):
    r = httpx.get(fuzzed.base + "/openapi.json", headers=AUTH)
    assert r.status_code == 200
    return schemathesis.openapi.from_dict(r.json())


def test_no_input_gets_a_5xx_or_an_answer_outside_the_schema(gateway_schema, fuzzed):
    """Each operation, valid and invalid requests (schemathesis' positive and negative modes),
    every default check of schemathesis but positive_data_acceptance (fuzz_schema says why).
    The examples are the same at every run."""
    sent = fuzz_schema(gateway_schema, fuzzed.base, AUTH, EXAMPLES)
    print(f"schemathesis sent {sent} requests to the gateway")
    assert sent >= 8 * EXAMPLES


def test_every_route_of_the_schema_asks_for_the_token(fuzzed):
    spec = httpx.get(fuzzed.base + "/openapi.json", headers=AUTH).json()
    assert spec["components"]["securitySchemes"] == {"bearer": {"type": "http", "scheme": "bearer"}}
    routes = [(m.upper(), p.replace("{session_id}", "s-1")) for p, ops in spec["paths"].items() for m in ops]
    assert len(routes) >= 8, routes
    for method, path in routes:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN}):
            r = httpx.request(method, fuzzed.base + path, headers=headers, json={})
            if path in ("/health", "/health/live"):  # the probes
                assert r.status_code == 200
                continue
            assert r.status_code == 401, (method, path, headers, r.text)
            assert r.json()["error"]["code"] == "invalid_api_key"
