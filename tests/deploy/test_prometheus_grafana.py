"""The monitoring that ships in deploy/: Prometheus's scrape config and alert rules pass promtool
(and the rules' own unit tests), the Grafana dashboard is what deploy/grafana/dashboard.py writes
and every query in it parses, and every metric a panel or an alert names is exported by the
services of a live tiny run (`rlhf up`, and `rlhf serve gateway` in front of its generation
server, scraped with the run's token)."""

import json
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml

from tests.e2e.support import run_iterations

ROOT = Path(__file__).resolve().parents[2]
PROM = ROOT / "deploy" / "prometheus"
GRAFANA = ROOT / "deploy" / "grafana"
METRIC = re.compile(r"\b((?:rlhf|process)_[a-z0-9_]+)\b")


def promtool(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    if shutil.which("promtool") is None:
        pytest.fail("promtool is missing: `make test` installs it (Debian's prometheus package)")
    return subprocess.run(["promtool", *args], cwd=cwd, capture_output=True, text=True, timeout=60)


def _dashboard_exprs() -> list[str]:
    board = json.loads((GRAFANA / "dashboards" / "rlhf.json").read_text())
    return [t["expr"] for p in board["panels"] for t in p.get("targets", [])]


def _alert_exprs() -> list[str]:
    rules = yaml.safe_load((PROM / "alerts.yml").read_text())
    return [r["expr"] for g in rules["groups"] for r in g["rules"]]


def test_scrape_config_passes_promtool_as_the_container_lays_it_out(tmp_path):
    """The compose service copies deploy/prometheus beside a `token` file and runs from there."""
    for f in PROM.glob("*.yml"):
        shutil.copy(f, tmp_path / f.name)
    (tmp_path / "token").write_text("t0ken")
    proc = promtool("check", "config", "prometheus.yml", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    jobs = {j["job_name"] for j in yaml.safe_load((PROM / "prometheus.yml").read_text())["scrape_configs"]}
    assert jobs == {
        "learner",
        "generation",
        "reward",
        "critic",
        "rollout",
        "gateway",
        "teacher",
        "tinker",
        "tinker-generation",
        "tinker-trainer",
    }


def test_alert_rules_pass_promtool_and_their_unit_tests():
    proc = promtool("check", "rules", "alerts.yml", cwd=PROM)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    proc = promtool("test", "rules", "alerts_test.yml", cwd=PROM)
    assert proc.returncode == 0 and "SUCCESS" in proc.stdout, proc.stdout + proc.stderr
    names = {r["alert"] for g in yaml.safe_load((PROM / "alerts.yml").read_text())["groups"] for r in g["rules"]}
    tested = set(re.findall(r"alertname: (\w+)", (PROM / "alerts_test.yml").read_text()))
    assert names == tested, f"alerts without a unit test: {names - tested}"


def test_dashboard_is_generated_and_every_query_parses(tmp_path):
    sys.path.insert(0, str(GRAFANA))
    try:
        import dashboard
    finally:
        sys.path.remove(str(GRAFANA))
    assert (GRAFANA / "dashboards" / "rlhf.json").read_text() == dashboard.render(), (
        "run `python deploy/grafana/dashboard.py`"
    )
    exprs = _dashboard_exprs()
    assert len(exprs) >= 20
    # each query as a recording rule: promtool parses it as Prometheus would
    rules = {
        "groups": [
            {"name": "dashboard", "rules": [{"record": f"dashboard:q{i}", "expr": e} for i, e in enumerate(exprs)]}
        ]
    }
    (tmp_path / "q.yml").write_text(yaml.safe_dump(rules))
    proc = promtool("check", "rules", "q.yml", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def _exported(text: str) -> set[str]:
    """Metric names a /metrics page exports, with the sample suffixes of each family's type."""
    suffixes = {
        "counter": ("_total", "_created"),
        "histogram": ("_bucket", "_sum", "_count", "_created"),
        "summary": ("_sum", "_count", "_created"),
        "gauge": (),
        "info": ("_info",),
        "untyped": (),
    }
    names = set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(maxsplit=3)
            names.add(name)
            names.update(name + s for s in suffixes.get(kind, ()))
        elif line and not line.startswith("#"):
            names.add(re.split(r"[{ ]", line, maxsplit=1)[0])
    return names


def _gateway_metrics(model_dir: str, redis_url: str, secrets: dict, log: Path) -> set[str]:
    """`rlhf serve gateway` in front of the run's generation server (found in its Redis): one
    turn through it, then its /metrics (on its HTTP port)."""
    import os

    cmd = [sys.executable, "-m", "services.cli", "serve", "gateway", "-c", "configs/tiny-cpu.yaml", "--port", "0"]
    cmd += ["--set", f"model.path={model_dir}", "--set", f"replay.url={redis_url}"]
    with log.open("w") as f:
        gw = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=f, text=True, env={**os.environ, **secrets})
    try:
        line = gw.stdout.readline()
        assert line.startswith("LISTENING"), log.read_text()[-3000:]
        port = dict(kv.split("=", 1) for kv in line.split()[1:])["http_port"]
        auth = {"Authorization": f"Bearer {secrets['RLHF_AUTH_TOKEN']}"}
        turn = httpx.post(
            f"http://127.0.0.1:{port}/v1/completions", json={"prompt": "ab=", "max_tokens": 2}, headers=auth, timeout=60
        )
        assert turn.status_code == 200, turn.text
        r = httpx.get(f"http://127.0.0.1:{port}/metrics", headers=auth, timeout=10)
        assert r.status_code == 200, r.text
        return _exported(r.text)
    finally:
        gw.terminate()
        gw.wait(timeout=30)


@pytest.fixture(scope="module")
def live_metrics(tiny_model_dir, tmp_path_factory):
    """service -> names exported, scraped from every process of a tiny `rlhf up` run mid-run."""
    run_dir = tmp_path_factory.mktemp("monitoring") / "run"
    log = run_dir.parent / "up.log"
    cmd = [
        sys.executable,
        "-m",
        "services.cli",
        "up",
        "-c",
        "configs/tiny-cpu.yaml",
        "--run-dir",
        str(run_dir),
        "--workers",
        "1",
        "--set",
        f"model.path={tiny_model_dir}",
        "--set",
        "run.iterations=400",
        "--set",
        "run.eval_interval=2",
        "--set",
        "rollout_batch_size=16",
        "--set",
        "ppo_mini_batch_size=16",
    ]
    with log.open("w") as f:
        up = subprocess.Popen(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT)
    try:
        deadline = time.time() + 300
        while run_iterations(run_dir) < 3:
            assert up.poll() is None and time.time() < deadline, log.read_text()[-3000:]
            time.sleep(0.5)
        secrets = dict(x.split("=", 1) for x in (run_dir / "secrets.env").read_text().splitlines())
        token = secrets["RLHF_AUTH_TOKEN"]
        manifest = json.loads((run_dir / "services.json").read_text())
        out: dict[str, set[str]] = {}
        for name, s in manifest["services"].items():
            port = s["metrics_port"]
            r = httpx.get(f"http://127.0.0.1:{port}/metrics", headers={"Authorization": f"Bearer {token}"}, timeout=10)
            assert r.status_code == 200, (name, r.status_code)
            out[name] = _exported(r.text)
        out["gateway"] = _gateway_metrics(tiny_model_dir, manifest["redis"], secrets, run_dir.parent / "gateway.log")
        return out
    finally:
        up.send_signal(signal.SIGINT)
        try:
            up.wait(timeout=120)
        except subprocess.TimeoutExpired:
            up.kill()


@pytest.mark.parametrize("source", ["dashboard", "alerts"])
def test_every_metric_queried_is_exported_by_a_running_service(live_metrics, source):
    exprs = _dashboard_exprs() if source == "dashboard" else _alert_exprs()
    wanted = {m for e in exprs for m in METRIC.findall(e)}
    exported = set().union(*live_metrics.values())
    missing = sorted(wanted - exported)
    assert not missing, f"{source} queries metrics no service exports: {missing}"


def test_every_service_exports_its_process_metrics(live_metrics):
    for name, names in live_metrics.items():
        assert {"process_cpu_seconds_total", "process_resident_memory_bytes"} <= names, name
