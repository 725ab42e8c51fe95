"""What every `rlhf` command shares: the one-line user error, the -c/--set arguments, the config as
the file, $RLHF_SET, --set and the flags make it (validated, with the pre-flight checks), and the
checks more than one command makes before it starts (a run directory, a server's secret)."""

from __future__ import annotations

import argparse
import logging
import os
import shlex
import sys
from pathlib import Path

from ..common.config import ConfigError, blame_overrides, config_data, config_from_dict
from .preflight import preflight_errors, raw_errors

EXIT_CONFIG = 2
# what a user's machine or config causes (a port in use, an unwritable directory, a missing model
# or data file): one `error:` line and EXIT_CONFIG (its traceback with -v); anything else is a bug
# and keeps its traceback
USER_ERRORS = (OSError, ValueError)

log = logging.getLogger("rlhf")


def error(e) -> int:
    """Print `error: ...` (one line) and return EXIT_CONFIG."""
    if isinstance(e, BaseException):
        log.debug("the error's traceback", exc_info=e)
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    print(f"error: {'; '.join(lines)}", file=sys.stderr)
    return EXIT_CONFIG


def add_set_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config key (dotted path for sections), repeatable",
    )


def add_config_args(p: argparse.ArgumentParser, required: bool = True) -> None:
    """-c/--config and --set. The config is not required of argparse (its usage would show `-c` as
    a must although $RLHF_CONFIG gives it): `load_config` says, in one line, when neither does."""
    p.add_argument(
        "-c",
        "--config",
        default=os.environ.get("RLHF_CONFIG"),
        help="YAML config file (default $RLHF_CONFIG): a path, or a file name looked up in the "
        "directories of $RLHF_CONFIG_PATH",
    )
    p.set_defaults(config_required=required)
    add_set_args(p)


# the epilog of `rlhf train` and `rlhf up`
RESUME_HELP = """resume and branch:
  the same command with the same --run-dir goes on from the run's newest checkpoint
  (checkpoints/iter_N, every run.checkpoint_interval iterations); its metrics rows continue.
  A finished run goes on when run.iterations is raised.
  --set run.resume_from=RUN/checkpoints/iter_N   go on from that checkpoint (train --local)
  --set model.path=RUN/final --set model.reference_path=SFT_MODEL
                                                 a new run from an earlier run's policy, with
                                                 the original model kept as the KL reference
"""


def load_config(args, data: bool = False, sampler: bool = False, validate: bool = False, judge: bool = False):
    """The validated config: the file, then $RLHF_SET, then --set, then the flags; with `data`, the
    pre-flight checks too (services/cli/preflight.py: data sources, trackers, the reward, with
    `sampler` the generation backend, with `validate` the model and the reward model's data), every
    error of them in one report. An unknown key or a bad value set on the command line is said as
    its --set (or flag) said it, not as the config file's."""
    if not args.config and getattr(args, "config_required", False):
        sys.exit(error("give a config file: -c FILE (or set $RLHF_CONFIG)"))
    if args.config:
        args.config = find_config(args.config)
    origins: dict[str, str] = {}
    try:
        env = env_overrides()
        origins = override_origins(env, args)
        raw = _blamed(lambda: config_data(args.config, [*env, *args.overrides, *flag_overrides(args)]), origins)
        try:
            cfg = _blamed(lambda: config_from_dict(raw), origins)
        except ConfigError as e:  # the keys that did validate may still hide a missing file or an unknown rule
            e.errors += [err for err in raw_errors(raw) if err not in e.errors] if data else []
            raise
        errors = preflight_errors(cfg, sampler, validate, judge) if data else []
        if errors:
            raise ConfigError(errors)
        return cfg
    except ConfigError as e:
        _config_errors(args.config, e.errors, origins)
        sys.exit(EXIT_CONFIG)


def find_config(name: str, search_path: str | None = None) -> str:
    """`name` itself when it is a file; else the first DIR/name of the directories of
    `search_path` ($RLHF_CONFIG_PATH, colon-separated) that is one: how a container finds a config
    in the user's mounted workspace (/workspace/configs) before the image's copy (/app/configs).
    A name found nowhere is returned as it is (the loader then says it does not exist)."""
    search_path = os.environ.get("RLHF_CONFIG_PATH", "") if search_path is None else search_path
    if Path(name).is_file() or Path(name).is_absolute():
        return name
    for d in filter(None, search_path.split(os.pathsep)):
        candidate = Path(d) / name
        if candidate.is_file():
            return str(candidate)
    return name


def env_overrides() -> list[str]:
    """KEY=VALUE overrides from $RLHF_SET (one per line, or separated by spaces; quoted as in a shell
    where a value holds a space: data.instruction="Think step by step."), applied before the command
    line's --set: how Compose and Kubernetes give every service the same addresses."""
    text = os.environ.get("RLHF_SET", "")
    try:
        return [o for o in shlex.split(text) if o]
    except ValueError as e:  # an unclosed quote
        raise ConfigError(
            [f"$RLHF_SET: {e} in {text!r}; quote a value that holds spaces or quotes as a shell would"]
        ) from None


def override_origins(env: list[str], args) -> dict[str, str]:
    """Each config key set on the command line (or in $RLHF_SET), with how it was set, as an error
    about it says: {"gamma": "--set gamma=3", "run.run_dir": "--run-dir runs/x"}; the last wins."""
    origins = {}
    for label, items in (("$RLHF_SET", env), ("--set", args.overrides)):
        for item in items:
            origins[item.partition("=")[0].strip()] = f"{label} {item}"
    for key, value in flag_overrides(args):
        origins[key] = f"{FLAG_OF_KEY.get(key.rsplit('.', 1)[-1], key)} {value}"
    return origins


# the flag that sets a config key, by the key's last part (flag_overrides)
FLAG_OF_KEY = {
    "run_dir": "--run-dir",
    "out": "--out",
    "eval": "--data",
    "eval_size": "--limit",
    "host": "--host",
    "port": "--port",
    "metrics_port": "--metrics-port",
    "http_port": "--http-port",
    "nproc": "--nproc",
}


def flag_overrides(args) -> list[tuple[str, object]]:
    """The command line's flags as the config keys they set (each flag is a shorthand for one
    `--set`; docs/your-model.md "Setting a value"), applied after $RLHF_SET and --set, before validation."""
    out: list[tuple[str, object]] = []
    if getattr(args, "run_dir", None):
        out.append(("run.run_dir", args.run_dir))
    if getattr(args, "rm_out", None):
        out.append(("reward_model.out", args.rm_out))
    if getattr(args, "eval_data", None):
        out.append(("data.eval", args.eval_data))
    if getattr(args, "eval_limit", None):
        out.append(("data.eval_size", args.eval_limit))
    service = getattr(args, "service", None)
    if service is None:
        return out
    sharded = {"learner": "model.nproc", "critic": "critic.nproc"}.get(service)
    if sharded and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        out.append((sharded, int(os.environ["WORLD_SIZE"])))  # under torchrun
    elif sharded and args.nproc is not None:
        out.append((sharded, args.nproc))
    # a worker binds only its /metrics, at rpc.host; the Tinker API has a section of its own
    section = {"rollout": "rpc", "tinker": "tinker"}.get(service, f"rpc.{service.replace('-', '_')}")
    if args.host:
        out.append((f"{section}.host", args.host))
    ports = {"port": args.port, "metrics_port": args.metrics_port, "http_port": args.http_port}
    for key, value in ports.items():
        if value is not None:
            owner = "rollout" if service == "rollout" else section
            out.append((f"{owner}.{key}", None if value == -1 else value))  # -1: off (null)
    return out


def _blamed(make, origins: dict[str, str]):
    """make()'s config; its ConfigError's errors about a key set on the command line name how."""
    try:
        return make()
    except ConfigError as e:
        raise ConfigError(blame_overrides(e.errors, origins)) from None


def _config_errors(path, errors: list[str], origins: dict[str, str]) -> None:
    """The report of a config that does not load: one line for one error, else a list; `in FILE`
    unless every error names its file, or a key or override of the command line."""
    if path:  # a command to copy names the config it was given
        errors = [err.replace("-c CONFIG", f"-c {path}") for err in errors]
    own = (f"{Path(path)}:", "--set ", "$RLHF_SET ", *(f"{o}:" for o in origins.values()), *(f"{k}:" for k in origins))
    where = "" if all(err.startswith(own) for err in errors) else f" in {path}"
    if len(errors) == 1:
        print(f"config error{where}: {errors[0]}", file=sys.stderr)
        return
    print(f"config errors{where}:", file=sys.stderr)
    for err in errors:
        print(f"  {err}", file=sys.stderr)


def run_dir_problem(path) -> str | None:
    """Why the run directory `path` cannot be used (created or written), or None; creates nothing."""
    p = Path(path).expanduser().absolute()
    try:
        existing = next(a for a in (p, *p.parents) if a.exists())
    except OSError as e:
        return f"cannot use the run directory {p}: {e.strerror or e}"
    if not existing.is_dir():
        return f"cannot create the run directory {p}: {existing} is a file, not a directory"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"cannot {'write to' if existing == p else 'create'} the run directory {p}: {existing} is not writable"
    return None


LOOPBACK = ("127.0.0.1", "localhost", "::1")
MIN_SECRET_CHARS = 16


def secret_problem(name: str, value: str | None, host: str) -> str | None:
    """Why the secret `name` (an environment variable) cannot guard a server listening on `host`:
    a placeholder left from an example file (change-me...), or shorter than MIN_SECRET_CHARS. A
    server on the loopback only may run with any secret, or none."""
    if host in LOOPBACK or value is None:
        return None
    hint = 'any long random string, e.g. from `python3 -c "import secrets; print(secrets.token_urlsafe(32))"`'
    if value.strip().lower().replace("_", "-").startswith(("change-me", "changeme")):
        return f"{name} is still the placeholder of the example file; set it to {hint}"
    if len(value) < MIN_SECRET_CHARS:
        return f"{name} has {len(value)} characters (fewer than {MIN_SECRET_CHARS}); set it to {hint}"
    return None


def quiet_model_files() -> None:
    """transformers' own progress bars off: one per model loaded or saved ("Loading weights",
    "Writing model shards"), i.e. per checkpoint. The hub's download bars, where a user waits,
    stay (unless HF_HUB_DISABLE_PROGRESS_BARS), and so do the run's own progress lines. The
    datasets library's bars ("Map", "Generating train split": instant on the data a run reads) off
    too, unless HF_DATASETS_DISABLE_PROGRESS_BARS says otherwise."""
    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")  # read when datasets is imported
    from huggingface_hub.utils import are_progress_bars_disabled, enable_progress_bars
    from transformers.utils import logging as transformers_logging

    downloads_quiet = are_progress_bars_disabled()
    transformers_logging.disable_progress_bar()  # turns the hub's off too
    if not downloads_quiet:
        enable_progress_bars()
