"""The `rlhf` command.

    rlhf init-model --out runs/tiny-model           build the tiny default policy offline
    rlhf config validate FILE [--set k=v ...]       print the resolved config, or every error
    rlhf train --local -c FILE [--run-dir DIR]      the whole PPO loop in one process
    rlhf serve generation|reward|critic|learner|rollout -c FILE   one service, until SIGTERM
    rlhf up -c FILE [--run-dir DIR]                 the whole system on localhost (embedded Redis)
"""
from __future__ import annotations

import argparse
import logging
import sys

from .common.config import ConfigError, dump_config, load_config

EXIT_CONFIG = 2


def _add_config_args(p: argparse.ArgumentParser, required: bool = True) -> None:
    p.add_argument("-c", "--config", required=required, help="YAML config file")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key (dotted path for sections), repeatable")


def _load(args):
    try:
        return load_config(args.config, args.overrides)
    except ConfigError as e:
        print(f"config error{'s' if len(e.errors) > 1 else ''} in {args.config}:", file=sys.stderr)
        for err in e.errors:
            print(f"  {err}", file=sys.stderr)
        sys.exit(EXIT_CONFIG)


def cmd_config_validate(args) -> int:
    cfg = _load(args)
    sys.stdout.write(dump_config(cfg))
    return 0


def cmd_init_model(args) -> int:
    from .common.tiny import init_tiny_model
    init_tiny_model(args.out, warm_start_steps=args.warm_start_steps, seed=args.seed)
    print(f"tiny model written to {args.out}")
    return 0


def cmd_train(args) -> int:
    cfg = _load(args)
    if args.run_dir:
        cfg.run.run_dir = args.run_dir
    if not args.local:
        print("distributed training is `rlhf up`; use `rlhf train --local` for the in-process trainer",
              file=sys.stderr)
        return EXIT_CONFIG
    from .common.modeling import check_model_dir
    try:
        check_model_dir(cfg.model.path)
    except FileNotFoundError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    from .learner.local import run_local
    run_local(cfg, cfg.run.run_dir)
    return 0


def cmd_serve(args) -> int:
    """Run one service in the foreground until SIGTERM/SIGINT (graceful shutdown)."""
    cfg = _load(args)
    if args.run_dir:
        cfg.run.run_dir = args.run_dir
    if args.service == "rollout":
        return _serve_rollout(cfg, args)
    ep = getattr(cfg.rpc, args.service)
    if args.port is not None:
        ep.port = args.port
    if args.host is not None:
        ep.host = args.host
    if args.metrics_port is not None:
        ep.metrics_port = args.metrics_port if args.metrics_port >= 0 else None
    if args.service == "learner":
        return _serve_learner(cfg, args)
    if args.service == "generation":
        from .generation.server import build_generation_server
        server, servicer = build_generation_server(cfg)
        stops = [servicer.batcher.close]
        if cfg.replay.url:  # part of a distributed run: register, pull the current policy
            from .common.replay import ReplayStore
            from .generation.registration import Registration
            from .common.rpc.server import advertised_address
            reg = Registration(cfg, servicer, advertised_address(cfg.rpc, ep.host, server.port),
                               ReplayStore.from_config(cfg))
            server.set_ready(False)
            reg.start()
            server.set_ready(True)
            stops.insert(0, reg.stop)
    elif args.service == "reward":
        if args.http_port is not None:
            cfg.rpc.reward.http_port = args.http_port if args.http_port >= 0 else None
        from .reward.server import build_reward_server
        server, http = build_reward_server(cfg)
        stops = [http.stop] if http else []
    elif args.service == "critic":
        from .critic.server import build_critic_server
        server = build_critic_server(cfg)
        stops = []
    else:
        print(f"unknown service {args.service!r}", file=sys.stderr)
        return EXIT_CONFIG
    server.install_signal_handlers()
    # one machine-readable line, for supervisors that start services on free ports
    extra = f" http_port={server.http_port}" if getattr(server, "http_port", None) else ""
    print(f"READY service={args.service} port={server.port} metrics_port={server.metrics_port}{extra}", flush=True)
    server.wait()
    for stop in stops:
        stop()
    return 0


def _on_signals(fn) -> None:
    import signal

    def handler(signum, frame):
        logging.getLogger("rlhf").info("signal %d: finishing the work in flight, then stopping", signum)
        fn()
    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)


def _serve_learner(cfg, args) -> int:
    from .common.modeling import check_model_dir
    from .learner.service import LearnerService
    if args.http_port is not None:
        cfg.rpc.learner.http_port = args.http_port if args.http_port >= 0 else None
    try:
        check_model_dir(cfg.model.path)
        service = LearnerService(cfg, cfg.run.run_dir)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_CONFIG
    server = service.start_server()
    _on_signals(service.stop)
    http = f" http_port={service.http.server_address[1]}" if service.http else ""
    print(f"READY service=learner port={server.port} metrics_port={server.metrics_port}{http}", flush=True)
    try:
        service.run()
    finally:
        service.close()
    return 0


def _serve_rollout(cfg, args) -> int:
    from .common.replay import ReplayStore
    from .rollout.worker import RolloutWorker
    try:
        store = ReplayStore.from_config(cfg)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_CONFIG
    worker = RolloutWorker(cfg, store, name=args.name)
    mp = args.metrics_port if args.metrics_port is not None else cfg.rollout.metrics_port
    port = worker.serve_metrics(mp, args.host or cfg.rpc.host) if mp is not None and mp >= 0 else None
    _on_signals(worker.stop)
    print(f"READY service=rollout worker={worker.name} metrics_port={port}", flush=True)
    worker.run()
    return 0


def cmd_up(args) -> int:
    cfg = _load(args)
    from .launcher import run_up
    return run_up(cfg, args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rlhf", description="Microservice PPO for language models")
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("config", help="configuration tools")
    csub = p.add_subparsers(dest="config_command", required=True)
    v = csub.add_parser("validate", help="print the resolved config or every error (exit 2)")
    v.add_argument("config", help="YAML config file")
    v.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    v.set_defaults(func=cmd_config_validate)

    p = sub.add_parser("init-model", help="build the tiny default model and tokenizer offline")
    p.add_argument("--out", default="runs/tiny-model")
    p.add_argument("--warm-start-steps", type=int, default=100)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=cmd_init_model)

    p = sub.add_parser("train", help="train with PPO")
    _add_config_args(p)
    p.add_argument("--local", action="store_true", help="run every part in this process")
    p.add_argument("--run-dir", help="where metrics, summary, curves and checkpoints go")
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("serve", help="run one service: generation, reward, critic, learner or rollout")
    p.add_argument("service", choices=["generation", "reward", "critic", "learner", "rollout"])
    _add_config_args(p)
    p.add_argument("--host")
    p.add_argument("--port", type=int, help="gRPC port (0 = a free one)")
    p.add_argument("--metrics-port", type=int, help="Prometheus port (0 = a free one, -1 = off)")
    p.add_argument("--http-port", type=int, help="reward: OpenRLHF HTTP API; learner: JSON status "
                   "(0 = a free port, -1 = off)")
    p.add_argument("--run-dir", help="learner: where checkpoints, metrics and summary go")
    p.add_argument("--name", help="rollout: the worker's consumer name (default host-pid)")
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("up", help="run the whole system on localhost: embedded Redis and every service")
    _add_config_args(p)
    p.add_argument("--run-dir", help="where metrics, checkpoints, logs and the Redis data go")
    p.add_argument("--workers", type=int, default=1, help="rollout workers (default 1)")
    p.add_argument("--generation-servers", type=int, default=1, help="generation servers (default 1)")
    p.add_argument("--max-restarts", type=int, default=3,
                   help="restarts of a crashed learner or rollout worker before giving up")
    p.add_argument("--startup-timeout", type=float, default=180.0, help="seconds a service may take to be ready")
    p.set_defaults(func=cmd_up)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    import os
    if args.verbose:
        os.environ["RLHF_LOG_LEVEL"] = "DEBUG"  # services started by `rlhf up` inherit it
    level = os.environ.get("RLHF_LOG_LEVEL", "INFO").upper()
    logging.basicConfig(level=getattr(logging, level, logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for noisy in ("httpx", "urllib3", "transformers"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
