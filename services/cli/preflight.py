"""The checks a command runs before it starts work, so that one run of `rlhf config validate` (or
of `train`, `up`) reports every mistake it can find, each naming its key:

    data sources     data.train / data.eval exist (training/data.py:data_source_errors)
    trackers         W&B installed when asked for (training/tracking.py:tracking_errors)
    reward           rule names, your functions' files, modules and signatures, rule kwargs;
                     the reward model's path, the reward API's URL (reward_errors)
    agent            rollout.agent loads and takes (client, sample) (agent_errors)
    sampler          the generation backend is installed here (backend_errors): the commands that
                     sample in this process (`train --local`, `up`, `make-prefs`); `config validate`
                     says it as a note, since a config is often checked away from where it runs

A config that does not validate gets what can still be checked of its raw keys (raw_errors).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from urllib.parse import urlparse

from ..common.config import Config, RewardConfig, RuleSpec
from ..gateway.agents import load_agent
from ..reward.functions import rule_errors
from ..reward.rules import RULES
from ..training.data import data_source_errors, source_problem
from ..training.tracking import tracking_errors


def preflight_errors(cfg: Config, sampler: bool = True) -> list[str]:
    """Every problem of a valid config that shows before the run starts; `sampler`: this process
    samples (the generation backend must be installed here)."""
    return (
        data_source_errors(cfg)
        + tracking_errors(cfg)
        + reward_errors(cfg.reward)
        + agent_errors(cfg)
        + (backend_errors(cfg) if sampler else [])
    )


def agent_errors(cfg: Config) -> list[str]:
    """`rollout.agent` / `rollout.environment` / `rollout.agent_url` loads (and an agent takes
    (client, sample))."""
    key = cfg.rollout.agent_kind
    if key is None:
        return []
    try:
        load_agent(cfg.rollout)
    except ValueError as e:
        return [f"rollout.{key}: {e}"]
    return []


def reward_errors(rc: RewardConfig) -> list[str]:
    errors = []
    if rc.type in ("rules", "combined"):
        errors += rule_errors(rc.rules, RULES, "reward.rules")
    if rc.eval_rules is not None:
        errors += rule_errors(rc.eval_rules, RULES, "reward.eval_rules")
    if rc.type == "model" and not rc.model_path:
        errors.append(
            "reward.model_path: not set; reward.type model needs a reward model directory (`rlhf train-rm` writes one)"
        )
    if rc.type in ("model", "combined") and rc.model_path:
        p = Path(rc.model_path).expanduser()
        local = rc.model_path.startswith(("/", ".", "~")) or p.exists() or rc.model_path.count("/") > 1
        if local and not (p / "config.json").exists():
            errors.append(f"reward.model_path: no reward model at {p} (config.json missing)")
    if rc.type == "http" and not rc.http_url:
        errors.append("reward.http_url: not set; reward.type http needs your reward API's URL")
    if rc.type in ("http", "combined") and rc.http_url:
        url = urlparse(rc.http_url)
        if url.scheme not in ("http", "https") or not url.netloc:
            errors.append(f"reward.http_url: {rc.http_url!r} is not an http:// or https:// URL")
    if rc.type == "combined" and not (rc.rules or rc.model_path or rc.http_url):
        errors.append("reward.type: combined needs at least one of reward.rules, reward.model_path, reward.http_url")
    return errors


def backend_errors(cfg: Config) -> list[str]:
    if cfg.generation.backend == "vllm" and importlib.util.find_spec("vllm") is None:
        return [
            "generation.backend: vllm is not installed in this Python (`pip install vllm` on a GPU box; "
            "its CPU build: `make vllm-venv`); or use backend hf"
        ]
    return []


def raw_errors(data: dict) -> list[str]:
    """What can be checked of a config that does not validate: its data sources and rule names."""
    errors = []
    section = data.get("data")
    if not isinstance(section, dict):
        section = {}
    for key in ("train", "eval"):
        source = section.get(key)
        problem = source_problem(source) if isinstance(source, str) else None
        if problem:
            errors.append(f"data.{key}: {problem}")
    reward = data.get("reward")
    if not isinstance(reward, dict):
        reward = {}
    for key in ("rules", "eval_rules"):
        rules = reward.get(key)
        if not isinstance(rules, list):
            continue
        for i, r in enumerate(rules):
            name = r.get("name") if isinstance(r, dict) else None
            kwargs = r.get("kwargs") or {} if isinstance(r, dict) else {}
            if isinstance(name, str) and isinstance(kwargs, dict):
                errors += [
                    e.replace("reward.rules[0].", f"reward.{key}[{i}].")
                    for e in rule_errors([RuleSpec.model_construct(name=name, kwargs=kwargs)], RULES)
                ]
    return errors
