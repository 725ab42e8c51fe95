"""The critic's value model sharded with FSDP2 across 2 CPU processes (gloo), against the
one-process critic on the same batches: the same values, losses and steps; a checkpoint that
resumes to the same state; checkpoints that load across 1 and 2 processes both ways."""

from pathlib import Path

import pytest
import torch

from services.critic.critic import Critic
from tests.critic.critic_cases import critic_kwargs, steps
from tests.distributed_helpers import torchrun

ROOT = Path(__file__).resolve().parents[2]


def _two_processes(model_dir: str, out: Path, *extra: str) -> dict:
    torchrun(ROOT / "tests" / "critic" / "fsdp_critic_worker.py", model_dir, str(out), *extra)
    return torch.load(out / "results.pt", weights_only=False)


def _one_process(model_dir: str, out: Path) -> tuple[Critic, dict]:
    torch.manual_seed(0)
    critic = Critic(model_dir, **critic_kwargs())
    (b1, r1, v1), (b2, r2, v2), (b3, r3, v3) = steps()
    results = {
        "values": critic.values(b1),
        "values_one_row": critic.values(b1.select([2])),
        "train": [critic.train_step(b1, r1, v1), critic.train_step(b2, r2, v2)],
    }
    critic.save(out / "ckpt")
    results["third"] = critic.train_step(b3, r3, v3)
    results["values_third"] = critic.values(b1)
    return critic, results


KEYS = ("critic/vf_loss", "critic/grad_norm", "critic/vpred_mean")
# values of the same weights computed by 2 processes and by 1: float noise of another batch shape
VALUE_ATOL = 1e-5


def test_two_process_critic_equals_one_process(tiny_model_dir, tmp_path):
    two = _two_processes(tiny_model_dir, tmp_path / "two")
    _, one = _one_process(tiny_model_dir, tmp_path / "one")
    assert two["bad_save"] in ("NotADirectoryError", "FileExistsError")
    # values from 2 processes (4 + 3 rows, 1 OpenMP thread each under torchrun) against 1 process (7
    # rows, this process's threads): another batch shape, so another float32 reduction order; ~1e-7
    # relative per op (2.4e-7 measured between 1 row and 7 rows on values of magnitude ~2) -> VALUE_ATOL
    assert torch.allclose(two["values"], one["values"], atol=VALUE_ATOL)
    assert two["values_one_row"].shape[0] == 1
    assert torch.allclose(two["values_one_row"], one["values_one_row"], atol=VALUE_ATOL)
    for got, want in zip(two["train"] + [two["third"]], one["train"] + [one["third"]]):
        for k in KEYS:
            assert got[k] == pytest.approx(want[k], rel=1e-4, abs=1e-6), k
    assert abs(one["train"][1]["critic/vf_loss"]) > 1e-3  # the comparison is not of zeros
    assert torch.allclose(two["values_third"], one["values_third"], atol=1e-4)
    # the checkpoint after two steps resumes to the same third step
    assert two["steps"] == 3
    for k in KEYS:
        assert two["third_again"][k] == two["third"][k], k
    assert torch.equal(two["values_again"], two["values_third"])


def test_checkpoints_load_across_one_and_two_processes(tiny_model_dir, tmp_path):
    # written by 2 processes, loaded by 1: the same third step as the two-process critic took
    two = _two_processes(tiny_model_dir, tmp_path / "two")
    critic = Critic(tiny_model_dir, **critic_kwargs())
    critic.load(tmp_path / "two" / "ckpt")
    assert critic.steps == 2
    b3, r3, v3 = steps()[2]
    third = critic.train_step(b3, r3, v3)
    for k in KEYS:
        assert third[k] == pytest.approx(two["third"][k], rel=1e-4, abs=1e-6), k
    # written by 1 process, loaded by 2
    _, one = _one_process(tiny_model_dir, tmp_path / "one")
    loaded = _two_processes(tiny_model_dir, tmp_path / "two-from-one", str(tmp_path / "one" / "ckpt"))
    assert loaded["loaded_step"] == 2
    reloaded = Critic(tiny_model_dir, **critic_kwargs())
    reloaded.load(tmp_path / "one" / "ckpt")
    assert torch.allclose(loaded["values"], reloaded.values(steps()[0][0]), atol=VALUE_ATOL)  # 2 processes vs 1
    # its first step after loading is the step the one-process critic takes after loading
    b1, r1, v1 = steps()[0]
    after = reloaded.train_step(b1, r1, v1)
    for k in KEYS:
        assert loaded["train"][0][k] == pytest.approx(after[k], rel=1e-4, abs=1e-6), k


def test_a_broken_sharded_checkpoint_is_refused_everywhere(tiny_model_dir, tmp_path):
    _two_processes(tiny_model_dir, tmp_path / "two")
    import shutil

    shutil.rmtree(tmp_path / "two" / "ckpt" / "optim")
    critic = Critic(tiny_model_dir, **critic_kwargs())
    from services.critic.critic import CheckpointError

    with pytest.raises(CheckpointError, match="optim"):
        critic.load(tmp_path / "two" / "ckpt")
    assert critic.steps == 0
