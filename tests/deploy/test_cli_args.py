"""Every container's command line, arguments and environment in the rendered manifests is accepted by
the project's own CLI and config validation: argv parsed by `rlhf`'s parser, the config file taken
from the rendered ConfigMap it mounts, $RLHF_SET and --set applied by the CLI's own loader, and
`rlhf config validate` run on the same file and overrides. Then what the services resolve must fit
the manifests: the ports they bind are the ports the probes and Services use, the addresses they
dial are Services that exist, and every service runs on the same model, run directory and secrets."""

from __future__ import annotations

import os
import shutil
import subprocess
from urllib.parse import urlparse

import pytest

from . import manifests as m

RLHF_SERVICES = ("generation", "reward", "critic", "learner", "rollout")


@pytest.fixture(scope="module")
def resolved(docs, tmp_path_factory):
    """{overlay: [Resolved, ...]} for every rlhf command line of every container (init ones too)."""
    out = {}
    for overlay in m.OVERLAYS:
        d = tmp_path_factory.mktemp(overlay)
        out[overlay] = [
            r
            for w in m.workloads(docs[overlay])
            for c in m.containers(w)
            if c["image"].startswith("rlhf")
            for r in m.resolve(w, c, docs[overlay], d)
        ]
    return out


def _serving(resolved, overlay):
    return {r.args.service: r for r in resolved[overlay] if r.cfg is not None}


@pytest.mark.parametrize("overlay", m.OVERLAYS)
def test_every_rlhf_container_parses_and_validates(overlay, resolved):
    serving = _serving(resolved, overlay)
    assert sorted(serving) == sorted(RLHF_SERVICES)
    for r in resolved[overlay]:
        assert r.args.command in ("serve", "init-model"), r.argv
        if r.args.command == "serve":
            assert r.args.service == m.component(r.workload)
            assert r.args.host == "0.0.0.0"
            assert r.validated["model"]["path"] == r.env["RLHF_MODEL"]
    inits = [r for r in resolved[overlay] if r.args.command == "init-model"]
    if overlay == "cpu-tiny":
        assert sorted(m.component(r.workload) for r in inits) == sorted(RLHF_SERVICES)
    else:
        assert inits == []


@pytest.mark.parametrize("overlay", m.OVERLAYS)
def test_ports_bound_are_the_ports_probed_and_served(overlay, resolved, docs):
    objs = docs[overlay]
    for name, r in _serving(resolved, overlay).items():
        ports = {p["name"]: p["containerPort"] for p in r.container["ports"]}
        if name == "rollout":
            assert ports == {"metrics": r.cfg.rollout.metrics_port}
            continue
        ep = getattr(r.cfg.rpc, name)  # the flags (--port, --metrics-port...) are in the config
        bound = {"grpc": ep.port, "metrics": ep.metrics_port}
        if name in ("reward", "learner"):
            bound["http"] = ep.http_port
        assert ports == bound, name
        for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
            p = r.container[probe]
            port = (p.get("grpc") or p.get("httpGet"))["port"]
            assert port in bound.values(), (name, probe)
        svc = m.one(objs, "Service", name)
        assert {p["name"]: p["port"] for p in svc["spec"]["ports"]} == bound


@pytest.mark.parametrize("overlay", m.OVERLAYS)
def test_services_agree_and_dial_what_exists(overlay, resolved, docs):
    objs = docs[overlay]
    serving = _serving(resolved, overlay)
    secret = m.data_of(m.generated(objs, "Secret", "rlhf-secrets"))
    models = {r.cfg.model.path for r in serving.values()}
    assert len(models) == 1, models
    for name, r in serving.items():
        with pytest.MonkeyPatch.context() as mp:
            for k, v in r.env.items():
                mp.setenv(k, v)
            assert r.cfg.rpc.resolved_auth_token() == secret["RLHF_AUTH_TOKEN"], name
            assert r.cfg.replay.resolved_password() == secret["RLHF_REDIS_PASSWORD"], name
        # the replay buffer: a Service of that name and port, database 0 (KEDA's databaseIndex)
        url = urlparse(r.cfg.replay.url)
        redis_svc = m.one(objs, "Service", url.hostname)
        assert url.port in [p["port"] for p in redis_svc["spec"]["ports"]] and url.path == "/0"
        assert url.password is None  # the password comes from the Secret, not the URL
        assert m.component(redis_svc) == "redis"
        # the servers the workers and the learner dial by name (a server's own host is the one it binds)
        for dep in {"reward", "critic"} - {name}:
            ep = getattr(r.cfg.rpc, dep)
            assert ep.port in [p["port"] for p in m.one(objs, "Service", ep.host)["spec"]["ports"]], (name, dep)
    assert serving["learner"].cfg.needs_critic
    # the learner and the critic share the run directory (the critic writes its half of every
    # checkpoint there) on the same volume; it lies on the runs PVC
    run_dirs = {serving[n].cfg.run.run_dir for n in ("learner", "critic")}
    assert len(run_dirs) == 1
    run_dir = run_dirs.pop()
    for n in ("learner", "critic"):
        r = serving[n]
        vols = {v["name"]: v for v in m.pod_spec(r.workload)["volumes"]}
        mount = next(vm for vm in r.container["volumeMounts"] if run_dir.startswith(vm["mountPath"].rstrip("/") + "/"))
        assert vols[mount["name"]]["persistentVolumeClaim"]["claimName"] == "rlhf-runs"
    # the addresses registered in Redis are the pods' own
    for n in ("generation", "learner"):
        assert serving[n].cfg.rpc.advertise_host == m.FAKE_POD_IP
    if overlay == "gpu":
        assert serving["generation"].cfg.generation.backend == "vllm"
        assert {r.cfg.model.device for r in serving.values()} == {"cuda"}
    else:
        assert serving["generation"].cfg.generation.backend == "hf"
        assert {r.cfg.model.device for r in serving.values()} == {"cpu"}
        assert models == {"/runs/tiny-model"}


@pytest.mark.parametrize("overlay", m.OVERLAYS)
def test_the_teacher_parses_binds_what_is_probed_and_is_where_the_others_dial(overlay, docs, tmp_path):
    """components/distill: `rlhf serve teacher` with the run's config and environment binds the
    ports its probes and Service use, on the same model; every other service dials it at the
    Service `teacher` (rlhf-env's RLHF_SET)."""
    objs = docs[f"{overlay}+distill"]
    w = m.one(objs, "Deployment", "teacher")
    (r,) = [r for r in m.resolve(w, m.pod_spec(w)["containers"][0], objs, tmp_path) if r.cfg is not None]
    assert r.args.service == "teacher" and r.args.host == "0.0.0.0"
    ep = r.cfg.rpc.teacher
    ports = {p["name"]: p["containerPort"] for p in r.container["ports"]}
    assert ports == {"grpc": ep.port, "metrics": ep.metrics_port} == {"grpc": 50056, "metrics": 9106}
    assert r.cfg.model.path == r.env["RLHF_MODEL"]
    for other in m.workloads(objs):
        c = m.pod_spec(other)["containers"][0]
        if c["image"].startswith("rlhf") and m.component(other) != "teacher":
            for o in m.resolve(other, c, objs, tmp_path):
                if o.cfg is not None:
                    assert o.cfg.rpc.teacher.host == "teacher" and o.cfg.rpc.teacher.port == ep.port, o.argv


def test_the_tiny_model_init_step_builds_once_and_atomically(docs, tmp_path):
    """The cpu-tiny init container's script, run by sh with a stand-in `rlhf` (the real one takes
    seconds of CPU and has its own tests): it builds the model where RLHF_MODEL says when it is
    missing, leaves no temporary directory, and does nothing when the model is there."""
    w = m.one(docs["cpu-tiny"], "StatefulSet", "learner")
    init = m.pod_spec(w)["initContainers"][0]
    env = m.container_env(init, w, docs["cpu-tiny"])
    command = [m.expand(c, env) for c in init["command"]] + [m.expand(a, env) for a in init["args"]]
    runs = tmp_path / "runs"
    runs.mkdir()
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "calls"
    (bin_dir / "rlhf").write_text(
        f'#!/bin/sh\necho "$@" >> {calls}\n[ "$1" = init-model ] && [ "$2" = --out ] '
        '&& mkdir -p "$3" && echo {} > "$3/config.json"\n'
    )
    (bin_dir / "rlhf").chmod(0o755)
    model = runs / "tiny-model"
    run_env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "RLHF_MODEL": str(model)}
    assert env["RLHF_MODEL"] == "/runs/tiny-model"
    for _ in range(2):
        p = subprocess.run(command, env=run_env, capture_output=True, text=True, timeout=60)
        assert p.returncode == 0, p.stderr
    assert (model / "config.json").exists()
    assert calls.read_text().count("init-model") == 1  # the second start found it
    assert sorted(x.name for x in runs.iterdir()) == ["tiny-model"]
    # a pod that lost the race (the model appeared while it built) keeps the winner's copy
    (bin_dir / "rlhf").write_text(
        f'#!/bin/sh\nmkdir -p "$3" && echo mine > "$3/config.json" && '
        f"mkdir -p {model} && echo winner > {model}/config.json\n"
    )
    shutil.rmtree(model)
    p = subprocess.run(command, env=run_env, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert (model / "config.json").read_text().strip() == "winner"
    assert sorted(x.name for x in runs.iterdir()) == ["tiny-model"]


@pytest.mark.parametrize("overlay", m.OVERLAYS)
def test_the_gateway_component_binds_what_is_probed_and_finds_the_servers(overlay, docs, tmp_path):
    """components/gateway: `rlhf serve gateway` parses and validates under the overlay's
    environment, binds the port its probes and Service use, reaches the generation servers
    through the replay registry (a Redis Service) and shares the run's model and token."""
    objs = docs[f"{overlay}+gateway"]
    (w,) = [w for w in m.workloads(objs) if m.component(w) == "gateway"]
    (r,) = m.resolve(w, m.containers(w)[0], objs, tmp_path)
    assert r.args.service == "gateway" and r.args.host == "0.0.0.0"
    assert r.validated["model"]["path"] == r.env["RLHF_MODEL"]
    port = r.cfg.rpc.gateway.port
    assert {p["name"]: p["containerPort"] for p in r.container["ports"]} == {"http": port}
    for probe, path in (
        ("startupProbe", "/health/live"),
        ("readinessProbe", "/health"),
        ("livenessProbe", "/health/live"),
    ):
        assert r.container[probe]["httpGet"] == {"path": path, "port": port}, probe
    assert {p["name"]: p["port"] for p in m.one(objs, "Service", "gateway")["spec"]["ports"]} == {"http": port}
    url = urlparse(r.cfg.replay.url)
    assert m.component(m.one(objs, "Service", url.hostname)) == "redis"
    secret = m.data_of(m.generated(objs, "Secret", "rlhf-secrets"))
    with pytest.MonkeyPatch.context() as mp:
        for k, v in r.env.items():
            mp.setenv(k, v)
        assert r.cfg.rpc.resolved_auth_token() == secret["RLHF_AUTH_TOKEN"]


@pytest.mark.parametrize("overlay", m.OVERLAYS)
def test_the_tinker_component_binds_what_is_probed_and_scraped(overlay, docs, tmp_path):
    """components/tinker: `rlhf serve tinker`, its own `rlhf serve generation` and `rlhf serve
    tinker-trainer` parse and validate
    under the overlay's environment and bind the ports their probes and Services use; the Services'
    `metrics` ports (what the ServiceMonitor scrapes) reach where each serves /metrics: the Tinker
    API's HTTP port, the generation server's metrics port."""
    objs = docs[f"{overlay}+tinker"]
    w = m.one(objs, "Deployment", "tinker")
    (r,) = [r for r in m.resolve(w, m.pod_spec(w)["containers"][0], objs, tmp_path) if r.cfg is not None]
    assert r.args.service == "tinker" and r.args.host == "0.0.0.0"
    assert r.validated["model"]["path"] == r.env["RLHF_MODEL"]
    port = r.cfg.tinker.port
    assert {p["name"]: p["containerPort"] for p in r.container["ports"]} == {"http": port}
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert r.container[probe]["httpGet"]["port"] == port, probe
    svc = {p["name"]: p for p in m.one(objs, "Service", "tinker")["spec"]["ports"]}
    assert svc["http"]["port"] == port and svc["http"]["targetPort"] == svc["metrics"]["targetPort"] == "http"

    w = m.one(objs, "Deployment", "tinker-generation")
    (g,) = [r for r in m.resolve(w, m.pod_spec(w)["containers"][0], objs, tmp_path) if r.cfg is not None]
    assert g.args.service == "generation" and g.cfg.replay.url is None
    ep = g.cfg.rpc.generation
    bound = {"grpc": ep.port, "metrics": ep.metrics_port}
    assert {p["name"]: p["containerPort"] for p in g.container["ports"]} == bound == {"grpc": 50051, "metrics": 9101}
    svc = m.one(objs, "Service", "tinker-generation")["spec"]["ports"]
    assert {p["name"]: (p["port"], p["targetPort"]) for p in svc} == {n: (v, n) for n, v in bound.items()}
    assert r.cfg.tinker.generation == f"tinker-generation:{ep.port}"

    w = m.one(objs, "Deployment", "tinker-trainer")
    (t,) = [r for r in m.resolve(w, m.pod_spec(w)["containers"][0], objs, tmp_path) if r.cfg is not None]
    assert t.args.service == "tinker-trainer" and t.validated["model"]["path"] == r.validated["model"]["path"]
    ep = t.cfg.rpc.tinker_trainer
    bound = {"grpc": ep.port, "metrics": ep.metrics_port}
    assert {p["name"]: p["containerPort"] for p in t.container["ports"]} == bound == {"grpc": 50057, "metrics": 9107}
    svc = m.one(objs, "Service", "tinker-trainer")["spec"]["ports"]
    assert {p["name"]: (p["port"], p["targetPort"]) for p in svc} == {n: (v, n) for n, v in bound.items()}
    assert r.cfg.tinker.trainer == f"tinker-trainer:{ep.port}"
