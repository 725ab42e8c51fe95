"""verifiers environments (the `verifiers` package, prime-rl's environments: `pip install
'.[verifiers]'`): an `Environment` with a dataset, a rollout over an OpenAI-compatible client and a
`Rubric` of reward functions, as a run's environment and prompts.

    rollout.environment: "verifiers:REF[?KEY=VALUE&...]"
        REF   path/to/env.py:load_environment   a factory in a file, or module:factory, that returns
                                                a vf.Environment (called with the options)
              ENV_ID                            an installed environment package (its module's
                                                load_environment, as verifiers.load_environment)
        KEY=VALUE                               the factory's keyword arguments, each value read as YAML
    data.train: verifiers                       the environment's dataset as the prompts
    data.eval: verifiers                        (or unset) its eval_dataset, else a held-out split

Each dataset row becomes a PromptRecord: the row's chat prompt rendered through the tokenizer's
chat template (what `prompt_length` and the held-out split read), its `answer` as label, and the
whole row, JSON as the replay buffer keeps it, in metadata["verifiers"]: what the rollout is
given back (agents/verifiers_env.py runs it against a session's endpoint and scores it with the
rubric). The environment is built once per process and reference (`load_env`); verifiers'
Environment would install SIGINT/SIGTERM handlers of its own when built, and the run's stay.
"""

from __future__ import annotations

import contextlib
import json
import logging
import signal
import threading
import types
from typing import Any, TypeGuard

import yaml

log = logging.getLogger(__name__)

PREFIX = "verifiers:"  # rollout.environment
SOURCE = "verifiers"  # data.train / data.eval: the environment's own dataset
METADATA_KEY = "verifiers"  # a record's dataset row
INSTALL = "pip install '.[verifiers]'"

_lock = threading.Lock()
_envs: dict[str, Any] = {}


def is_env_ref(ref: object) -> TypeGuard[str]:
    """Whether a `rollout.environment` names a verifiers environment."""
    return isinstance(ref, str) and ref.startswith(PREFIX)


def parse_ref(ref: str) -> tuple[str, dict]:
    """`verifiers:TARGET[?KEY=VALUE&...]` -> (TARGET, its keyword arguments, each value read as
    YAML); ValueError saying what is wrong with it."""
    target, _, query = ref[len(PREFIX) :].partition("?")
    if not target:
        raise ValueError(
            f"{ref!r} names no environment: give verifiers:path/to/env.py:load_environment, "
            "verifiers:module:factory or verifiers:ENV_ID (an installed environment package)"
        )
    kwargs: dict = {}
    for part in filter(None, query.split("&")):
        key, eq, raw = part.partition("=")
        if not eq or not key:
            raise ValueError(f"{ref!r}: option {part!r} is not KEY=VALUE")
        try:
            kwargs[key] = yaml.safe_load(raw)
        except yaml.YAMLError:
            raise ValueError(f"{ref!r}: the value of {key} is not YAML: {raw!r}") from None
    return target, kwargs


def ref_problem(ref: str) -> str | None:
    """Why `ref` is no verifiers reference, by its syntax alone (what a config load checks; whether
    it loads is `load_env`'s, which the pre-flight checks run); None when it is one."""
    try:
        parse_ref(ref)
    except ValueError as e:
        return str(e)
    return None


def load_env(ref: str):
    """The verifiers Environment `ref` names, built once in this process (later calls give the same
    one); ValueError saying why not (the package missing, the factory not loading or raising, not a
    vf.Environment, or one this project cannot train on: `env_problem`)."""
    with _lock:
        if ref in _envs:
            return _envs[ref]
        target, kwargs = parse_ref(ref)
        try:
            import verifiers as vf
        except ImportError:
            raise ValueError(f"{ref!r}: the verifiers package is not installed ({INSTALL})") from None
        with _keeping_signal_handlers():
            env = _build(vf, ref, target, kwargs)
        problem = env_problem(env)
        if problem:
            raise ValueError(f"{ref!r}: {problem}")
        _envs[ref] = env
        return env


def _build(vf, ref: str, target: str, kwargs: dict):
    from ..common.userfn import load_function

    try:
        if ":" in target:
            env = load_function(target)(**kwargs)
        else:  # an installed environment package (`vf-install`, `prime env install`)
            env = vf.load_environment(target, **kwargs)
    except ValueError as e:
        raise ValueError(str(e)) from None  # load_function's own words, or load_environment's
    except Exception as e:
        raise ValueError(f"{ref!r}: building the environment raised {type(e).__name__}: {e}") from None
    return env


def env_problem(env) -> str | None:
    """Why this project cannot train on `env`, or None: it must be a classic vf.Environment (the
    `verifiers.v1` Taskset/Harness stack is another protocol) whose rubric scores each rollout on
    its own (a group reward function needs a group's rollouts scored together) and that scores at
    all (`score_rollouts`)."""
    import verifiers as vf

    if not isinstance(env, vf.Environment):
        return f"the factory returned {type(env).__name__}, not a verifiers Environment (vf.Environment)"
    if not getattr(env, "score_rollouts", True):
        return "the environment does not score its rollouts (score_rollouts=False): there would be no reward"
    if env.rubric.has_group_rewards:
        grouped = [getattr(f, "__name__", repr(f)) for r in _rubrics(env.rubric) for f in r._get_group_reward_funcs()]
        return (
            f"its rubric has group reward functions ({', '.join(grouped)}), which score a group's rollouts "
            "together; each session here is scored on its own: give reward functions of one rollout"
        )
    return None


def _rubrics(rubric) -> list:
    """A rubric and those it groups (a RubricGroup's, as MultiTurnEnv's own monitor), depth first."""
    return [rubric, *(r for inner in getattr(rubric, "rubrics", []) for r in _rubrics(inner))]


@contextlib.contextmanager
def _keeping_signal_handlers():
    """verifiers' Environment.__post_init__ installs SIGINT and SIGTERM handlers (SIGTERM: exit(143))
    when an environment is built; the run's own handlers (a graceful stop) stay: its module's
    `signal.signal` does nothing meanwhile (and so raises no ValueError off the main thread)."""
    import verifiers.legacy.envs.environment as module

    real = getattr(module, "signal", None)
    if real is not signal:
        yield
        return
    module.signal = types.SimpleNamespace(  # type: ignore[attr-defined]
        signal=lambda *args, **kwargs: None,
        SIGINT=signal.SIGINT,
        SIGTERM=signal.SIGTERM,
        default_int_handler=signal.default_int_handler,
    )
    try:
        yield
    finally:
        module.signal = real  # type: ignore[attr-defined]


# ------------------------------------------------------------------ the dataset as prompts
def records(env, which: str, tokenizer, limit: int | None = None) -> list[dict] | None:
    """The rows of `env`'s dataset (`which` "train") or eval_dataset ("eval"; None when it has
    none), the first `limit` of them, as the fields of prompt records (training/data.py makes them):
    `prompt`, the chat prompt rendered through the tokenizer's chat template (a string prompt as it
    is); `label`, the answer (none when empty); `metadata`, the row as JSON under "verifiers"; `id`,
    `<env_id or 'verifiers'>[-eval]-<example_id>`."""
    dataset = env.get_dataset() if which == "train" else env.build_eval_dataset()
    if dataset is None:
        return None
    if limit is not None:
        dataset = dataset.select(range(min(limit, len(dataset))))
    name = (env.env_id or "verifiers").replace("/", "-") + ("-eval" if which == "eval" else "")
    out = []
    for i, row in enumerate(dataset.to_list()):
        where = f"the environment's {'eval_' if which == 'eval' else ''}dataset, row {i}"
        try:
            carried = json.loads(json.dumps(row))
        except (TypeError, ValueError) as e:
            raise ValueError(f"{where}: not JSON ({e}); the replay buffer carries a prompt's row as JSON") from None
        answer = row.get("answer")
        out.append(
            {
                "id": f"{name}-{row.get('example_id', i)}",
                "prompt": _rendered(row.get("prompt"), tokenizer, where),
                "label": None if answer in (None, "") else (answer if isinstance(answer, str) else json.dumps(answer)),
                "metadata": {METADATA_KEY: carried},
            }
        )
    return out


def _rendered(prompt, tokenizer, where: str) -> str:
    if isinstance(prompt, str):
        return prompt
    if not isinstance(prompt, list) or not prompt:
        raise ValueError(f"{where}: its prompt is {type(prompt).__name__}, not chat messages")
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"{where}: chat messages need a tokenizer with a chat template to render them")
    messages = [{k: v for k, v in m.items() if v is not None} for m in prompt]  # Arrow fills absent keys with None
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def rollout_input(record) -> dict:
    """What the environment's rollout is given for a prompt: its dataset row (metadata["verifiers"]),
    or, for a prompt of another source, one made of it as verifiers makes a row of a question: the
    prompt as the user's message, the label as answer, the metadata as info."""
    row = record.metadata.get(METADATA_KEY)
    if isinstance(row, dict):
        return dict(row)
    return {
        "prompt": [{"role": "user", "content": record.prompt}],
        "answer": record.label or "",
        "info": dict(record.metadata),
        "example_id": record.id,
    }
