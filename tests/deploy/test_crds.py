"""The custom resources (KEDA's ScaledObject and TriggerAuthentication, the Prometheus operator's
ServiceMonitor) have no schema in kubernetes-validate: each is checked here against a structural
schema written from the projects' documented specs (KEDA 2.11+ docs "Redis Streams" and the CRDs'
fields: keda.sh/v1alpha1; Prometheus operator API reference: monitoring.coreos.com/v1), then
against the rendered objects they name, and against what the code really uses: the prompt stream
and consumer group come from ReplayStore, not from strings copied here. The HPA's external metric
is checked against the prometheus-adapter rule that serves it."""

from __future__ import annotations

import re
from urllib.parse import urlparse

import pytest
import yaml

from . import manifests as m

INT32 = {"type": "integer", "minimum": -(2**31), "maximum": 2**31 - 1}
NONNEG_INT32 = {**INT32, "minimum": 0}
NAME = {"type": "string", "minLength": 1, "maxLength": 253, "pattern": r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$"}
LABELS = {"type": "object", "additionalProperties": {"type": "string"}}
OBJECT_META = {
    "type": "object",
    "required": ["name"],
    "properties": {"name": NAME, "namespace": NAME, "labels": LABELS, "annotations": LABELS},
}
LABEL_SELECTOR = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "matchLabels": LABELS,
        "matchExpressions": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["key", "operator"],
                "additionalProperties": False,
                "properties": {
                    "key": {"type": "string"},
                    "operator": {"enum": ["In", "NotIn", "Exists", "DoesNotExist"]},
                    "values": {"type": "array", "items": {"type": "string"}},
                },
            },
        },
    },
}
# Prometheus' duration format, as the ServiceMonitor CRD's pattern
DURATION = {
    "type": "string",
    "pattern": r"^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$",
}
DIGITS = {"type": "string", "pattern": r"^[0-9]+$"}  # KEDA's trigger metadata: every value is a string
BOOL_STRING = {"enum": ["true", "false"]}


def _top(kind: str, api_version: str, spec: dict) -> dict:
    return {
        "type": "object",
        "required": ["apiVersion", "kind", "metadata", "spec"],
        "additionalProperties": False,
        "properties": {
            "apiVersion": {"const": api_version},
            "kind": {"const": kind},
            "metadata": OBJECT_META,
            "spec": spec,
        },
    }


# KEDA docs, "Redis Streams" scaler: its trigger metadata (address or host+port; stream required;
# consumerGroup, then lagCount with activationLagCount, or pendingEntriesCount; else streamLength)
REDIS_STREAMS_METADATA = {
    "type": "object",
    "additionalProperties": False,
    "required": ["stream"],
    "properties": {
        "address": {"type": "string", "pattern": r"^[^:\s]+:[0-9]+$"},
        "host": {"type": "string"},
        "port": DIGITS,
        "addressFromEnv": {"type": "string"},
        "hostFromEnv": {"type": "string"},
        "portFromEnv": {"type": "string"},
        "usernameFromEnv": {"type": "string"},
        "passwordFromEnv": {"type": "string"},
        "stream": {"type": "string", "minLength": 1},
        "consumerGroup": {"type": "string", "minLength": 1},
        "pendingEntriesCount": DIGITS,
        "streamLength": DIGITS,
        "lagCount": DIGITS,
        "activationLagCount": DIGITS,
        "enableTLS": BOOL_STRING,
        "unsafeSsl": BOOL_STRING,
        "databaseIndex": DIGITS,
    },
    "anyOf": [
        {"required": ["address"]},
        {"required": ["host", "port"]},
        {"required": ["addressFromEnv"]},
        {"required": ["hostFromEnv", "portFromEnv"]},
    ],
    "dependentRequired": {
        "lagCount": ["consumerGroup", "activationLagCount"],
        "pendingEntriesCount": ["consumerGroup"],
    },
}
# keda.sh/v1alpha1 ScaledObject: spec requires scaleTargetRef and triggers; each trigger type and
# metadata (a map of strings); the counts are int32
SCALED_OBJECT = _top(
    "ScaledObject",
    "keda.sh/v1alpha1",
    {
        "type": "object",
        "required": ["scaleTargetRef", "triggers"],
        "additionalProperties": False,
        "properties": {
            "scaleTargetRef": {
                "type": "object",
                "required": ["name"],
                "additionalProperties": False,
                "properties": {
                    "apiVersion": {"type": "string"},
                    "kind": {"type": "string"},
                    "name": {"type": "string", "minLength": 1},
                    "envSourceContainerName": {"type": "string"},
                },
            },
            "pollingInterval": NONNEG_INT32,
            "cooldownPeriod": NONNEG_INT32,
            "initialCooldownPeriod": NONNEG_INT32,
            "idleReplicaCount": NONNEG_INT32,
            "minReplicaCount": NONNEG_INT32,
            "maxReplicaCount": NONNEG_INT32,
            "fallback": {"type": "object", "required": ["failureThreshold", "replicas"]},
            "advanced": {
                "type": "object",
                "additionalProperties": False,
                "properties": {
                    "restoreToOriginalReplicaCount": {"type": "boolean"},
                    "scalingModifiers": {"type": "object"},
                    "horizontalPodAutoscalerConfig": {
                        "type": "object",
                        "additionalProperties": False,
                        "properties": {
                            "name": {"type": "string"},
                            "behavior": {
                                "type": "object",
                                "additionalProperties": False,
                                "properties": {
                                    d: {
                                        "type": "object",
                                        "additionalProperties": False,
                                        "properties": {
                                            "stabilizationWindowSeconds": {**INT32, "minimum": 0, "maximum": 3600},
                                            "selectPolicy": {"enum": ["Max", "Min", "Disabled"]},
                                            "policies": {
                                                "type": "array",
                                                "items": {
                                                    "type": "object",
                                                    "required": ["type", "value", "periodSeconds"],
                                                    "properties": {
                                                        "type": {"enum": ["Pods", "Percent"]},
                                                        "value": INT32,
                                                        "periodSeconds": INT32,
                                                    },
                                                },
                                            },
                                        },
                                    }
                                    for d in ("scaleUp", "scaleDown")
                                },
                            },
                        },
                    },
                },
            },
            "triggers": {
                "type": "array",
                "minItems": 1,
                "items": {
                    "type": "object",
                    "required": ["type", "metadata"],
                    "additionalProperties": False,
                    "properties": {
                        "type": {"type": "string"},
                        "name": {"type": "string"},
                        "metadata": {"type": "object", "additionalProperties": {"type": "string"}},
                        "metricType": {"enum": ["AverageValue", "Value", "Utilization"]},
                        "useCachedMetrics": {"type": "boolean"},
                        "authenticationRef": {
                            "type": "object",
                            "required": ["name"],
                            "additionalProperties": False,
                            "properties": {
                                "name": {"type": "string"},
                                "kind": {"enum": ["TriggerAuthentication", "ClusterTriggerAuthentication"]},
                            },
                        },
                    },
                    "if": {"properties": {"type": {"const": "redis-streams"}}},
                    "then": {"properties": {"metadata": REDIS_STREAMS_METADATA}},
                },
            },
        },
    },
)
# keda.sh/v1alpha1 TriggerAuthentication: secretTargetRef items need parameter, name and key; the
# redis-streams scaler's parameters are username, password and the TLS ones
TRIGGER_AUTHENTICATION = _top(
    "TriggerAuthentication",
    "keda.sh/v1alpha1",
    {
        "type": "object",
        "additionalProperties": False,
        "minProperties": 1,
        "properties": {
            "secretTargetRef": {
                "type": "array",
                "minItems": 1,
                "items": {
                    "type": "object",
                    "required": ["parameter", "name", "key"],
                    "additionalProperties": False,
                    "properties": {
                        "parameter": {"enum": ["username", "password", "tls", "ca", "cert", "key", "keyPassword"]},
                        "name": NAME,
                        "key": {"type": "string", "minLength": 1},
                    },
                },
            }
        },
    },
)
# monitoring.coreos.com/v1 ServiceMonitor: spec requires selector and endpoints; an endpoint names
# its Service port; authorization (not with bearerTokenSecret or basicAuth) holds a Secret key
SERVICE_MONITOR = _top(
    "ServiceMonitor",
    "monitoring.coreos.com/v1",
    {
        "type": "object",
        "required": ["selector", "endpoints"],
        "additionalProperties": False,
        "properties": {
            "jobLabel": {"type": "string"},
            "selector": LABEL_SELECTOR,
            "namespaceSelector": {
                "type": "object",
                "additionalProperties": False,
                "properties": {
                    "any": {"type": "boolean"},
                    "matchNames": {"type": "array", "items": {"type": "string"}},
                },
            },
            "targetLabels": {"type": "array", "items": {"type": "string"}},
            "podTargetLabels": {"type": "array", "items": {"type": "string"}},
            "sampleLimit": {"type": "integer", "minimum": 0},
            "endpoints": {
                "type": "array",
                "minItems": 1,
                "items": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {
                        "port": {"type": "string", "minLength": 1},
                        "path": {"type": "string", "pattern": "^/"},
                        "scheme": {"enum": ["http", "https", "HTTP", "HTTPS"]},
                        "interval": DURATION,
                        "scrapeTimeout": DURATION,
                        "honorLabels": {"type": "boolean"},
                        "authorization": {
                            "type": "object",
                            "additionalProperties": False,
                            "properties": {
                                "type": {"type": "string", "not": {"pattern": "(?i)^basic$"}},
                                "credentials": {
                                    "type": "object",
                                    "required": ["key"],
                                    "additionalProperties": False,
                                    "properties": {
                                        "name": NAME,
                                        "key": {"type": "string", "minLength": 1},
                                        "optional": {"type": "boolean"},
                                    },
                                },
                            },
                        },
                        "bearerTokenSecret": {"type": "object"},
                        "basicAuth": {"type": "object"},
                        "relabelings": {"type": "array"},
                        "metricRelabelings": {"type": "array"},
                    },
                    "not": {
                        "anyOf": [
                            {"required": ["authorization", "bearerTokenSecret"]},
                            {"required": ["authorization", "basicAuth"]},
                        ]
                    },
                },
            },
        },
    },
)
SCHEMAS = {
    "ScaledObject": SCALED_OBJECT,
    "TriggerAuthentication": TRIGGER_AUTHENTICATION,
    "ServiceMonitor": SERVICE_MONITOR,
}


def _validator(schema):
    try:
        import jsonschema
    except ImportError:
        m.missing("jsonschema (installed with kubernetes-validate)")
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


def _errors(obj) -> list[str]:
    return [f"{'/'.join(map(str, e.path))}: {e.message}" for e in _validator(SCHEMAS[obj["kind"]]).iter_errors(obj)]


@pytest.mark.parametrize("variant", [v for v in m.VARIANTS if "keda" in v or "servicemonitor" in v])
def test_custom_resources_match_their_documented_schema(variant, docs):
    crs = [d for d in docs[variant] if d["kind"] in m.CRD_KINDS]
    assert crs
    for obj in crs:
        assert _errors(obj) == [], f"{obj['kind']}/{obj['metadata']['name']}"


def test_the_schemas_catch_what_they_are_for(docs):
    """Each schema refuses a typical mistake: a number where KEDA wants a string, a misspelt key, a
    trigger without its metadata, an endpoint with two kinds of auth."""
    objs = docs["gpu+keda+servicemonitor"]
    so, sm = m.one(objs, "ScaledObject", "rollout"), m.one(objs, "ServiceMonitor", "rlhf")
    import copy

    bad = copy.deepcopy(so)
    bad["spec"]["triggers"][0]["metadata"]["lagCount"] = 64
    assert _errors(bad)
    bad = copy.deepcopy(so)
    bad["spec"]["triggers"][0]["metadata"]["consumergroup"] = "workers"
    assert _errors(bad)
    bad = copy.deepcopy(so)
    del bad["spec"]["triggers"][0]["metadata"]["activationLagCount"]
    assert _errors(bad)
    bad = copy.deepcopy(so)
    bad["spec"]["minReplicaCount"] = "0"
    assert _errors(bad)
    bad = copy.deepcopy(sm)
    bad["spec"]["endpoints"][0]["bearerTokenSecret"] = {"name": "x", "key": "y"}
    assert _errors(bad)
    bad = copy.deepcopy(sm)
    del bad["spec"]["selector"]
    assert _errors(bad)


class _NoRedis:
    """Enough of a Redis client for ReplayStore.__init__: the key names without a server."""

    def register_script(self, script):
        return None

    def xgroup_create(self, *args, **kwargs):
        return True


@pytest.mark.parametrize("overlay", m.OVERLAYS)
def test_keda_reads_the_stream_and_group_the_workers_use(overlay, docs, tmp_path):
    from services.common.replay import ReplayStore
    from services.common.replay.streams import WORKERS_GROUP

    objs = docs[f"{overlay}+keda"]
    rollout = m.one(objs, "Deployment", "rollout")
    (worker,) = m.resolve(rollout, m.pod_spec(rollout)["containers"][0], objs, tmp_path)
    store = ReplayStore(_NoRedis(), namespace=worker.cfg.replay.namespace)
    so = m.one(objs, "ScaledObject", "rollout")
    assert so["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "rollout"}
    assert so["spec"]["minReplicaCount"] == 0 and so["spec"]["maxReplicaCount"] >= 1
    assert {"pollingInterval", "cooldownPeriod"} <= set(so["spec"])
    url = urlparse(worker.cfg.replay.url)
    redis_svc = m.one(objs, "Service", url.hostname)
    modes = {}
    for t in so["spec"]["triggers"]:
        meta = t["metadata"]
        assert t["type"] == "redis-streams"
        assert meta["stream"] == store.prompts and meta["consumerGroup"] == WORKERS_GROUP
        # KEDA runs in its own namespace: the Service's name in this one, and its port
        assert meta["address"] == f"{url.hostname}.{redis_svc['metadata']['namespace']}.svc:{url.port}"
        assert meta["databaseIndex"] == url.path.lstrip("/")
        auth = m.one(objs, "TriggerAuthentication", t["authenticationRef"]["name"])
        (ref,) = auth["spec"]["secretTargetRef"]
        assert ref["parameter"] == "password"
        secret = m.data_of(m.one(objs, "Secret", ref["name"]))
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv(worker.cfg.replay.password_env, secret[ref["key"]])
            assert worker.cfg.replay.resolved_password() == secret[ref["key"]]
        assert worker.env[worker.cfg.replay.password_env] == secret[ref["key"]]
        modes["lag" if "lagCount" in meta else "pending"] = meta
    # lag mode (the only one that scales to zero) and pending mode (no worker leaves while prompts
    # are claimed), each targeting what one worker holds at once with configs/gpu.yaml
    assert set(modes) == {"lag", "pending"}
    assert modes["lag"]["activationLagCount"] == "0"
    assert int(modes["lag"]["lagCount"]) == int(modes["pending"]["pendingEntriesCount"]) == _gpu_prompts_per_worker()


def _gpu_prompts_per_worker() -> int:
    """What one rollout worker holds at once with configs/gpu.yaml: the autoscalers' target."""
    from services.common.config import load_config

    cfg = load_config(str(m.ROOT / "configs" / "gpu.yaml"), [])
    return cfg.rollout.prompts_per_request * cfg.rollout.concurrency


def test_the_address_follows_the_overlays_namespace(k8s_tree):
    """The overlay sets the namespace; its replacement puts it into KEDA's Redis address."""
    kust = k8s_tree / "overlays" / "gpu+keda" / "kustomization.yaml"
    original = kust.read_text()
    try:
        kust.write_text(original.replace("\nnamespace: rlhf\n", "\nnamespace: ppo-team\n"))
        objs = m.load_docs(m.render(k8s_tree, "gpu+keda"))
    finally:
        kust.write_text(original)
    so = m.one(objs, "ScaledObject", "rollout")
    assert {t["metadata"]["address"] for t in so["spec"]["triggers"]} == {"redis.ppo-team.svc:6379"}
    assert m.one(objs, "Service", "redis")["metadata"]["namespace"] == "ppo-team"


@pytest.mark.parametrize("variant", [v for v in m.VARIANTS if "servicemonitor" in v])
def test_servicemonitor_scrapes_every_metrics_port_with_the_token(variant, docs):
    objs = docs[variant]
    sm = m.one(objs, "ServiceMonitor", "rlhf")
    (ep,) = sm["spec"]["endpoints"]
    cred = ep["authorization"]["credentials"]
    assert ep["authorization"].get("type", "Bearer") == "Bearer" and ep["path"] == "/metrics"
    secret = m.one(objs, "Secret", cred["name"])
    from services.common.config import RPCConfig

    assert cred["key"] == RPCConfig().auth_token_env and cred["key"] in m.data_of(secret)
    scraped = set()
    for svc in m.find(objs, "Service"):
        if m.selects(sm["spec"]["selector"], svc["metadata"]["labels"]):
            if any(p["name"] == ep["port"] for p in svc["spec"]["ports"]):
                scraped.add(m.component(svc))
    # every workload that serves metrics, through a Service port named `metrics`: on a container
    # port named `metrics`, or the Tinker API on its HTTP port (/metrics beside the API)
    http_metrics = {"tinker"}
    serving = {
        m.component(w)
        for w in m.workloads(objs)
        if any(
            p.get("name") == ("http" if m.component(w) in http_metrics else "metrics")
            for c in m.containers(w, init=False)
            for p in c.get("ports", [])
        )
    }
    for svc in m.find(objs, "Service"):
        for p in svc["spec"]["ports"]:
            if p["name"] == ep["port"]:
                assert p["targetPort"] == ("http" if m.component(svc) in http_metrics else "metrics"), svc
    components = variant.split("+")
    teacher = {"teacher"} if "distill" in components else set()  # components/distill
    tinker = {"tinker", "tinker-generation", "tinker-trainer"} if "tinker" in components else set()  # components/tinker
    assert scraped == serving == {"generation", "reward", "critic", "learner", "rollout"} | teacher | tinker
    assert sm["spec"]["jobLabel"] in m.one(objs, "Service", "learner")["metadata"]["labels"]
    # the job label is the component: the names the compose scrape config gives its jobs, which
    # the alert rules and the dashboard select on
    # (the compose file's gateway, under `--profile agents`, is scraped on its HTTP port, and its
    # teacher under `--profile distill`: a job whose component the variant lacks is left out)
    compose_prom = m.ROOT / "deploy" / "prometheus" / "prometheus.yml"
    jobs = {j["job_name"] for j in yaml.safe_load(compose_prom.read_text())["scrape_configs"]}
    # job -> the component that adds it
    optional = {
        "gateway": "gateway",
        "teacher": "distill",
        "tinker": "tinker",
        "tinker-generation": "tinker",
        "tinker-trainer": "tinker",
    }
    assert scraped == {j for j in jobs if j not in optional or optional[j] in variant.split("+")}


@pytest.mark.parametrize("variant", [v for v in m.VARIANTS if "hpa" in v])
def test_hpa_reads_the_metric_the_adapter_rule_serves(variant, docs):
    hpa = m.one(docs[variant], "HorizontalPodAutoscaler", "rollout")
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "rollout"}
    (metric,) = hpa["spec"]["metrics"]
    assert metric["type"] == "External"
    name = metric["external"]["metric"]["name"]
    assert name == "rlhf_replay_prompts_waiting"
    values = yaml.safe_load((m.K8S / "components" / "hpa" / "prometheus-adapter-values.yaml").read_text())
    (rule,) = values["rules"]["external"]
    assert rule["name"]["as"] == name and re.fullmatch(rule["name"]["matches"], name)
    assert rule["seriesQuery"].startswith(name + "{")
    assert rule["resources"]["overrides"]["namespace"] == {"resource": "namespace"}
    assert "<<.Series>>" in rule["metricsQuery"] and "<<.LabelMatchers>>" in rule["metricsQuery"]
    assert metric["external"]["target"] == {"type": "AverageValue", "averageValue": str(_gpu_prompts_per_worker())}


def test_the_learner_exports_the_hpa_metric():
    """The learner exports the gauge the HPA scales on."""
    from prometheus_client import CollectorRegistry

    from services.learner.metrics import LearnerMetrics

    registry = CollectorRegistry()
    LearnerMetrics(registry)
    names = {mf.name for mf in registry.collect()}
    assert "rlhf_replay_prompts_waiting" in names
