"""A fuzzer no one here wrote against the reward server's OpenRLHF-style HTTP API: schemathesis
generates requests from the schema the server serves (fetched with the token), valid and invalid
ones, sent over real HTTP to the real service (rule scoring): no 5xx, every answer of a status,
content type and body the schema documents (the one error shape for errors), a request without
the token refused (`ignored_auth`). About 5 s (some 500 requests); `FUZZ_EXAMPLES` (default
100) sets the examples per operation and mode."""

import os

import httpx
import pytest

schemathesis = pytest.importorskip("schemathesis")

from services.reward.scorer import RuleScorer  # noqa: E402
from services.reward.server import serve  # noqa: E402
from tests.grpc_helpers import TOKEN, on_free_ports  # noqa: E402
from tests.http_helpers import fuzz_schema  # noqa: E402

AUTH = {"Authorization": f"Bearer {TOKEN}"}
EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "100"))


def test_no_input_gets_a_5xx_or_an_answer_outside_the_schema(cfg):
    scorer = RuleScorer([("exact_match", 1.0, {}), ("edit_distance", 0.5, {})])
    with serve(on_free_ports(cfg, "reward", http=True), scorer) as svc:
        base = f"http://127.0.0.1:{svc.server.http_port}"
        spec = httpx.get(base + "/openapi.json", headers=AUTH).json()
        assert set(spec["paths"]) == {"/score", "/get_reward", "/health", "/status"}
        sent = fuzz_schema(schemathesis.openapi.from_dict(spec), base, AUTH, EXAMPLES)
        print(f"schemathesis sent {sent} requests to the reward server")
        for path, ops in spec["paths"].items():
            for method in ops:
                r = httpx.request(method.upper(), base + path, json={"query": ["x"]})
                assert r.status_code == (200 if path == "/health" else 401), (method, path, r.text)
