"""A rollout worker that claims prompts and then hangs holding them: the fault a real worker shows
when it is wedged (a stuck driver, a dead GPU) before it is killed. A test seam, not a product
feature: it speaks to Redis exactly as a worker does (registers, claims from the consumer group)
and never renews its claim, so the prompts must be reclaimed by the live workers.

    python -m tests.e2e.stalled_worker CONFIG REDIS_URL NAME

Prints `HOLDING <n>` (flushed) once it holds prompts, then sleeps until it is killed.
"""

from __future__ import annotations

import sys
import time

import redis

from services.common.config import load_config
from services.common.replay import ReplayStore


def main(config: str, url: str, name: str) -> None:
    cfg = load_config(config)
    store = ReplayStore.from_config(cfg, url)
    store.heartbeat("worker", name, produced=0)
    while True:
        try:
            entries, _ = store.claim_prompts(name, cfg.rollout.prompts_per_request, cfg.replay.block_ms)
        except redis.ResponseError as e:  # the run reset the namespace between our reads: as a worker does
            if "NOGROUP" not in str(e):
                raise
            store.ensure_groups()
            continue
        if entries:
            break
    print(f"HOLDING {len(entries)}", flush=True)
    while True:
        time.sleep(3600)


if __name__ == "__main__":
    main(*sys.argv[1:4])
