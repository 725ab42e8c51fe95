"""deploy/k8s renders, and what it renders is valid Kubernetes: every overlay, alone and with each
component, through `kubectl kustomize` and `kubernetes-validate --strict` (the oldest Kubernetes
these manifests claim, 1.27, the first with GA gRPC probes, and the newest the validator knows);
plus what a schema cannot see: references that resolve, selectors that select, probes on the
services' real health names, security contexts that meet the "restricted" Pod Security Standard."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from services.common.config import ReplayConfig, RPCConfig
from services.common.rpc.health import readiness_name

from . import manifests as m

K8S_VERSIONS = ("1.27.0", "1.37.0")
RLHF_COMPONENTS = ("generation", "reward", "critic", "learner", "rollout")


@pytest.fixture(scope="module")
def validation(rendered, tmp_path_factory):
    """kubernetes-validate --strict over every variant's render, against each version: {variant: output}."""
    m.kubernetes_validate_version()
    d = tmp_path_factory.mktemp("validate")
    for variant, text in rendered.items():
        (d / f"{variant}.yaml").write_text(text)
    args = [a for v in K8S_VERSIONS for a in ("-k", v)]
    p = subprocess.run(
        [sys.executable, "-m", "kubernetes_validate", "--strict", *args, *[f"{v}.yaml" for v in rendered]],
        cwd=d,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, f"kubernetes-validate failed:\n{p.stdout}\n{p.stderr}"
    out = {v: [] for v in rendered}
    for line in p.stdout.splitlines():
        variant = line.split()[1].removesuffix(".yaml")
        out[variant].append(line)
    return out


@pytest.mark.parametrize("variant", m.VARIANTS)
def test_every_core_object_passes_strict_schema_validation(variant, docs, validation):
    lines = validation[variant]
    assert not [line for line in lines if line.startswith(("ERROR", "FATAL"))], "\n".join(lines)
    for d in docs[variant]:
        kn = f"{d['kind'].lower()}/{d['metadata']['name']}"
        for version in K8S_VERSIONS:
            mm = ".".join(version.split(".")[:2])
            passed = f"passed for resource {kn} against version {mm}"
            if d["kind"] in m.CRD_KINDS:  # no schema in kubernetes-validate: test_crds.py checks them
                assert not any(passed in line for line in lines)
            else:
                assert any(passed in line for line in lines), f"{kn} not validated against {mm}:\n" + "\n".join(lines)
    warned = {re.search(r"kind (\w+) ", line).group(1) for line in lines if line.startswith("WARN")}
    assert warned <= m.CRD_KINDS, f"objects with no schema besides the CRDs: {warned - m.CRD_KINDS}"


def test_the_validator_is_strict(tmp_path):
    """--strict rejects a misspelt field: passing means the manifests have none."""
    m.kubernetes_validate_version()
    bad = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "x"},
        "spec": {"ports": [{"port": 1, "targetPort": "grpc", "protocl": "TCP"}]},
    }
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(bad))
    p = subprocess.run(
        [sys.executable, "-m", "kubernetes_validate", "--strict", "-k", K8S_VERSIONS[0], "bad.yaml"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode != 0 and "protocl" in p.stdout


def test_base_configs_are_the_repositorys_configs():
    """base/configs holds a copy of every configs/*.yaml (kustomize reads no file outside its
    directory), each in the ConfigMap: `cp configs/*.yaml deploy/k8s/base/configs/` after a change."""
    ours = sorted(p.name for p in (m.ROOT / "configs").glob("*.yaml"))
    copies = sorted(p.name for p in (m.K8S / "base" / "configs").glob("*.yaml"))
    assert copies == ours, "run: rm deploy/k8s/base/configs/*.yaml; cp configs/*.yaml deploy/k8s/base/configs/"
    for name in ours:
        assert (m.K8S / "base" / "configs" / name).read_bytes() == (m.ROOT / "configs" / name).read_bytes(), (
            f"deploy/k8s/base/configs/{name} differs from configs/{name}: cp configs/{name} deploy/k8s/base/configs/"
        )
    kust = yaml.safe_load((m.K8S / "base" / "kustomization.yaml").read_text())
    files = next(g["files"] for g in kust["configMapGenerator"] if g["name"] == "rlhf-config")
    assert sorted(Path(f).name for f in files) == ours


def test_the_secret_comes_from_an_ignored_local_file_with_the_names_the_services_read(tmp_path):
    example = (m.K8S / "base" / "secrets.env.example").read_text()
    keys = [line.split("=", 1)[0] for line in example.splitlines() if line and not line.startswith("#")]
    assert keys == [RPCConfig().auth_token_env, ReplayConfig().password_env]
    assert set(m.SECRETS) == set(keys)
    for path in ("deploy/k8s/base/secrets.env", "deploy/k8s/overlays/gpu/secrets.env", "deploy/k8s/.tools/bin/kubectl"):
        p = subprocess.run(["git", "check-ignore", "-q", path], cwd=m.ROOT)
        assert p.returncode == 0, f"{path} is not ignored by git"
    p = subprocess.run(["git", "check-ignore", "-q", "deploy/k8s/base/secrets.env.example"], cwd=m.ROOT)
    assert p.returncode == 1
    # no secrets.env, no render: nothing falls back to a default secret
    tree = m.make_tree(tmp_path, secrets=None)
    p = subprocess.run(
        [m.kubectl(), "kustomize", str(tree / "overlays" / "gpu")], capture_output=True, text=True, timeout=120
    )
    assert p.returncode != 0 and "secrets.env" in p.stderr


@pytest.mark.parametrize("variant", m.VARIANTS)
def test_references_resolve_and_selectors_select(variant, docs):
    objs = docs[variant]
    names = {(d["kind"], d["metadata"]["name"]) for d in objs}
    secrets = {d["metadata"]["name"]: m.data_of(d) for d in m.find(objs, "Secret")}
    configmaps = {d["metadata"]["name"]: m.data_of(d) for d in m.find(objs, "ConfigMap")}
    assert {d["metadata"].get("namespace") for d in objs if d["kind"] != "Namespace"} == {"rlhf"}
    assert m.find(objs, "Namespace", "rlhf")
    for w in m.workloads(objs):
        spec = m.pod_spec(w)
        for v in spec.get("volumes", []):
            if "configMap" in v:
                assert v["configMap"]["name"] in configmaps
            if "persistentVolumeClaim" in v:
                assert ("PersistentVolumeClaim", v["persistentVolumeClaim"]["claimName"]) in names
        vct = {t["metadata"]["name"] for t in w["spec"].get("volumeClaimTemplates", [])}
        for c in m.containers(w):
            mounted = {v["name"] for v in spec.get("volumes", [])} | vct
            assert {vm["name"] for vm in c.get("volumeMounts", [])} <= mounted
            for src in c.get("envFrom", []):
                if "configMapRef" in src:
                    assert src["configMapRef"]["name"] in configmaps
                if "secretRef" in src:
                    assert src["secretRef"]["name"] in secrets
            for e in c.get("env", []):
                ref = e.get("valueFrom", {})
                if "secretKeyRef" in ref:
                    assert ref["secretKeyRef"]["key"] in secrets[ref["secretKeyRef"]["name"]]
        labels = w["spec"]["template"]["metadata"]["labels"]
        assert m.selects(w["spec"]["selector"], labels)
    pods = [(w, w["spec"]["template"]["metadata"]["labels"]) for w in m.workloads(objs)]
    for svc in m.find(objs, "Service"):
        chosen = [w for w, labels in pods if m.selects(svc["spec"]["selector"], labels)]
        assert len(chosen) == 1, f"Service {svc['metadata']['name']} selects {len(chosen)} workloads"
        ports = {p["name"]: p["containerPort"] for c in m.containers(chosen[0], init=False) for p in c.get("ports", [])}
        for p in svc["spec"]["ports"]:
            assert p["targetPort"] in ports, (svc["metadata"]["name"], p)
            # a Service port is its container port's number, but for the Tinker API's `metrics`,
            # which targets its HTTP port (/metrics beside the API; a Service cannot list 8765 twice)
            if (m.component(svc), p["name"]) != ("tinker", "metrics"):
                assert ports[p["targetPort"]] == p["port"], (svc["metadata"]["name"], p)
    for pdb in m.find(objs, "PodDisruptionBudget"):
        assert [w for w, labels in pods if m.selects(pdb["spec"]["selector"], labels)]
    for sts in m.find(objs, "StatefulSet"):
        gov = m.one(objs, "Service", sts["spec"]["serviceName"])
        assert gov["spec"].get("clusterIP") == "None"


@pytest.mark.parametrize("overlay", m.OVERLAYS)
def test_pods_meet_the_restricted_pod_security_standard(overlay, docs):
    """The checks of the "restricted" profile (kubernetes.io/docs/concepts/security/pod-security-standards),
    which the namespace's label makes the cluster enforce, plus read-only root filesystems."""
    objs = docs[overlay]
    ns = m.one(objs, "Namespace", "rlhf")
    assert ns["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"
    allowed_volumes = {
        "configMap",
        "csi",
        "downwardAPI",
        "emptyDir",
        "ephemeral",
        "persistentVolumeClaim",
        "projected",
        "secret",
    }
    for w in m.workloads(objs):
        spec, name = m.pod_spec(w), w["metadata"]["name"]
        assert not any(spec.get(k) for k in ("hostNetwork", "hostPID", "hostIPC")), name
        assert spec["automountServiceAccountToken"] is False and spec["enableServiceLinks"] is False, name
        psc = spec["securityContext"]
        assert psc["runAsNonRoot"] is True and psc["runAsUser"] != 0, name
        assert psc["seccompProfile"]["type"] == "RuntimeDefault", name
        for v in spec.get("volumes", []):
            assert set(v) - {"name"} <= allowed_volumes, (name, v)
        for c in m.containers(w):
            sc = c["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False and not sc.get("privileged"), (name, c["name"])
            assert sc["capabilities"]["drop"] == ["ALL"] and not sc["capabilities"].get("add"), (name, c["name"])
            assert sc["readOnlyRootFilesystem"] is True, (name, c["name"])
            assert sc.get("runAsUser", psc["runAsUser"]) != 0
            for kind in ("requests", "limits"):
                assert {"cpu", "memory"} <= set(c["resources"][kind]), (name, c["name"], kind)
            if c["image"].startswith("rlhf"):
                # the image's user (Dockerfile: useradd --uid 10001); writable: /tmp, its home, /runs
                assert psc["runAsUser"] == 10001 and psc["fsGroup"] == 10001
                mounts = {vm["mountPath"] for vm in c["volumeMounts"]}
                assert {"/tmp", "/home/rlhf", "/runs"} <= mounts, (name, c["name"])


@pytest.mark.parametrize("overlay", m.OVERLAYS)
def test_probes_use_the_services_health_names_and_ports(overlay, docs):
    objs = docs[overlay]
    for name in ("generation", "reward", "critic"):
        c = m.one(objs, "Deployment", name)["spec"]["template"]["spec"]["containers"][0]
        grpc_port = next(p["containerPort"] for p in c["ports"] if p["name"] == "grpc")
        assert c["readinessProbe"]["grpc"] == {"port": grpc_port, "service": readiness_name(name)}
        assert c["livenessProbe"]["grpc"] == {"port": grpc_port, "service": ""}
        assert c["startupProbe"]["grpc"] == {"port": grpc_port, "service": ""}
    learner = m.one(objs, "StatefulSet", "learner")
    c = learner["spec"]["template"]["spec"]["containers"][0]
    for probe in ("livenessProbe", "startupProbe"):
        assert c[probe]["httpGet"] == {"path": "/healthz", "port": 8054}
    assert c["readinessProbe"]["grpc"] == {"port": 50054, "service": readiness_name("learner")}
    c = m.one(objs, "Deployment", "rollout")["spec"]["template"]["spec"]["containers"][0]
    assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": 9105}
    assert c["args"][:5] == ["serve", "rollout", "--host", "0.0.0.0", "--metrics-port"] and c["args"][5] == "9105"


@pytest.mark.parametrize("overlay", m.OVERLAYS)
def test_the_teacher_comes_with_components_distill(overlay, docs):
    """components/distill adds the teacher server (one replica, probed on its health names), sized
    by the overlay: a GPU of its own on gpu, the tiny model built first on cpu-tiny; without the
    component there is no teacher, and the overlays' patches for it apply to nothing."""
    assert not [d for d in docs[overlay] if d["metadata"]["name"] == "teacher"]
    objs = docs[f"{overlay}+distill"]
    teacher = m.one(objs, "Deployment", "teacher")
    assert teacher["spec"]["replicas"] == 1 and teacher["spec"]["strategy"]["type"] == "Recreate"
    c = m.pod_spec(teacher)["containers"][0]
    assert c["args"][:4] == ["serve", "teacher", "--host", "0.0.0.0"]
    assert c["readinessProbe"]["grpc"] == {"port": 50056, "service": readiness_name("teacher")}
    assert c["livenessProbe"]["grpc"] == c["startupProbe"]["grpc"] == {"port": 50056, "service": ""}
    assert {p["name"]: p["port"] for p in m.one(objs, "Service", "teacher")["spec"]["ports"]} == {
        "grpc": 50056,
        "metrics": 9106,
    }
    gpus = c["resources"]["limits"].get("nvidia.com/gpu")
    assert gpus == c["resources"]["requests"].get("nvidia.com/gpu")
    inits = [i["name"] for i in m.pod_spec(teacher).get("initContainers", [])]
    if overlay == "gpu":
        assert gpus == 1 and inits == []
    else:
        assert gpus is None and inits == ["tiny-model"]
        assert c["resources"]["requests"] == {"cpu": "250m", "memory": "1Gi"}


@pytest.mark.parametrize("overlay", m.OVERLAYS)
def test_the_tinker_api_comes_with_components_tinker(overlay, docs):
    """components/tinker adds `rlhf serve tinker` (one replica, probed on its open /healthz, its
    tinker:// checkpoints on the runs volume) with a trainer and a generation server of its own,
    sized by the overlay: a GPU each for those two on gpu, the tiny model built first on cpu-tiny;
    without the component there is none."""
    assert not [d for d in docs[overlay] if d["metadata"]["name"] in ("tinker", "tinker-generation", "tinker-trainer")]
    objs = docs[f"{overlay}+tinker"]
    tinker = m.one(objs, "Deployment", "tinker")
    assert tinker["spec"]["replicas"] == 1 and tinker["spec"]["strategy"]["type"] == "Recreate"
    c = m.pod_spec(tinker)["containers"][0]
    assert c["args"][:6] == ["serve", "tinker", "--host", "0.0.0.0", "--port", "8765"]
    assert "tinker.root=/runs/tinker" in c["args"]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["httpGet"] == {"path": "/api/v1/healthz", "port": 8765}, probe
    # its /metrics is on its HTTP port: the Service's port `metrics` (the one the ServiceMonitor
    # scrapes) targets that container port
    ports = m.one(objs, "Service", "tinker")["spec"]["ports"]
    assert {p["name"]: (p["port"], p["targetPort"]) for p in ports} == {
        "http": (8765, "http"),
        "metrics": (9765, "http"),
    }
    assert {p["name"]: p["containerPort"] for p in c["ports"]} == {"http": 8765}
    assert {v["mountPath"] for v in c["volumeMounts"]} >= {"/runs", "/etc/rlhf"}
    # the API computes nothing itself: no GPU of its own
    assert c["resources"]["limits"].get("nvidia.com/gpu") is None
    inits = [i["name"] for i in m.pod_spec(tinker).get("initContainers", [])]
    if overlay != "gpu":
        assert inits == ["tiny-model"] and c["resources"]["requests"] == {"cpu": "250m", "memory": "1Gi"}
    # its training models in a trainer of its own, a GPU of its own on gpu
    assert "tinker.trainer=tinker-trainer:50057" in c["args"]
    trainer = m.one(objs, "Deployment", "tinker-trainer")
    tc = m.pod_spec(trainer)["containers"][0]
    assert tc["args"][:2] == ["serve", "tinker-trainer"] and trainer["spec"]["replicas"] == 1
    assert tc["readinessProbe"]["grpc"] == {"port": 50057, "service": "rlhf.v1.Tinker-trainer"}
    svc = m.one(objs, "Service", "tinker-trainer")
    assert {p["name"]: p["port"] for p in svc["spec"]["ports"]} == {"grpc": 50057, "metrics": 9107}
    assert m.selects(svc["spec"]["selector"], trainer["spec"]["template"]["metadata"]["labels"])
    trainer_inits = [i["name"] for i in m.pod_spec(trainer).get("initContainers", [])]
    assert (tc["resources"]["limits"].get("nvidia.com/gpu"), trainer_inits) == (
        (1, []) if overlay == "gpu" else (None, ["tiny-model"])
    )
    # its samples on a generation server of its own, in no run's registry, that the run's
    # generation Service does not select
    assert "tinker.generation=tinker-generation:50051" in c["args"]
    own = m.one(objs, "Deployment", "tinker-generation")
    g = m.pod_spec(own)["containers"][0]
    assert g["args"][:2] == ["serve", "generation"] and "replay.url=null" in g["args"] and own["spec"]["replicas"] == 1
    assert g["readinessProbe"]["grpc"] == {"port": 50051, "service": "rlhf.v1.Generation"}
    assert {p["name"]: p["containerPort"] for p in g["ports"]} == {"grpc": 50051, "metrics": 9101}
    svc = m.one(objs, "Service", "tinker-generation")
    assert {p["name"]: p["port"] for p in svc["spec"]["ports"]} == {"grpc": 50051, "metrics": 9101}
    assert m.selects(svc["spec"]["selector"], own["spec"]["template"]["metadata"]["labels"])
    assert not m.selects(
        m.one(objs, "Service", "generation")["spec"]["selector"], own["spec"]["template"]["metadata"]["labels"]
    )
    own_inits = [i["name"] for i in m.pod_spec(own).get("initContainers", [])]
    assert (g["resources"]["limits"].get("nvidia.com/gpu"), own_inits) == (
        (1, []) if overlay == "gpu" else (None, ["tiny-model"])
    )


@pytest.mark.parametrize("overlay", m.OVERLAYS)
def test_workload_shapes(overlay, docs):
    objs = docs[overlay]
    learner = m.one(objs, "StatefulSet", "learner")
    assert learner["spec"]["replicas"] == 1
    assert 60 <= m.pod_spec(learner)["terminationGracePeriodSeconds"] <= 120  # it checkpoints on SIGTERM
    critic = m.one(objs, "Deployment", "critic")
    assert critic["spec"]["replicas"] == 1 and critic["spec"]["strategy"]["type"] == "Recreate"
    redis = m.one(objs, "StatefulSet", "redis")
    rc = m.pod_spec(redis)["containers"][0]
    assert rc["image"] == "redis:7" and redis["spec"]["replicas"] == 1
    assert redis["spec"]["volumeClaimTemplates"][0]["metadata"]["name"] == "data"
    script = rc["args"][0]
    assert "appendonly yes" in script and "requirepass" in script and "dir /data" in script
    assert "RLHF_REDIS_PASSWORD" not in " ".join(rc.get("command", []))  # the value never on a command line
    for name in ("generation", "learner"):
        w = m.find(objs, "Deployment", name) + m.find(objs, "StatefulSet", name)
        c = m.pod_spec(w[0])["containers"][0]
        pod_ip = next(e for e in c["env"] if e["name"] == "POD_IP")
        assert pod_ip["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
        assert "rpc.advertise_host=$(POD_IP)" in c["args"]
    image_tag = {"gpu": "rlhf:gpu", "cpu-tiny": "rlhf:cpu"}[overlay]
    for w in m.workloads(objs):
        for c in m.containers(w):
            assert c["image"] in (image_tag, "redis:7")
    gpus = {}
    for w in m.workloads(objs):
        for c in m.containers(w):
            req, lim = c["resources"]["requests"].get("nvidia.com/gpu"), c["resources"]["limits"].get("nvidia.com/gpu")
            assert req == lim, (w["metadata"]["name"], c["name"])
            if lim:
                gpus[w["metadata"]["name"]] = lim
    if overlay == "gpu":
        assert gpus == {"generation": 1, "learner": 1, "critic": 1}
        assert m.one(objs, "PersistentVolumeClaim", "rlhf-runs")["spec"]["accessModes"] == ["ReadWriteMany"]
    else:
        assert gpus == {}
        assert m.one(objs, "PersistentVolumeClaim", "rlhf-runs")["spec"]["accessModes"] == ["ReadWriteOnce"]
        # the tiny model is built before any service of this overlay starts
        for w in m.workloads(objs):
            if m.component(w) in RLHF_COMPONENTS:
                assert [c["name"] for c in m.pod_spec(w)["initContainers"]] == ["tiny-model"]
            else:
                assert "initContainers" not in m.pod_spec(w)


@pytest.mark.parametrize("variant", m.VARIANTS)
def test_autoscalers_own_the_rollout_replicas(variant, docs):
    rollout = m.one(docs[variant], "Deployment", "rollout")
    scaled = "keda" in variant or "hpa" in variant
    assert ("replicas" in rollout["spec"]) is not scaled
    assert len(m.find(docs[variant], "ScaledObject")) == ("keda" in variant)
    assert len(m.find(docs[variant], "HorizontalPodAutoscaler")) == ("hpa" in variant)
    assert len(m.find(docs[variant], "ServiceMonitor")) == ("servicemonitor" in variant)
