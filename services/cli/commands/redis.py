"""`rlhf redis`: redis-server for the replay buffer, in the foreground (Compose's Redis)."""

from __future__ import annotations

import os

from ..shared import LOOPBACK, error, secret_problem


def add_parser(sub) -> None:
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


def cmd_redis(args) -> int:
    """redis-server in the foreground with the replay buffer's settings (AOF on, the password from
    $RLHF_REDIS_PASSWORD, the config file readable by its owner only): Compose's Redis."""
    from ...common.replay.embedded import EmbeddedRedis

    password = os.environ.get("RLHF_REDIS_PASSWORD") or None
    if password is None and args.host not in LOOPBACK:
        return error(f"rlhf redis: set RLHF_REDIS_PASSWORD before listening on {args.host}")
    problem = secret_problem("RLHF_REDIS_PASSWORD", password, args.host)
    if problem:
        return error(f"rlhf redis: {problem}")
    EmbeddedRedis(
        args.dir, port=args.port, host=args.host, password=password, appendfsync=args.appendfsync, logfile=""
    ).exec()
    return 0
