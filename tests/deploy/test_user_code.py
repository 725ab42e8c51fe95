"""Your reward function and prompts on the cluster (deploy/k8s/overlays/my-code): the files go into
the rlhf-config ConfigMap that every service mounts at /etc/rlhf, the config there names them by
that path, and what the cluster would run validates."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from . import manifests as m

ROOT = Path(__file__).resolve().parents[2]
FILES = ("my_reward.py", "my-run.yaml", "my-prompts.jsonl")


def test_the_my_code_overlay_ships_your_files_to_every_service(k8s_tree, tmp_path):
    docs = m.load_docs(m.render(k8s_tree, "my-code"))
    config = next(d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"].startswith("rlhf-config"))
    source = ROOT / "deploy" / "k8s" / "overlays" / "my-code"
    for name in FILES:  # as they are in the repository, beside the presets
        assert config["data"][name] == (source / name).read_text()
    assert "tiny-cpu.yaml" in config["data"]
    env = next(d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"].startswith("rlhf-env"))
    assert env["data"]["RLHF_CONFIG"] == "/etc/rlhf/my-run.yaml"
    workloads = [
        d
        for d in docs
        if d["kind"] in ("Deployment", "StatefulSet")
        and d["metadata"].get("labels", {}).get("app.kubernetes.io/component")
        in ("generation", "reward", "critic", "learner", "rollout")
    ]
    assert len(workloads) == 5
    for w in workloads:
        spec = w["spec"]["template"]["spec"]
        volume = next(
            v["name"] for v in spec["volumes"] if v.get("configMap", {}).get("name") == config["metadata"]["name"]
        )
        mounts = [vm for c in spec["containers"] for vm in c.get("volumeMounts", []) if vm["name"] == volume]
        assert [vm["mountPath"] for vm in mounts] == ["/etc/rlhf"], w["metadata"]["name"]

    # what the pods would see at /etc/rlhf, here: the config validates, the function imports
    etc = tmp_path / "etc-rlhf"
    etc.mkdir()
    for name, text in config["data"].items():
        (etc / name).write_text(text.replace("/etc/rlhf/", f"{etc}/"))
    r = subprocess.run(
        [sys.executable, "-m", "services.cli", "config", "validate", str(etc / "my-run.yaml")],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stderr
    assert f"{etc}/my_reward.py:score" in r.stdout
