"""docs/metrics.md is exact: every service runs for real, in-process (reward with its HTTP API
and an external reward API, critic, the teacher, generation, the learner for two iterations, a
rollout worker, the gateway in front of the registry's generation servers, against a real Redis;
the Tinker API with the official SDK training a step), each
one's /metrics is scraped over HTTP with the bearer token, and the metric names, types and label
names each exports are those the table lists for it: no more (no empty families of other
services), no fewer. Every family has samples by then, so a scrape of a live run finds them all.
A reward server without its HTTP API and without a reward API exports exactly the table's
"always" metrics."""

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest

from services.common.config import config_from_dict
from services.critic.server import serve as serve_critic
from services.gateway.server import serve as serve_gateway
from services.generation.server import serve as serve_generation
from services.learner.server import serve as serve_learner
from services.reward.server import serve as serve_reward
from services.rollout.worker import serve as serve_rollout
from services.teacher.client import TeacherClient
from services.teacher.server import serve as serve_teacher
from services.tinker.server import serve as serve_tinker
from services.tinker.trainer_server import serve as serve_trainer
from services.weights.pull import LearnerClient
from tests.grpc_helpers import TOKEN
from tests.metrics_helpers import parse_exposition

DOC = Path(__file__).resolve().parents[1] / "docs" / "metrics.md"
START, END = "<!-- metrics-table:start -->", "<!-- metrics-table:end -->"
SERVICES = ("generation", "reward", "critic", "teacher", "learner", "rollout", "gateway", "tinker", "tinker-trainer")


def documented() -> dict[str, dict]:
    """metric -> {type, labels (a set), services (a set), from_start (bool: samples from the
    service's start)} from the doc's table."""
    text = DOC.read_text()
    table = text[text.index(START) + len(START) : text.index(END)]
    rows = [[c.strip() for c in line.strip().strip("|").split("|")] for line in table.strip().splitlines()[2:]]
    out = {}
    for name, typ, labels, services, samples, meaning in rows:
        name = name.strip("`")
        assert name not in out, f"{name} is listed twice"
        assert meaning, f"{name} has no meaning"
        out[name] = {
            "type": typ,
            "labels": {x.strip() for x in labels.replace("`", "").split(",") if x.strip()},
            "services": {s.strip() for s in services.split(",")},
            "from_start": samples == "from start",
        }
    return out


def scrape(port: int) -> dict[str, dict]:
    r = httpx.get(f"http://127.0.0.1:{port}/metrics", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10)
    assert r.status_code == 200, r.text
    return parse_exposition(r.text)


class RewardAPI:
    """The user's reward API (OpenRLHF protocol): a reward per query."""

    def __init__(self):
        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                data = json.dumps({"rewards": [0.5] * len(body["query"])}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/get_reward"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


def _cfg(model_dir, redis_url, run_dir, api_url):
    ep = {"port": 0, "metrics_port": 0}
    return config_from_dict(
        {
            "model": {"path": model_dir, "device": "cpu"},
            "adv_estimator": "gae",
            "rollout_batch_size": 4,
            "prompt_length": 16,
            "response_length": 4,
            "ppo_mini_batch_size": 4,
            "data": {"eval_size": 4},
            "reward": {
                "type": "combined",
                "rules": [{"name": "exact_match"}],
                "http_url": api_url,
                "http_retries": 0,
                "eval_rules": [{"name": "length", "kwargs": {"target": 3}}],
            },
            "replay": {"url": redis_url, "namespace": "metricsdoc", "block_ms": 50, "heartbeat_s": 0.2},
            "rollout": {"metrics_port": 0, "prompts_per_request": 4},
            "run": {
                "iterations": 2,
                "eval_interval": 1,
                "checkpoint_interval": 0,
                "run_dir": str(run_dir),
                "tensorboard": False,
            },
            "rpc": {
                "auth_token": TOKEN,
                "generation": ep,
                "critic": ep,
                "teacher": ep,
                "tinker_trainer": ep,
                "reward": {**ep, "http_port": 0},
                "learner": {**ep, "http_port": None},
                "gateway": {"port": 0},
            },
            "tinker": {"port": 0, "root": str(run_dir / "tinker"), "model_name": "tiny"},
        }
    )


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("run")


@pytest.fixture(scope="module")
def scrapes(tiny_model_dir, redis_server, run_dir):
    """service -> its scraped families, after a two-iteration run of the whole system."""
    api = RewardAPI()
    cfg = _cfg(tiny_model_dir, redis_server.url, run_dir, api.url)
    try:
        with serve_reward(cfg) as reward, serve_critic(cfg) as critic, serve_teacher(cfg) as teacher:
            cfg.rpc.reward.port, cfg.rpc.critic.port = reward.server.port, critic.server.port
            teacher_client = TeacherClient(f"127.0.0.1:{teacher.server.port}", cfg.rpc)
            assert teacher_client.score([[1, 4, 5]], [[6, 7]], top_k=2).log_probs[0]
            teacher_client.close()
            base = f"http://127.0.0.1:{reward.server.http_port}"
            assert (
                httpx.post(
                    f"{base}/score",
                    json={"query": ["ab=ba"], "prompts": ["ab="], "labels": ["ba"]},
                    headers={"Authorization": f"Bearer {TOKEN}"},
                    timeout=10,
                ).status_code
                == 200
            )
            assert httpx.post(f"{base}/score", json={"query": ["x"]}, timeout=10).status_code == 401
            with serve_generation(cfg) as generation, serve_learner(cfg) as learner, serve_rollout(cfg, "w0") as worker:
                done = {}
                loop = threading.Thread(target=lambda: done.setdefault("code", learner.run()))
                work = threading.Thread(target=worker.run)
                loop.start()
                work.start()
                loop.join(timeout=240)
                worker.drain()
                work.join(timeout=30)
                assert done == {"code": 0}, learner.loop.state
                LearnerClient(f"127.0.0.1:{learner.server.port}", cfg.rpc).status()
                with serve_gateway(cfg) as gateway:
                    url, auth = f"http://127.0.0.1:{gateway.port}", {"Authorization": f"Bearer {TOKEN}"}
                    turn = httpx.post(f"{url}/v1/completions", json={"prompt": "ab=", "max_tokens": 2}, headers=auth)
                    assert turn.status_code == 200, turn.text
                    assert httpx.get(f"{url}/v1/models", timeout=10).status_code == 401
                    gateway_families = scrape(gateway.port)
                yield {
                    **tinker_families(cfg),
                    "gateway": gateway_families,
                    "generation": scrape(generation.server.metrics_port),
                    "reward": scrape(reward.server.metrics_port),
                    "critic": scrape(critic.server.metrics_port),
                    "teacher": scrape(teacher.server.metrics_port),
                    "learner": scrape(learner.server.metrics_port),
                    "rollout": scrape(worker.metrics_port),
                }
    finally:
        api.close()


def tinker_families(cfg) -> dict:
    """The Tinker API's families and its trainer's (`tinker.trainer`) after the official SDK made a
    LoRA model there and ran one forward_backward on it, and one request was refused for its key."""
    import os

    import tinker
    from tinker import types

    os.environ["TINKER_TELEMETRY"] = "0"
    with serve_trainer(cfg) as trainer:
        api_cfg = cfg.model_copy(deep=True)
        api_cfg.tinker.trainer = f"127.0.0.1:{trainer.server.port}"
        with serve_tinker(api_cfg) as svc:
            url = f"http://127.0.0.1:{svc.port}"
            with tinker.ServiceClient(base_url=url, api_key=f"tml-{TOKEN}") as sc:
                tc = sc.create_lora_training_client(base_model="tiny", rank=2)
                datum = types.Datum(
                    model_input=types.ModelInput.from_ints([1, 4, 5]),
                    loss_fn_inputs={"target_tokens": [4, 5, 6], "weights": [0.0, 1.0, 1.0]},
                )
                tc.forward_backward([datum], "cross_entropy").result()
                assert httpx.get(f"{url}/api/v1/get_server_capabilities", timeout=10).status_code == 401
                return {"tinker": scrape(svc.port), "tinker-trainer": scrape(trainer.server.metrics_port)}


def test_the_table_is_well_formed():
    doc = documented()
    assert len(doc) > 40
    for name, row in doc.items():
        assert row["type"] in ("counter", "gauge", "histogram"), name
        assert row["services"] <= set(SERVICES), name
        assert "service" in row["labels"], f"{name}: every metric carries the service label"
        assert name.endswith("_total") == (row["type"] == "counter"), name


@pytest.mark.parametrize("service", SERVICES)
def test_each_service_exports_exactly_what_the_table_lists(scrapes, service):
    doc = {n: r for n, r in documented().items() if service in r["services"]}
    got = scrapes[service]
    assert sorted(set(got) - set(doc)) == [], "exported but not in docs/metrics.md"
    assert sorted(set(doc) - set(got)) == [], "in docs/metrics.md but not exported"
    for name, row in doc.items():
        assert got[name]["type"] == row["type"], name
        assert got[name]["samples"], f"{name}: an empty family"
        assert got[name]["labels"] == row["labels"], name
        assert {labels["service"] for _, labels, _ in got[name]["samples"]} == {service}, name


def value(families: dict, name: str, **labels) -> float:
    """The value of the sample of `name` whose labels include `labels`."""
    hits = [v for n, ls, v in families[name]["samples"] if n == name and labels.items() <= ls.items()]
    assert len(hits) == 1, (name, labels, families[name]["samples"])
    return hits[0]


def test_the_numbers_are_the_runs(scrapes):
    """The exported values come from what happened: two iterations, pushes, generated tokens, the
    reward API asked, the HTTP API answered, the prompt queue drained."""
    learner, reward = scrapes["learner"], scrapes["reward"]
    assert value(learner, "rlhf_learner_iteration") == 2
    assert value(learner, "rlhf_learner_phase_seconds", phase="train") > 0
    assert value(learner, "rlhf_learner_phase_seconds", phase="eval") > 0
    assert 0 <= value(learner, "rlhf_learner_clip_fraction") <= 1 and value(learner, "rlhf_learner_entropy") > 0
    assert value(learner, "rlhf_replay_prompts_waiting") == value(learner, "rlhf_replay_prompts_pending") == 0
    assert value(learner, "rlhf_learner_reward_hacking") == 0
    assert value(learner, "rlhf_rpc_requests_total", method="Status", code="OK") == 1
    assert value(learner, "process_resident_memory_bytes") > 1e6
    assert value(scrapes["generation"], "rlhf_generated_tokens_total") > 0
    assert value(scrapes["teacher"], "rlhf_rpc_requests_total", method="Score", code="OK") == 1
    assert value(scrapes["rollout"], "rlhf_rollout_groups_produced_total") >= 8
    assert value(reward, "rlhf_reward_api_requests_total", outcome="ok") >= 1
    assert value(reward, "rlhf_reward_api_requests_total", outcome="http_error") == 0
    assert value(reward, "rlhf_http_requests_total", path="/score", code="200") == 1
    assert value(reward, "rlhf_http_requests_total", path="/score", code="401") == 1
    gateway = scrapes["gateway"]
    assert value(gateway, "rlhf_http_requests_total", path="/v1/completions", code="200") == 1
    assert value(gateway, "rlhf_http_requests_total", path="/v1/models", code="401") == 1
    turns = gateway["rlhf_gateway_turn_seconds"]["samples"]
    assert [v for n, _, v in turns if n == "rlhf_gateway_turn_seconds_count"] == [1]
    assert value(gateway, "rlhf_gateway_sessions") == 1 and value(gateway, "rlhf_gateway_session_bytes") > 1000
    assert value(gateway, "rlhf_gateway_sessions_evicted_total", reason="bytes") == 0


def test_a_bare_reward_server_has_samples_in_the_from_start_rows_only(tiny_model_dir):
    """No HTTP API, no reward API, no call yet: every family of the reward server's rows is
    there, and those with samples are exactly the rows marked `from start`."""
    cfg = config_from_dict(
        {
            "model": {"path": tiny_model_dir, "device": "cpu"},
            "rpc": {"auth_token": TOKEN, "reward": {"port": 0, "metrics_port": 0, "http_port": None}},
        }
    )
    with serve_reward(cfg) as reward:
        got = scrape(reward.server.metrics_port)
    rows = {n: r for n, r in documented().items() if "reward" in r["services"]}
    assert set(got) == set(rows)
    assert {n for n, f in got.items() if f["samples"]} == {n for n, r in rows.items() if r["from_start"]}


def test_the_learner_evaluates_with_the_eval_rules_through_the_reward_server(scrapes, run_dir):
    """reward.eval_rules reach the held-out evaluation of a distributed run: the learner marks its
    Score calls held-out and the reward server scores them with those rules, not the training ones."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if "eval/reward_mean" in r]
    assert [r["iteration"] for r in evals] == [0, 1, 2]
    for r in evals:
        assert r["eval/reward_mean"] == pytest.approx(r["eval/length"])
        assert "eval/proxy_reward_mean" in r  # the same responses, scored by the training reward too
        assert not any(k.startswith("eval/rules") or k.startswith("eval/http") for k in r)
        assert r["eval/hacking_suspected"] == 0


def test_the_tinker_apis_numbers_are_the_sdks_requests(scrapes):
    tinker = scrapes["tinker"]
    assert value(tinker, "rlhf_tinker_training_models") == 1 and value(tinker, "rlhf_tinker_requests_pending") == 0
    counts = {
        labels["kind"]: v for n, labels, v in tinker["rlhf_tinker_work_seconds"]["samples"] if n.endswith("_count")
    }
    assert counts == {"create_model": 1, "forward_backward": 1}
    assert value(tinker, "rlhf_http_requests_total", path="/api/v1/forward_backward", code="200") == 1
    assert value(tinker, "rlhf_http_requests_total", path="/api/v1/get_server_capabilities", code="401") == 1
    trainer = scrapes["tinker-trainer"]  # the model lives in the API's trainer: one Create, one ForwardBackward
    assert value(trainer, "rlhf_rpc_requests_total", method="Create", code="OK") == 1
    assert value(trainer, "rlhf_rpc_requests_total", method="ForwardBackward", code="OK") == 1
