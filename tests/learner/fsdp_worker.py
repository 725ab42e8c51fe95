"""One rank of the 2-process FSDP2 learner test (run under torchrun by test_fsdp.py).

    torchrun --standalone --nproc-per-node 2 tests/learner/fsdp_worker.py MODEL_DIR OUT_DIR [KEY=VALUE ...]

Rank 0 drives the learner (its calls are announced to rank 1, which follows):
step on batch A; the full state dict; a sharded checkpoint; step on batch B; the full state dict;
load the checkpoint back; step on batch B again; the full state dict; the final policy saved.
Everything rank 0 sees is saved to OUT_DIR/results.pt for the test to compare with one process.
"""

import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from services.common.sharding.followers import follow, release_followers  # noqa: E402
from services.common.sharding.group import from_env  # noqa: E402
from services.learner.sharded import ShardedPolicyTrainer  # noqa: E402
from tests.learner.fsdp_cases import batches, learner_config  # noqa: E402


def main(model_dir: str, out: str, *overrides: str) -> None:
    cfg = learner_config(model_dir, overrides)
    torch.manual_seed(0)
    learner = ShardedPolicyTrainer(cfg, total_updates=10, dist=from_env("cpu"))
    if not learner.dist.main:
        follow(learner)
        return
    a, b = batches(learner.pad_id)
    out = Path(out)
    results = {"step_a": learner.step(a), "weights_a": learner.policy_state_dict()}
    learner.save_actor(out / "actor")
    state = learner.state_dict()
    torch.save(state, out / "learner.pt")
    results["step_b"] = learner.step(b)
    results["weights_b"] = learner.policy_state_dict()
    learner.load_state_dict(state, out / "actor")
    results["step_b_again"] = learner.step(b)
    results["weights_b_again"] = learner.policy_state_dict()
    learner.save_policy(out / "final")
    torch.save(results, out / "results.pt")
    release_followers(learner)


if __name__ == "__main__":
    main(*sys.argv[1:])
