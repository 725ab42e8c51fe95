"""`rlhf serve SERVICE`: one service in the foreground until SIGTERM/SIGINT (graceful shutdown),
after the checks that need nothing loaded: its flags, its ports, its secret, its run directory."""

from __future__ import annotations

import errno
import os
import socket
from importlib import import_module
from typing import TYPE_CHECKING

from ...common.checkpoints import Mode
from ..rundir import run_dir_conflict
from ..shared import USER_ERRORS, add_config_args, error, load_config, run_dir_problem, secret_problem

if TYPE_CHECKING:
    from ...common.config import Config

SERVICES = ["generation", "reward", "critic", "teacher", "learner", "rollout", "gateway", "tinker", "tinker-trainer"]
# where a service's `serve(cfg)` is, when not in services/<name>/server.py
MODULES = {"tinker-trainer": "tinker.trainer_server"}


def add_parser(sub) -> None:
    p = sub.add_parser("serve", help=f"run one service: {', '.join(SERVICES[:-1])} or {SERVICES[-1]}")
    p.add_argument("service", choices=SERVICES, help="the service")
    add_config_args(p)
    p.add_argument(
        "--host", help="the address to listen on (rpc.SERVICE.host; a rollout worker: rpc.host; tinker: tinker.host)"
    )
    p.add_argument("--port", type=int, help="gRPC port (the gateway and tinker: their HTTP port; 0 = a free one)")
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


def cmd_serve(args) -> int:
    """Run one service in the foreground until SIGTERM/SIGINT (graceful shutdown)."""
    from ...common.lifecycle import run_service

    problem = flag_problem(args)
    if problem:
        return error(problem)
    cfg = load_config(args, data=args.service == "learner")
    sharded = {"learner": cfg.model, "critic": cfg.critic}.get(args.service)  # where its nproc is
    if sharded is not None and sharded.nproc > 1 and int(os.environ.get("RANK", "0")) > 0:
        return _follow(cfg, args)
    problem = _serve_problem(cfg, args)
    if problem:
        return error(problem)
    if sharded is not None and sharded.nproc > 1:
        from ...common.sharding.followers import start_followers

        start_followers(sharded.nproc, args.argv)
    if args.service == "generation" and os.environ.get("RLHF_GPU_SLOTS_DIR"):
        from ...generation.gpu_slot import claim_gpu

        try:
            claim_gpu(os.environ["RLHF_GPU_SLOTS_DIR"])
        except (OSError, RuntimeError) as e:
            return error(e)
    try:
        return run_service(_service(cfg, args))
    except USER_ERRORS as e:
        return error(e)


def flag_problem(args) -> str | None:
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
    http_only = {"gateway": "the gateway", "tinker": "the Tinker API"}.get(args.service)
    if args.metrics_port is not None and http_only:
        return f"--metrics-port: {http_only} serves /metrics on its HTTP port (--port), not a port of its own"
    if args.port is not None and args.service == "rollout":
        return "--port: a rollout worker serves no gRPC (its /metrics port is --metrics-port)"
    if args.nproc is not None and args.service not in ("learner", "critic"):
        return f"--nproc is for the learner and the critic (not the {args.service})"
    if args.nproc is not None and args.nproc < 1:
        return f"--nproc {args.nproc}: needs 1 or more"
    return None


def _port_problem(flag: str, value: int | None, off: bool) -> str | None:
    """--port must be 0-65535; --metrics-port and --http-port may also be -1 (off)."""
    if value is None or 0 <= value <= 65535 or (off and value == -1):
        return None
    return f"{flag} {value} is out of range: 0-65535 (0 picks a free port{', -1 turns it off' if off else ''})"


def _follow(cfg: Config, args) -> int:
    """A follower rank of a sharded learner or critic: no ports, no signals of its own; it ends
    with rank 0."""
    from ...common.sharding.followers import ignore_stop_signals

    ignore_stop_signals()
    module = f"...{args.service}.{'run' if args.service == 'learner' else 'server'}"
    return import_module(module, __package__).follower_main(cfg)


def _serve_problem(cfg: Config, args) -> str | None:
    """What stops `rlhf serve SERVICE` before anything loads: a port out of range or in use, a
    placeholder or short secret on a non-loopback address, an unusable run directory (learner)."""
    host = {"rollout": cfg.rpc.host, "tinker": cfg.tinker.host}.get(args.service) or _endpoint(cfg, args.service).host
    problem = secret_problem(
        "rpc.auth_token" if cfg.rpc.auth_token else cfg.rpc.auth_token_env, cfg.rpc.resolved_auth_token(), host
    )
    if problem:
        return problem
    for what, keys, port in _ports(cfg, args.service):
        problem = _bind_problem(what, keys, host, port)
        if problem:
            return problem
    if args.service != "learner":
        return None
    return run_dir_problem(cfg.run.run_dir) or run_dir_conflict(cfg, Mode.DISTRIBUTED)


def _ports(cfg: Config, service: str) -> list[tuple[str, str, int | None]]:
    """The ports `service` binds: (what, the flag and key that set it, the port)."""
    if service == "rollout":
        return [("metrics", "--metrics-port, rollout.metrics_port", cfg.rollout.metrics_port)]
    if service == "gateway":
        return [("HTTP", "--port, rpc.gateway.port", cfg.rpc.gateway.port)]
    if service == "tinker":
        return [("HTTP", "--port, tinker.port", cfg.tinker.port)]
    ep, key = _endpoint(cfg, service), f"rpc.{service.replace('-', '_')}"
    ports = [
        ("gRPC", f"--port, {key}.port", ep.port),
        ("metrics", f"--metrics-port, {key}.metrics_port", ep.metrics_port),
    ]
    if service in ("reward", "learner"):
        ports.append(("HTTP", f"--http-port, {key}.http_port", ep.http_port))
    return ports


def _endpoint(cfg: Config, service: str):
    """`rpc.<service>`, the endpoint a gRPC service binds (tinker-trainer: rpc.tinker_trainer)."""
    return getattr(cfg.rpc, service.replace("-", "_"))


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


def _service(cfg: Config, args):
    """The `serve(cfg)` handle of the service `args.service` names."""
    if args.service == "rollout":
        from ...rollout.worker import serve

        return serve(cfg, name=args.name)
    module = MODULES.get(args.service, f"{args.service}.server")
    return import_module(f"...{module}", __package__).serve(cfg)
