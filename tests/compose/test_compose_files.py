"""The compose files as Compose itself reads them (`docker-compose config`): the GPU box's file
and the CPU variant validate, with the values .env.example documents; GPUs are reserved for
generation, learner and critic; every long-running service has a healthcheck and the learner
waits for its dependencies to be healthy; the secrets must be set."""
import json
import os
import subprocess
import tempfile
from pathlib import Path

import pytest
import yaml

from tests.compose.support import CPU_FILES, GPU_FILES, ROOT, compose_binary

pytestmark = pytest.mark.docker

ENV = {"RLHF_AUTH_TOKEN": "t0ken", "RLHF_REDIS_PASSWORD": "pw", "RLHF_GENERATION_GPUS": "0",
       "RLHF_LEARNER_GPUS": "1", "RLHF_CRITIC_GPUS": "2"}
LONG_RUNNING = {"redis", "reward", "critic", "generation", "learner", "rollout"}
MONITORING = {"prometheus", "grafana"}


def _compose(args: list[str], env: dict, env_file: Path | None = None) -> subprocess.CompletedProcess:
    """docker-compose with only the environment given (no RLHF_*/COMPOSE_* of the shell, no .env of
    the developer's: an env file of the test's own)."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("RLHF_", "COMPOSE_"))}
    with tempfile.TemporaryDirectory() as tmp:
        env_file = env_file or Path(tmp) / "empty.env"
        env_file.touch()
        return subprocess.run([*compose_binary(), "--project-directory", str(ROOT), "--env-file", str(env_file),
                               *args], cwd=ROOT, env={**clean, **env}, capture_output=True, text=True, timeout=60)


def _config(files, env: dict, *extra: str) -> subprocess.CompletedProcess:
    return _compose([*(a for f in files for a in ("-f", str(ROOT / f))), "config", *extra], env)


@pytest.fixture(scope="module")
def gpu():
    proc = _config(GPU_FILES, ENV)
    assert proc.returncode == 0, proc.stderr
    return yaml.safe_load(proc.stdout)


@pytest.fixture(scope="module")
def cpu():
    proc = _config(CPU_FILES, ENV)
    assert proc.returncode == 0, proc.stderr
    return yaml.safe_load(proc.stdout)


@pytest.mark.parametrize("files", [GPU_FILES, CPU_FILES], ids=["gpu", "cpu"])
def test_config_quiet_passes(files):
    proc = _config(files, ENV, "-q")
    assert proc.returncode == 0 and proc.stdout == "", proc.stderr


@pytest.mark.parametrize("compose_file", ["docker-compose.yml:docker-compose.gpu.yml",
                                          "docker-compose.yml:docker-compose.cpu.yml"])
def test_env_example_is_a_working_env_file(compose_file, tmp_path):
    """.env.example as a user copies it, with either COMPOSE_FILE it documents."""
    lines = [x for x in (ROOT / ".env.example").read_text().splitlines() if not x.startswith("COMPOSE_FILE=")]
    env_file = tmp_path / ".env"
    env_file.write_text("\n".join(lines + [f"COMPOSE_FILE={compose_file}"]) + "\n")
    proc = _compose(["config", "-q"], {}, env_file)
    assert proc.returncode == 0, proc.stderr


def test_the_secrets_must_be_set():
    proc = _config(GPU_FILES, {"RLHF_REDIS_PASSWORD": "pw"}, "-q")
    assert proc.returncode != 0 and "set RLHF_AUTH_TOKEN in .env" in proc.stderr


def test_gpu_file_reserves_gpus_for_the_services_that_compute(gpu):
    want = {"generation": "0", "learner": "1", "critic": "2"}
    for service, ids in want.items():
        devices = gpu["services"][service]["deploy"]["resources"]["reservations"]["devices"]
        assert devices == [{"driver": "nvidia", "capabilities": ["gpu"], "device_ids": [ids]}], devices
    for service in set(gpu["services"]) - set(want):
        assert "deploy" not in gpu["services"][service], service
    # and the GPU preset with vLLM
    assert gpu["services"]["generation"]["environment"]["RLHF_CONFIG"] == "/app/configs/gpu.yaml"


def test_cpu_variant_reserves_no_gpu_and_runs_the_tiny_default(cpu):
    for name, service in cpu["services"].items():
        if name in MONITORING:
            continue
        assert "deploy" not in service, name
        assert service["image"] == "rlhf:cpu"
        assert service["environment"]["RLHF_CONFIG"] == "/app/configs/tiny-cpu.yaml"


@pytest.mark.parametrize("variant", ["gpu", "cpu"])
def test_every_long_running_service_has_a_healthcheck_and_a_restart_policy(variant, gpu, cpu):
    services = {"gpu": gpu, "cpu": cpu}[variant]["services"]
    assert set(services) == LONG_RUNNING | {"init"} | MONITORING
    for name in LONG_RUNNING:
        check = services[name].get("healthcheck", {}).get("test")
        assert check and check[0] == "CMD", (name, check)
        assert services[name]["restart"] == "on-failure"
    assert services["init"]["restart"] == "no"


def test_the_learner_waits_for_healthy_dependencies(gpu):
    deps = gpu["services"]["learner"]["depends_on"]
    assert {k: v["condition"] for k, v in deps.items()} == {
        "redis": "service_healthy", "reward": "service_healthy", "critic": "service_healthy",
        "generation": "service_healthy"}
    for name in ("reward", "critic", "generation"):
        assert gpu["services"][name]["depends_on"]["init"]["condition"] == "service_completed_successfully"


def test_monitoring_is_a_profile_wired_to_deploy(gpu):
    """Prometheus and Grafana start only with --profile monitoring, and read the shipped files."""
    for name in MONITORING:
        assert gpu["services"][name]["profiles"] == ["monitoring"]
    for name in LONG_RUNNING | {"init"}:
        assert "profiles" not in gpu["services"][name]
    prom = gpu["services"]["prometheus"]
    assert any(v.endswith("deploy/prometheus:/etc/rlhf-prometheus:ro") for v in prom["volumes"])
    assert "--config.file=/prometheus/config/prometheus.yml" in prom["command"][0]
    graf = gpu["services"]["grafana"]["volumes"]
    assert any(v.endswith("deploy/grafana/dashboards:/var/lib/grafana/dashboards:ro") for v in graf)


def test_state_lives_on_named_volumes(gpu):
    assert set(gpu["volumes"]) == {"runs", "redis", "prometheus", "weights-shm"}
    for name in ("learner", "critic", "generation", "init"):
        assert "runs:/runs:rw" in gpu["services"][name]["volumes"], name
    assert gpu["services"]["redis"]["volumes"] == ["redis:/data:rw"]


@pytest.mark.parametrize("variant", ["gpu", "cpu"])
def test_learner_and_generation_share_a_tmpfs_for_weights(variant, gpu, cpu):
    """Both mount the same tmpfs volume at the rpc.shm_dir every service is given, writable by the
    image's user (uid 10001); nothing else mounts it."""
    config = {"gpu": gpu, "cpu": cpu}[variant]
    opts = config["volumes"]["weights-shm"]["driver_opts"]
    assert opts["type"] == "tmpfs" and opts["device"] == "tmpfs"
    assert set(opts["o"].split(",")) >= {"uid=10001", "gid=10001", "mode=0700"} and "size=8g" in opts["o"]
    for name, service in config["services"].items():
        mounted = [v for v in service.get("volumes", []) if str(v).startswith("weights-shm:")]
        assert mounted == (["weights-shm:/shm:rw"] if name in ("learner", "generation") else []), name
        if name in ("learner", "generation"):
            assert "rpc.shm_dir=/shm" in service["environment"]["RLHF_SET"].split(), name


def test_the_image_runs_rlhf_as_a_non_root_user():
    from tests.compose.support import IMAGE, docker, require_docker
    require_docker()
    config = json.loads(docker("image", "inspect", IMAGE).stdout)[0]["Config"]
    assert config["User"] == "rlhf" and config["Entrypoint"] == ["rlhf"]
    assert docker("run", "--rm", "--entrypoint", "id", IMAGE, "-u").stdout.strip() == "10001"
    # the healthcheck helper the compose file calls answers "not serving" with exit 1, not a traceback
    probe = docker("run", "--rm", "--entrypoint", "python3", IMAGE, "-m", "services.common.rpc.health",
                   "127.0.0.1:50051", check=False)
    assert probe.returncode == 1 and "Traceback" not in probe.stderr, probe.stderr
