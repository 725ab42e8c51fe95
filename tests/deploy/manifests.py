"""Helpers of the deploy tests: finding the tools (deploy/k8s/tools.sh installs them), rendering the
kustomize overlays with their components, and reading the rendered objects the way Kubernetes does
(a container's environment, `$(VAR)` expansion in args and env, the rlhf command lines inside a
`sh -c` script)."""

from __future__ import annotations

import base64
import contextlib
import io
import json
import math
import os
import re
import shlex
import shutil
import subprocess
import types
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
TOOLS_BIN = K8S / ".tools" / "bin"
OVERLAYS = ("gpu", "cpu-tiny")
COMPONENTS = ("keda", "hpa", "servicemonitor", "gateway", "distill", "tinker")
# every overlay alone, with each component, and with each autoscaler plus monitoring (keda and hpa
# both drive the rollout Deployment's replicas: they are never combined)
COMPONENT_SETS = (
    (),
    ("keda",),
    ("hpa",),
    ("servicemonitor",),
    ("keda", "servicemonitor"),
    ("hpa", "servicemonitor"),
    ("gateway",),
    ("distill",),
    ("distill", "servicemonitor"),
    ("tinker",),
    ("tinker", "servicemonitor"),
)
VARIANTS = tuple("+".join((o,) + c) for o in OVERLAYS for c in COMPONENT_SETS) + ("my-code",)  # your code, on cpu-tiny
CRD_KINDS = {"ScaledObject", "TriggerAuthentication", "ServiceMonitor"}
# what the tests put into base/secrets.env of their copy of the tree
SECRETS = {"RLHF_AUTH_TOKEN": "test-token-0123456789", "RLHF_REDIS_PASSWORD": 'test-"redis"\\password'}
FAKE_POD_IP = "10.20.30.40"
KUBECTL_MIN_MINOR = 27


def _required() -> bool:
    """In CI (CI set) or via make (RLHF_REQUIRE_K8S_TOOLS=1) a missing tool fails the test; run by
    hand elsewhere, it skips with the reason."""
    return bool(os.environ.get("CI")) or os.environ.get("RLHF_REQUIRE_K8S_TOOLS") == "1"


def missing(what: str):
    msg = (
        f"{what} is missing: run `bash deploy/k8s/tools.sh` (root on Debian installs everything the deploy tests need)"
    )
    if _required():
        pytest.fail(msg, pytrace=False)
    pytest.skip(msg)


def _version_ok(cmd: list[str], pattern: str, minimum: int) -> bool:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.TimeoutExpired):
        return False
    m = re.search(pattern, out)
    return bool(m) and int(m.group(1)) >= minimum


def kubectl() -> str:
    """kubectl 1.27+ (RLHF_KUBECTL, deploy/k8s/.tools/bin/kubectl or the PATH's)."""
    for c in (os.environ.get("RLHF_KUBECTL"), str(TOOLS_BIN / "kubectl"), shutil.which("kubectl")):
        if (
            c
            and os.access(c, os.X_OK)
            and _version_ok([c, "version", "--client", "-o", "json"], r'"minor":\s*"(\d+)', KUBECTL_MIN_MINOR)
        ):
            return c
    missing(f"kubectl 1.{KUBECTL_MIN_MINOR}+")


def redis7_server() -> str:
    """A redis-server 7+ (RLHF_REDIS7_SERVER, deploy/k8s/.tools/bin/redis-server or the PATH's)."""
    for c in (os.environ.get("RLHF_REDIS7_SERVER"), str(TOOLS_BIN / "redis-server"), shutil.which("redis-server")):
        if c and os.access(c, os.X_OK) and _version_ok([c, "--version"], r"v=(\d+)\.", 7):
            return c
    missing("redis-server 7+ (Debian's redis-tools)")


def kubernetes_validate_version() -> str:
    try:
        from kubernetes_validate.version import __version__
    except ImportError:
        missing("kubernetes-validate (PyPI)")
    return __version__


def make_tree(dest: Path, secrets: dict | None = SECRETS) -> Path:
    """A copy of deploy/k8s with base/secrets.env written (unless `secrets` is None) and one overlay
    per variant: the overlay's own kustomization plus the variant's components (what a user does
    by uncommenting the `components:` lines)."""
    tree = dest / "k8s"
    shutil.copytree(K8S, tree, ignore=shutil.ignore_patterns(".tools", "secrets.env"))
    if secrets is not None:
        (tree / "base" / "secrets.env").write_text("".join(f"{k}={v}\n" for k, v in secrets.items()))
    for variant in VARIANTS:
        overlay, *components = variant.split("+")
        if not components:
            continue
        target = tree / "overlays" / variant
        shutil.copytree(tree / "overlays" / overlay, target)
        with open(target / "kustomization.yaml", "a") as f:
            f.write("\ncomponents:\n" + "".join(f"  - ../../components/{c}\n" for c in components))
    return tree


def render(tree: Path, variant: str) -> str:
    """`kubectl kustomize` of a variant's overlay directory: the YAML stream `kubectl apply -k`
    would send."""
    p = subprocess.run(
        [kubectl(), "kustomize", str(tree / "overlays" / variant)], capture_output=True, text=True, timeout=120
    )
    assert p.returncode == 0, f"kubectl kustomize overlays/{variant} failed:\n{p.stderr}"
    return p.stdout


def load_docs(text: str) -> list[dict]:
    return [d for d in yaml.safe_load_all(text) if d]


# ------------------------------------------------------------------ reading rendered objects
WORKLOAD_KINDS = ("Deployment", "StatefulSet", "Job", "DaemonSet")


def find(docs, kind, name=None) -> list[dict]:
    return [d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]


def one(docs, kind, name) -> dict:
    found = find(docs, kind, name)
    assert len(found) == 1, f"expected one {kind}/{name}, found {len(found)}"
    return found[0]


def generated(docs, kind, base_name) -> dict:
    """A generated ConfigMap/Secret by its name before kustomize's hash suffix."""
    found = [
        d
        for d in docs
        if d["kind"] == kind and re.fullmatch(re.escape(base_name) + r"(-[a-z0-9]{10})?", d["metadata"]["name"])
    ]
    assert len(found) == 1, f"expected one generated {kind} {base_name}, found {[d['metadata']['name'] for d in found]}"
    return found[0]


def workloads(docs) -> list[dict]:
    return [d for d in docs if d["kind"] in WORKLOAD_KINDS]


def pod_spec(workload) -> dict:
    return workload["spec"]["template"]["spec"]


def containers(workload, init: bool = True) -> list[dict]:
    spec = pod_spec(workload)
    return (spec.get("initContainers", []) if init else []) + spec["containers"]


def component(obj) -> str:
    return obj["metadata"]["labels"]["app.kubernetes.io/component"]


def data_of(obj) -> dict:
    """A ConfigMap's data, or a Secret's decoded data."""
    if obj["kind"] == "Secret":
        return {k: base64.b64decode(v).decode() for k, v in obj.get("data", {}).items()} | obj.get("stringData", {})
    return dict(obj.get("data", {}))


def expand(text: str, env: dict) -> str:
    """Kubernetes' expansion of command, args and env values: $(NAME) becomes the variable's value
    when NAME is defined, `$$` is a literal `$`, anything else stays as written."""
    out, i = [], 0
    while i < len(text):
        if text.startswith("$$", i):
            out.append("$")
            i += 2
        elif text.startswith("$(", i):
            end = text.find(")", i + 2)
            name = text[i + 2 : end] if end != -1 else None
            if name is not None and name in env:
                out.append(env[name])
                i = end + 1
            else:
                out.append("$(")
                i += 2
        else:
            out.append(text[i])
            i += 1
    return "".join(out)


def _quantity_cores(q) -> float:
    q = str(q)
    return int(q[:-1]) / 1000 if q.endswith("m") else float(q)


def container_env(container: dict, workload: dict, docs) -> dict:
    """The environment Kubernetes gives `container` (envFrom first, then env in order, each value
    expanded against the variables before it), with a made-up pod IP."""
    env: dict[str, str] = {}
    for src in container.get("envFrom", []):
        if "configMapRef" in src:
            env.update(data_of(one(docs, "ConfigMap", src["configMapRef"]["name"])))
        if "secretRef" in src:
            env.update(data_of(one(docs, "Secret", src["secretRef"]["name"])))
    meta = workload["metadata"]
    for var in container.get("env", []):
        if "value" in var:
            env[var["name"]] = expand(var["value"], env)
            continue
        ref = var["valueFrom"]
        if "fieldRef" in ref:
            env[var["name"]] = {
                "status.podIP": FAKE_POD_IP,
                "metadata.name": f"{meta['name']}-0",
                "metadata.namespace": meta.get("namespace", "default"),
            }[ref["fieldRef"]["fieldPath"]]
        elif "secretKeyRef" in ref:
            env[var["name"]] = data_of(one(docs, "Secret", ref["secretKeyRef"]["name"]))[ref["secretKeyRef"]["key"]]
        elif "configMapKeyRef" in ref:
            k = ref["configMapKeyRef"]
            env[var["name"]] = data_of(one(docs, "ConfigMap", k["name"]))[k["key"]]
        elif "resourceFieldRef" in ref:
            r = ref["resourceFieldRef"]
            kind, res = r["resource"].split(".")
            value = container["resources"][kind][res]
            env[var["name"]] = str(math.ceil(_quantity_cores(value) / _quantity_cores(r.get("divisor", "1"))))
        else:
            raise AssertionError(f"unknown valueFrom in {container['name']}: {ref}")
    return env


_SHELL_OPS = {";", "&&", "||", "|", "&", "then", "else", "do", "{", "}", "(", ")"}


def rlhf_command_lines(container: dict, env: dict) -> list[list[str]]:
    """The rlhf command lines a container runs: its args after the image's entrypoint `rlhf`, or
    each `rlhf ...` line of a `sh -c` script (shell variables stay as written)."""
    command = [expand(c, env) for c in container.get("command", [])]
    args = [expand(a, env) for a in container.get("args", [])]
    if not command:
        return [["rlhf", *args]]
    assert command[:2] == ["sh", "-c"], f"{container['name']}: command {command} is neither the entrypoint nor sh -c"
    script = " ".join(command[2:] + args[:1])
    lines = []
    for line in script.splitlines():
        lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|(){}")
        lexer.whitespace_split = True
        words = list(lexer)
        for i, w in enumerate(words):
            if w == "rlhf" and (i == 0 or words[i - 1] in _SHELL_OPS | {"exec"}):
                end = next((j for j in range(i + 1, len(words)) if words[j] in _SHELL_OPS), len(words))
                lines.append(words[i:end])
    return lines


def mounted_file(path: str, container: dict, workload: dict, docs) -> str | None:
    """The content of `path` when it lies in a ConfigMap mounted into the container, else None."""
    volumes = {v["name"]: v for v in pod_spec(workload).get("volumes", [])}
    for m in container.get("volumeMounts", []):
        prefix = m["mountPath"].rstrip("/") + "/"
        vol = volumes.get(m["name"], {})
        if path.startswith(prefix) and "configMap" in vol:
            return data_of(one(docs, "ConfigMap", vol["configMap"]["name"])).get(path[len(prefix) :])
    return None


class _Capture:
    """What the in-process CLI prints, read and reset like pytest's capsys."""

    def __init__(self):
        self.out, self.err = io.StringIO(), io.StringIO()

    def readouterr(self):
        out, err = self.out.getvalue(), self.err.getvalue()
        for s in (self.out, self.err):
            s.seek(0)
            s.truncate()
        return types.SimpleNamespace(out=out, err=err)


class Resolved:
    """One rlhf command line of a rendered container, read as the `rlhf` CLI reads it: `argv`, the
    parsed `args`, and for `serve` the config the service would run with (`cfg`, loaded by the CLI's
    own `_load` from the mounted ConfigMap file, $RLHF_SET and --set) and what `rlhf config validate`
    printed for the same file and overrides (`validated`)."""

    def __init__(self, workload, container, env, argv, args, cfg=None, validated=None):
        self.workload, self.container, self.env, self.argv = workload, container, env, argv
        self.args, self.cfg, self.validated = args, cfg, validated


def resolve(workload: dict, container: dict, docs, tmp_path: Path) -> list[Resolved]:
    """Every rlhf command line of `container` (see Resolved), under exactly the container's RLHF_*
    environment."""
    import services.cli as cli
    from services.common.config import dump_config

    env = container_env(container, workload, docs)
    out = []
    capsys = _Capture()
    with (
        pytest.MonkeyPatch.context() as mp,
        contextlib.redirect_stdout(capsys.out),
        contextlib.redirect_stderr(capsys.err),
    ):
        for k in [k for k in os.environ if k.startswith("RLHF_") and k not in env]:
            mp.delenv(k)
        for k, v in env.items():
            mp.setenv(k, v)
        for argv in rlhf_command_lines(container, env):
            assert argv[0] == "rlhf"
            try:
                args = cli.build_parser().parse_args(argv[1:])  # $RLHF_CONFIG is the default of -c
            except SystemExit:
                raise AssertionError(f"rlhf refuses {argv}: {capsys.readouterr().err}") from None
            if args.command != "serve":
                out.append(Resolved(workload, container, env, argv, args))
                continue
            text = mounted_file(args.config, container, workload, docs)
            assert text is not None, f"{container['name']}: config {args.config} is in no mounted ConfigMap"
            local = tmp_path / f"{workload['metadata']['name']}-{container['name']}-{Path(args.config).name}"
            local.write_text(text)
            args.config = str(local)
            capsys.readouterr()
            try:
                cfg = cli._load(args, data=args.service == "learner")
                # each flag is a shorthand for one --set: `config validate` with them as --set agrees
                sets = [*args.overrides, *(f"{k}={json.dumps(v)}" for k, v in cli.flag_overrides(args))]
                rc = cli.main(["config", "validate", str(local), *[a for o in sets for a in ("--set", o)]])
            except SystemExit as e:
                raise AssertionError(f"{argv}: config rejected (exit {e.code}):\n{capsys.readouterr().err}") from None
            printed = capsys.readouterr().out
            assert rc == 0 and printed == dump_config(cfg)
            assert cli._flag_problem(args) is None
            out.append(Resolved(workload, container, env, argv, args, cfg, yaml.safe_load(printed)))
    return out


def selects(selector: dict, labels: dict) -> bool:
    """A LabelSelector (matchLabels and matchExpressions) or a Service's plain selector."""
    match = selector.get("matchLabels", selector if "matchExpressions" not in selector else {})
    if any(labels.get(k) != v for k, v in match.items()):
        return False
    for e in selector.get("matchExpressions", []):
        have = e["key"] in labels
        if e["operator"] == "In" and not (have and labels[e["key"]] in e["values"]):
            return False
        if e["operator"] == "NotIn" and have and labels[e["key"]] in e["values"]:
            return False
        if e["operator"] == "Exists" and not have:
            return False
        if e["operator"] == "DoesNotExist" and have:
            return False
    return True
