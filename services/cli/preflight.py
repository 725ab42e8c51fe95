"""The checks a command runs before it starts work, so that one run of `rlhf config validate` (or
of `train`, `up`) reports every mistake it can find, each naming its key:

    data sources     data.train / data.eval exist; a JSON lines file's every line is a record
                     with a prompt, and a label when the reward reads one
                     (training/data.py:data_source_errors)
    trackers         W&B installed when asked for (training/tracking.py:tracking_errors)
    reward           rule names, your functions' files, modules and signatures, rule kwargs;
                     the reward model's path, the reward API's URL (reward_errors)
    agent            rollout.agent loads and takes (client, sample) (agent_errors)
    sampler          the generation backend is installed here (backend_errors): the commands that
                     sample in this process (`train --local`, `up`, `make-prefs`); `config validate`
                     says it as a note, since a config is often checked away from where it runs
    validate         `config validate` also checks the model (model.path holds one here, or is a
                     hub id: model_findings) and the reward model's pairs when reward_model.train
                     is set (reward_model_errors)

A config that does not validate gets what can still be checked of its raw keys (raw_errors).
"""

from __future__ import annotations

import difflib
import importlib.util
import json
from pathlib import Path
from urllib.parse import urlparse

from ..agents.host import load_agent
from ..common.config import Config, RewardConfig, RuleSpec
from ..common.model_files import build_hint
from ..common.reasoning_gym_tasks import is_task_source
from ..common.reasoning_gym_tasks import source_problem as task_source_problem
from ..reward.functions import rule_errors
from ..reward.labels import label_reader
from ..reward.rules import RULES
from ..training.data import data_source_errors, first_problems, is_jsonl, source_problem
from ..training.sources.jsonl import jsonl_rows
from ..training.tracking import tracking_errors


def preflight_errors(cfg: Config, sampler: bool = True, validate: bool = False, judge: bool = False) -> list[str]:
    """Every problem of a valid config that shows before the run starts; `sampler`: this process
    samples (the generation backend must be installed here); `validate`: `config validate`'s
    checks too (the model, the reward model's pairs); `judge`: the command scores with the judge
    alone (`make-prefs`: reward.eval_rules when set), so the training reward, often the reward
    model that its pairs will train, need not exist yet."""
    judged_apart = judge and cfg.reward.eval_rules is not None
    return (
        (model_findings(cfg)[0] if validate else [])
        + (context_errors(cfg) if not validate else [])  # `config validate` notes it (a preset of another model)
        + tokenizer_errors(cfg)
        + data_source_errors(cfg, label_reader(cfg))
        + (reward_model_errors(cfg) if validate else [])
        + tracking_errors(cfg)
        + (
            rule_errors(cfg.reward.eval_rules, RULES, "reward.eval_rules")
            if judged_apart
            else reward_errors(cfg.reward)
        )
        + agent_errors(cfg)
        + (backend_errors(cfg) if sampler else [])
    )


def looks_local(path: str) -> bool:
    """`path` names a local directory, not a hub id, as the model loaders tell them apart: an
    absolute or relative path, one that exists, one of more than two parts, or one beside model
    directories here (`runs/tiny-modle` next to `runs/tiny-model` is a mistyped directory, not a
    repository of the hub's "runs")."""
    p = Path(path).expanduser()
    return path.startswith(("/", ".", "~")) or p.exists() or path.count("/") > 1 or bool(models_beside(p))


def models_beside(p: Path) -> list[str]:
    """The model directories (with a config.json) in `p`'s parent directory here, when it has one."""
    parent = p.parent
    if parent == Path(".") or not parent.is_dir():
        return []
    try:
        return sorted(c.name for c in parent.iterdir() if (c / "config.json").is_file())
    except OSError:
        return []


def tokenizer_errors(cfg: Config) -> list[str]:
    """The models that read the policy's tokens must share its tokenizer: the reference (its KL is
    per token), the critic (a value per token), the distillation teacher (a log-prob per token)
    and, when the critic starts from it, the reward model. Each such directory here whose
    vocabulary differs from model.path's is an error (a reference of another vocabulary gave a KL
    of ~10 at every iteration, silently)."""
    readers: dict[str, str | None] = {
        "model.reference_path": cfg.model.reference_path,
        "critic.model_path": cfg.critic.model_path,
    }
    if cfg.critic.init_from_reward_model:
        readers["reward.model_path"] = cfg.reward.model_path
    if cfg.distill.needs_server:  # the teacher scores the policy's token ids
        readers["distill.teacher_path"] = cfg.distill.teacher_path
    readers = {k: v for k, v in readers.items() if v and (Path(v).expanduser() / "config.json").is_file()}
    policy = Path(cfg.model.path).expanduser()
    if not readers or not (policy / "config.json").is_file():
        return []
    from ..common.model_files import load_tokenizer

    try:
        vocab = load_tokenizer(policy).get_vocab()
    except Exception:  # the policy's own loading says what is wrong with it
        return []
    errors = []
    for key, path in readers.items():
        try:
            other = load_tokenizer(Path(str(path)).expanduser()).get_vocab()
        except Exception as e:
            errors.append(f"{key}: its tokenizer does not load ({type(e).__name__}: {e})")
            continue
        if other != vocab:
            errors.append(
                f"{key}: {path}'s tokenizer has {len(other):,} tokens, model.path's {len(vocab):,}"
                + (" (the same number, other ids)" if len(other) == len(vocab) else "")
                + f"; it reads the policy's tokens, so it must share model.path's tokenizer ({cfg.model.path})"
            )
    return errors


# what a model's config calls the most positions it takes, by architecture
CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length")


def context_errors(cfg: Config) -> list[str]:
    """prompt_length + response_length against the most positions the model takes (its
    config.json, when model.path is a directory here): a longer conversation runs past what the
    model was built for (positions it never saw), silently."""
    config = Path(cfg.model.path).expanduser() / "config.json"
    if not config.is_file():
        return []
    try:
        known = json.loads(config.read_text())
    except ValueError:
        return []  # the model's own loader says what is wrong with it
    limit = next((known[k] for k in CONTEXT_KEYS if isinstance(known.get(k), int)), None)
    need = cfg.prompt_length + cfg.response_length
    if limit is None or need <= limit:
        return []
    return [
        f"prompt_length + response_length = {cfg.prompt_length} + {cfg.response_length} = {need} tokens, more than "
        f"the model takes ({limit} positions, its config.json); lower them to fit (a run refuses to start)"
    ]


def model_findings(cfg: Config) -> tuple[list[str], list[str]]:
    """(errors, notes) of model.path here: a local directory must hold a model (config.json); a hub
    id not in the Hugging Face cache is an error offline (HF_HUB_OFFLINE), else a note (a run
    downloads it). A path under a top directory this machine lacks (a container's volume such as
    /runs) is a note: it is checked where the config runs."""
    path = cfg.model.path
    p = Path(path).expanduser()
    if (p / "config.json").exists():
        return [], []
    if not looks_local(path):
        return _hub_model_findings(path)
    top = Path(*p.parts[:2])
    if p.is_absolute() and not top.exists():
        return [], [f"model.path: {p} is not on this machine (no {top} here); it is checked where the run starts"]
    beside = models_beside(p) if not p.exists() else []
    if beside:  # a mistyped directory next to real ones (the loader would look for it on the hub)
        near = difflib.get_close_matches(p.name, beside, n=1)
        hint = f"did you mean {p.parent / near[0]}? " if near else ""
        return [
            f"model.path: no model at {path} (the directory does not exist); {hint}{build_hint(path)}, or set "
            "model.path to a model directory"
        ], []
    from ..common.model_files import check_model_dir

    try:
        check_model_dir(path)
    except FileNotFoundError as e:
        return [f"model.path: {e}"], []
    return [], []


def _hub_model_findings(repo_id: str) -> tuple[list[str], list[str]]:
    from huggingface_hub import constants, try_to_load_from_cache

    try:
        cached = try_to_load_from_cache(repo_id, "config.json")
    except ValueError:  # not a valid hub id either
        return [f"model.path: {repo_id!r} is no model directory here and no hub id (org/name)"], []
    if isinstance(cached, str):
        return [], []
    if constants.HF_HUB_OFFLINE:
        return [
            f"model.path: {repo_id} is no directory here and not in the Hugging Face cache, and HF_HUB_OFFLINE "
            f"is set; download it first, {build_hint(repo_id)}, or set model.path to a model directory"
        ], []
    return [], [
        f"model.path: {repo_id} is no directory here, so a run downloads it from the Hugging Face hub; if it is "
        f"meant as a directory, {build_hint(repo_id)}"
    ]


def reward_model_errors(cfg: Config) -> list[str]:
    """The reward model's pairs (reward_model.train, .eval) when the section is in use (its train is
    set): they exist, and a JSON lines file's every line is a JSON object."""
    rm = cfg.reward_model
    if rm.train is None:
        return []
    errors = []
    for key in ("train", "eval"):
        source = getattr(rm, key)
        problem = source_problem(source) if source is not None else None
        if problem:
            made = f"; `rlhf make-prefs -c CONFIG --out {source}` writes pairs of the policy's samples"
            made = made if is_jsonl(source) else ""
            errors.append(f"reward_model.{key}: {problem}{made}")
        elif source is not None and is_jsonl(source):
            errors += [f"reward_model.{key}: {p}" for p in first_problems(jsonl_rows(source)[1])]
    return errors


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
        if local:
            errors += served_reward_model_errors(p)
    if rc.type == "http" and not rc.http_url:
        errors.append("reward.http_url: not set; reward.type http needs your reward API's URL")
    if rc.type in ("http", "combined") and rc.http_url:
        url = urlparse(rc.http_url)
        if url.scheme not in ("http", "https") or not url.netloc:
            errors.append(f"reward.http_url: {rc.http_url!r} is not an http:// or https:// URL")
    if rc.type == "combined" and not (rc.rules or rc.model_path or rc.http_url):
        errors.append("reward.type: combined needs at least one of reward.rules, reward.model_path, reward.http_url")
    return errors


def served_reward_model_errors(path: Path) -> list[str]:
    """What keeps reward.model_path from being served: a reward model directory, or an ensemble
    whose every member is one (with the reward_stats.json its normalisation needs)."""
    from ..common.reward_model_dir import is_ensemble, members

    try:
        dirs = members(path)
    except ValueError as e:
        return [f"reward.model_path: {e}"]
    errors = [
        f"reward.model_path: no reward model at {d} (config.json missing); `rlhf train-rm -c CONFIG --out {d}` "
        "trains one on preference pairs (reward_model.train)"
        for d in dirs
        if not (d / "config.json").exists()
    ]
    if is_ensemble(path):
        errors += [
            f"reward.model_path: ensemble member {d} has no reward_stats.json (each member is normalised)"
            for d in dirs
            if (d / "config.json").exists() and not (d / "reward_stats.json").exists()
        ]
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
        if is_task_source(source) and task_source_problem(source, need_package=False):
            continue  # the config's validation said it (common/config_sections/training.py: DataConfig)
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
