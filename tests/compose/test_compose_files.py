"""The compose files as Compose itself reads them (`docker-compose config`): the GPU box's file
and the CPU variant validate, with the values .env.example documents; GPUs come from .env for
generation, learner, critic, reward and teacher (one GPU by default, several as .env.example shows); the
user's workspace and the repo's configs are mounted; HF_TOKEN reaches every service that loads a
model; every long-running service has a healthcheck (with a start period where it loads a model)
and the learner waits for its dependencies to be healthy; the secrets must be set, and the image
refuses placeholders; the GPU image's runtime can build a C extension (Triton's launcher)."""

import json
import os
import subprocess
import tempfile
from pathlib import Path

import pytest
import yaml

from tests.compose.support import CPU_FILES, GPU_FILES, ROOT, compose_binary

pytestmark = pytest.mark.docker

ENV = {
    "RLHF_AUTH_TOKEN": "compose-files-test-token",
    "RLHF_REDIS_PASSWORD": "compose-files-test-password",
    "HF_TOKEN": "hf_compose_test_token",
}
SEVERAL_GPUS = {
    "RLHF_GENERATION_GPUS": "0,1",
    "RLHF_LEARNER_GPUS": "2",
    "RLHF_CRITIC_GPUS": "3",
    "RLHF_REWARD_GPUS": "3",
    "RLHF_TEACHER_GPUS": "1",
    "RLHF_TINKER_GPUS": "2",
    "RLHF_TINKER_GENERATION_GPUS": "3",
    "RLHF_CONFIG": "gpu.yaml",
}
LONG_RUNNING = {"redis", "reward", "critic", "generation", "learner", "rollout"}
LOADS_A_MODEL = {
    "reward",
    "critic",
    "generation",
    "learner",
    "teacher",
    "tinker",
    "tinker-generation",
    "tinker-trainer",
}
DISTILL = {"teacher"}  # --profile distill
TINKER = {"tinker", "tinker-generation", "tinker-trainer"}  # --profile tinker
RLHF_SERVICES = LONG_RUNNING | {"init"} | DISTILL | TINKER
GPU_SERVICES = {"generation", "learner", "critic", "reward", "teacher", "tinker-trainer", "tinker-generation"}
MONITORING = {"prometheus", "grafana"}
AGENTS = {"gateway"}  # --profile agents


def _compose(args: list[str], env: dict, env_file: Path | None = None) -> subprocess.CompletedProcess:
    """docker-compose with only the environment given (no RLHF_*/COMPOSE_* of the shell, no .env of
    the developer's: an env file of the test's own)."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("RLHF_", "COMPOSE_"))}
    with tempfile.TemporaryDirectory() as tmp:
        env_file = env_file or Path(tmp) / "empty.env"
        env_file.touch()
        return subprocess.run(
            [*compose_binary(), "--project-directory", str(ROOT), "--env-file", str(env_file), *args],
            cwd=ROOT,
            env={**clean, **env},
            capture_output=True,
            text=True,
            timeout=60,
        )


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


@pytest.mark.parametrize(
    "compose_file", ["docker-compose.yml:docker-compose.gpu.yml", "docker-compose.yml:docker-compose.cpu.yml"]
)
def test_env_example_needs_only_the_secrets(compose_file, tmp_path):
    """.env.example as a user copies it, with either COMPOSE_FILE it documents: refused until the
    two secrets are set, with a message that names them; valid once they are."""
    lines = [x for x in (ROOT / ".env.example").read_text().splitlines() if not x.startswith("COMPOSE_FILE=")]
    env_file = tmp_path / ".env"
    env_file.write_text("\n".join(lines + [f"COMPOSE_FILE={compose_file}"]) + "\n")
    proc = _compose(["config", "-q"], {}, env_file)
    assert proc.returncode != 0 and "set RLHF_AUTH_TOKEN in .env" in proc.stderr, proc.stderr
    filled = [f"{x}{ENV[x[:-1]]}" if x[:-1] in ("RLHF_AUTH_TOKEN", "RLHF_REDIS_PASSWORD") else x for x in lines]
    env_file.write_text("\n".join(filled + [f"COMPOSE_FILE={compose_file}"]) + "\n")
    proc = _compose(["config", "-q"], {}, env_file)
    assert proc.returncode == 0, proc.stderr


def test_the_secrets_must_be_set():
    proc = _config(GPU_FILES, {"RLHF_REDIS_PASSWORD": "compose-files-test-password"}, "-q")
    assert proc.returncode != 0 and "set RLHF_AUTH_TOKEN in .env" in proc.stderr


def _gpus(config: dict, service: str) -> list[str]:
    devices = config["services"][service]["deploy"]["resources"]["reservations"]["devices"]
    assert len(devices) == 1 and devices[0]["driver"] == "nvidia" and devices[0]["capabilities"] == ["gpu"], devices
    return devices[0]["device_ids"]


def test_by_default_every_gpu_service_shares_gpu_0_with_the_one_gpu_config(gpu):
    for service in GPU_SERVICES:
        assert _gpus(gpu, service) == ["0"], service
    for service in set(gpu["services"]) - GPU_SERVICES:
        assert "deploy" not in gpu["services"][service], service
    for service in RLHF_SERVICES:
        assert gpu["services"][service]["environment"]["RLHF_CONFIG"] == "gpu-1x80gb.yaml"
    assert (ROOT / "configs/gpu-1x80gb.yaml").is_file()


def test_several_gpus_come_from_the_env_file():
    proc = _config(GPU_FILES, {**ENV, **SEVERAL_GPUS})
    assert proc.returncode == 0, proc.stderr
    config = yaml.safe_load(proc.stdout)
    # the generation service gets the whole list: Docker puts it in NVIDIA_VISIBLE_DEVICES and each
    # replica of `--scale generation=2` takes one of them (tests/generation/test_gpu_slot.py)
    assert _gpus(config, "generation") == ["0,1"]
    assert (_gpus(config, "learner"), _gpus(config, "critic"), _gpus(config, "reward")) == (["2"], ["3"], ["3"])
    assert _gpus(config, "teacher") == ["1"] and _gpus(config, "tinker-trainer") == ["2"]
    assert _gpus(config, "tinker-generation") == ["3"]
    assert config["services"]["generation"]["environment"]["RLHF_GPU_SLOTS_DIR"].startswith("/runs/")
    assert config["services"]["learner"]["environment"]["RLHF_CONFIG"] == "gpu.yaml"


def test_hf_token_and_hf_home_reach_every_service_that_loads_a_model(gpu, cpu):
    for config in (gpu, cpu):
        for service in LOADS_A_MODEL | {"init"}:
            env = config["services"][service]["environment"]
            assert env["HF_TOKEN"] == ENV["HF_TOKEN"], service
            assert env["HF_HOME"].startswith("/runs/"), service


def test_the_workspace_and_the_configs_are_mounted_read_only(gpu, cpu, tmp_path):
    for config in (gpu, cpu):
        for service in RLHF_SERVICES - {"redis"}:  # Redis keeps its own volume only
            s = config["services"][service]
            assert f"{ROOT / 'workspace'}:/workspace:ro" in s["volumes"], service
            assert f"{ROOT / 'configs'}:/app/configs:ro" in s["volumes"], service
            assert s["working_dir"] == "/workspace" and s["environment"]["PYTHONPATH"] == "/workspace"
            assert s["environment"]["RLHF_CONFIG_PATH"] == "/workspace/configs:/app/configs"
    elsewhere = yaml.safe_load(_config(CPU_FILES, {**ENV, "RLHF_WORKSPACE": str(tmp_path)}).stdout)
    assert f"{tmp_path}:/workspace:ro" in elsewhere["services"]["learner"]["volumes"]


def test_a_reward_api_on_the_host_is_reachable_with_its_key(gpu):
    reward = gpu["services"]["reward"]
    assert reward["extra_hosts"] == {"host.docker.internal": "host-gateway"} or reward["extra_hosts"] == [
        "host.docker.internal:host-gateway"
    ], reward["extra_hosts"]
    proc = _config(GPU_FILES, {**ENV, "RLHF_REWARD_API_KEY": "api-key-of-the-user"})
    config = yaml.safe_load(proc.stdout)
    assert config["services"]["reward"]["environment"]["RLHF_REWARD_API_KEY"] == "api-key-of-the-user"
    # the key goes to the reward service only
    for service in RLHF_SERVICES - {"reward"}:
        assert "RLHF_REWARD_API_KEY" not in config["services"][service]["environment"], service


def test_the_learner_status_is_published_on_the_loopback_only(gpu):
    assert (
        gpu["services"]["learner"]["ports"] == ["127.0.0.1:8054:8054/tcp"]
        or gpu["services"]["learner"]["ports"][0]["host_ip"] == "127.0.0.1"
    )


def test_cpu_variant_reserves_no_gpu_and_runs_the_tiny_default(cpu):
    for name, service in cpu["services"].items():
        if name in MONITORING:
            continue
        assert "deploy" not in service, name
        assert service["image"] == "rlhf:cpu"
        assert service["environment"]["RLHF_CONFIG"] == "tiny-cpu.yaml"


@pytest.mark.parametrize("variant", ["gpu", "cpu"])
def test_every_long_running_service_has_a_healthcheck_and_a_restart_policy(variant, gpu, cpu):
    services = {"gpu": gpu, "cpu": cpu}[variant]["services"]
    assert set(services) == LONG_RUNNING | {"init"} | MONITORING | AGENTS | DISTILL | TINKER
    for name in LONG_RUNNING:
        check = services[name].get("healthcheck", {}).get("test")
        assert check and check[0] == "CMD", (name, check)
        assert services[name]["restart"] == "on-failure"
        # a first start may download a model and compile vLLM's graphs: failures count after an hour
        if name in LOADS_A_MODEL:
            assert services[name]["healthcheck"]["start_period"] == "1h", name
    assert services["init"]["restart"] == "no"


def test_the_learner_waits_for_healthy_dependencies(gpu):
    deps = gpu["services"]["learner"]["depends_on"]
    assert {k: v["condition"] for k, v in deps.items()} == {
        "redis": "service_healthy",
        "reward": "service_healthy",
        "critic": "service_healthy",
        "generation": "service_healthy",
    }
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


@pytest.mark.parametrize("variant", ["gpu", "cpu"])
def test_the_gateway_is_a_profile_on_the_loopback_that_finds_the_servers_in_redis(variant, gpu, cpu):
    """`--profile agents` adds `rlhf serve gateway`: the run's image, config and token, healthy on
    /health, published on the host's loopback, after Redis and a generation server are healthy."""
    services = {"gpu": gpu, "cpu": cpu}[variant]["services"]
    g = services["gateway"]
    assert g["profiles"] == ["agents"] and g["image"] == services["rollout"]["image"]
    assert g["command"][:5] == ["serve", "gateway", "--host", "0.0.0.0", "--port"] and g["command"][5] == "8090"
    assert "127.0.0.1:8090/health" in g["healthcheck"]["test"][-1]
    port = g["ports"][0]
    assert port in ("127.0.0.1:8090:8090/tcp",) or (port["host_ip"], port["target"]) == ("127.0.0.1", 8090)
    assert {k: v["condition"] for k, v in g["depends_on"].items()} == {
        "redis": "service_healthy",
        "generation": "service_healthy",
    }
    assert g["environment"]["RLHF_SET"] == services["rollout"]["environment"]["RLHF_SET"]  # replay.url, model


@pytest.mark.parametrize("variant", ["gpu", "cpu"])
def test_the_teacher_is_a_profile_every_service_can_reach(variant, gpu, cpu):
    """`--profile distill` adds `rlhf serve teacher` (on-policy distillation): the run's image and
    config, healthy once its gRPC health service says rlhf.v1.Teacher, after the model is built;
    every service is told its address (rpc.teacher.host)."""
    services = {"gpu": gpu, "cpu": cpu}[variant]["services"]
    t = services["teacher"]
    assert t["profiles"] == ["distill"] and t["image"] == services["critic"]["image"]
    assert t["command"] == ["serve", "teacher", "--host", "0.0.0.0"] and t["restart"] == "on-failure"
    assert t["healthcheck"]["test"][-2:] == ["127.0.0.1:50056", "rlhf.v1.Teacher"]
    assert t["healthcheck"]["start_period"] == "1h"
    assert {k: v["condition"] for k, v in t["depends_on"].items()} == {"init": "service_completed_successfully"}
    for name in RLHF_SERVICES - {"redis"}:
        assert "rpc.teacher.host=teacher" in services[name]["environment"]["RLHF_SET"].split(), name


@pytest.mark.parametrize("variant", ["gpu", "cpu"])
def test_the_tinker_api_is_a_profile_on_the_loopback_with_its_checkpoints_in_the_runs_volume(variant, gpu, cpu):
    """`--profile tinker` adds `rlhf serve tinker`: the run's image, config and token, its
    tinker:// checkpoints under /runs (the workspace is read-only), healthy on its open /healthz,
    published on the host's loopback, needing no service of a run but the model's init, its own
    generation server and its own trainer."""
    services = {"gpu": gpu, "cpu": cpu}[variant]["services"]
    t = services["tinker"]
    assert t["profiles"] == ["tinker"] and t["image"] == services["critic"]["image"] and t["restart"] == "on-failure"
    assert t["command"] == [
        "serve",
        "tinker",
        "--host",
        "0.0.0.0",
        "--port",
        "8765",
        "--set",
        "tinker.root=/runs/tinker",
        "--set",
        "tinker.generation=tinker-generation:50051",
        "--set",
        "tinker.trainer=tinker-trainer:50057",
    ]
    assert "127.0.0.1:8765/api/v1/healthz" in t["healthcheck"]["test"][-1]
    assert t["healthcheck"]["start_period"] == "1h"
    port = t["ports"][0]
    assert port in ("127.0.0.1:8765:8765/tcp",) or (port["host_ip"], port["target"]) == ("127.0.0.1", 8765)
    assert {k: v["condition"] for k, v in t["depends_on"].items()} == {
        "init": "service_completed_successfully",
        "tinker-generation": "service_healthy",
        "tinker-trainer": "service_healthy",
    }
    assert "runs:/runs:rw" in t["volumes"] or any(
        v.get("source") == "runs" for v in t["volumes"] if isinstance(v, dict)
    )
    # its samples decoded by a generation server of its own, in no run's registry, on no shared memory
    g = services["tinker-generation"]
    assert g["profiles"] == ["tinker"] and g["image"] == t["image"] and "ports" not in g
    assert g["command"] == [
        "serve",
        "generation",
        "--host",
        "0.0.0.0",
        "--set",
        "replay.url=null",
        "--set",
        "rpc.shm_dir=null",
    ]
    assert "rlhf.v1.Generation" in g["healthcheck"]["test"] and "127.0.0.1:50051" in g["healthcheck"]["test"]
    assert {k: v["condition"] for k, v in g["depends_on"].items()} == {"init": "service_completed_successfully"}
    # its training models held by a trainer of its own, on its default port
    tr = services["tinker-trainer"]
    assert tr["profiles"] == ["tinker"] and tr["image"] == t["image"] and "ports" not in tr
    assert tr["command"] == ["serve", "tinker-trainer", "--host", "0.0.0.0"]
    assert "rlhf.v1.Tinker-trainer" in tr["healthcheck"]["test"] and "127.0.0.1:50057" in tr["healthcheck"]["test"]
    assert {k: v["condition"] for k, v in tr["depends_on"].items()} == {"init": "service_completed_successfully"}


def test_state_lives_on_named_volumes(gpu):
    assert set(gpu["volumes"]) == {"runs", "redis", "prometheus", "weights-shm"}
    for name in ("learner", "critic", "generation", "init", "reward"):
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
    probe = docker(
        "run",
        "--rm",
        "--entrypoint",
        "python3",
        IMAGE,
        "-m",
        "services.common.rpc.health",
        "127.0.0.1:50051",
        check=False,
    )
    assert probe.returncode == 1 and "Traceback" not in probe.stderr, probe.stderr
    # a placeholder secret left from an example file stops a service at once, saying which
    refused = docker(
        "run",
        "--rm",
        "-e",
        "RLHF_AUTH_TOKEN=change-me",
        IMAGE,
        "serve",
        "reward",
        "-c",
        "tiny-cpu.yaml",
        "--host",
        "0.0.0.0",
        check=False,
    )
    assert refused.returncode == 2 and "RLHF_AUTH_TOKEN is still the placeholder" in refused.stderr, refused.stderr


# Triton's launcher, as vLLM's compiled path builds it at the first model load: a C extension
# compiled with `cc` against Python's headers, then imported
TRITON_LIKE_BUILD = r"""
set -eu
cd "$(mktemp -d)"
cat > probe.c <<'C'
#include <Python.h>
static struct PyModuleDef def = {PyModuleDef_HEAD_INIT, "probe", NULL, -1, NULL};
PyMODINIT_FUNC PyInit_probe(void) { return PyModule_Create(&def); }
C
include=$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["include"])')
suffix=$(python3 -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')
cc probe.c -O3 -shared -fPIC -I"$include" -o "probe$suffix"
python3 -c 'import probe; print("built and imported", probe.__name__)'
"""


def test_the_gpu_runtime_can_build_tritons_launcher():
    """The runtime stage of the gpu flavour (everything but the multi-GB vLLM/CUDA layer, which
    cannot be pulled here) has the C compiler and headers Triton needs; the cpu flavour's has none
    (it is not needed there, and the image stays small)."""
    from tests.compose.support import docker, require_docker

    require_docker()
    base = os.environ.get("RLHF_TEST_BASE_IMAGE", "rlhf-base:bookworm")
    sizes = {}
    for flavour in ("gpu", "cpu"):
        tag = f"rlhf:runtime-base-{flavour}"
        docker(
            "build",
            "--quiet",
            "--target",
            "runtime-base",
            "--build-arg",
            f"FLAVOUR={flavour}",
            "--build-arg",
            f"BASE_IMAGE={base}",
            "-t",
            tag,
            str(ROOT),
            timeout=900,
        )
        sizes[flavour] = int(docker("image", "inspect", "-f", "{{.Size}}", tag).stdout)
        built = docker("run", "--rm", "--user", "rlhf", "--entrypoint", "sh", tag, "-c", TRITON_LIKE_BUILD, check=False)
        if flavour == "gpu":
            assert built.returncode == 0 and "built and imported probe" in built.stdout, built.stderr
        else:
            assert built.returncode != 0
    print(f"runtime-base sizes: gpu {sizes['gpu'] / 1e6:.0f} MB, cpu {sizes['cpu'] / 1e6:.0f} MB")
