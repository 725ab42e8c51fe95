"""One rank of the 2-process sharded critic test (run under torchrun by test_sharded_critic.py).

    torchrun --standalone --nproc-per-node 2 tests/critic/fsdp_critic_worker.py MODEL_DIR OUT_DIR [ONE_PROCESS_CKPT]

Rank 0 drives (its calls are announced to rank 1): values; two train steps; save; a third
step; load the save back; the third step again; values. With ONE_PROCESS_CKPT it first loads a
checkpoint a one-process critic wrote. Results go to OUT_DIR/results.pt.
"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from services.common.sharding.followers import follow, release_followers  # noqa: E402
from services.common.sharding.group import from_env  # noqa: E402
from services.critic.sharded import ShardedCritic  # noqa: E402
from tests.critic.critic_cases import critic_kwargs, steps  # noqa: E402


def main(model_dir: str, out: str, one_process_ckpt: str = "") -> None:
    torch.manual_seed(0)
    critic = ShardedCritic(model_dir, dist=from_env("cpu"), **critic_kwargs())
    if not critic.dist.main:
        follow(critic)
        return
    out = Path(out)
    results = {}
    if one_process_ckpt:
        critic.load(one_process_ckpt)
        results["loaded_step"] = critic.steps
    (b1, r1, v1), (b2, r2, v2), (b3, r3, v3) = steps()
    out.mkdir(parents=True, exist_ok=True)
    (out / "a-file").write_text("")
    try:  # a save rank 0 cannot write: refused on every rank, the group stays in step
        critic.save(out / "a-file" / "ckpt")
    except OSError as e:
        results["bad_save"] = type(e).__name__
    results["values"] = critic.values(b1)
    results["values_one_row"] = critic.values(b1.select([2]))  # fewer rows than processes
    results["train"] = [critic.train_step(b1, r1, v1), critic.train_step(b2, r2, v2)]
    critic.save(out / "ckpt")
    results["third"] = critic.train_step(b3, r3, v3)
    results["values_third"] = critic.values(b1)
    critic.load(out / "ckpt")
    results["third_again"] = critic.train_step(b3, r3, v3)
    results["values_again"] = critic.values(b1)
    results["steps"] = critic.steps
    torch.save(results, out / "results.pt")
    release_followers(critic)


if __name__ == "__main__":
    main(*sys.argv[1:])
