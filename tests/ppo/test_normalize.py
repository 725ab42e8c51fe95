import pytest
import torch

from services.ppo import RunningMeanStd, normalize_rewards, postprocess_rewards


def test_none_is_identity():
    s = torch.tensor([1.0, 5.0])
    assert torch.equal(normalize_rewards(s, None), s)


def test_batch_norm_shift_scale():
    s = torch.tensor([1.0, 2.0, 3.0])
    full = normalize_rewards(s, "batch")
    assert torch.allclose(full, torch.tensor([-1.0, 0.0, 1.0]), atol=1e-5)
    assert torch.allclose(normalize_rewards(s, "batch", reward_shift=True), torch.tensor([-1.0, 0.0, 1.0]))
    assert torch.allclose(normalize_rewards(s, "batch", reward_scale=True), s / 1.0, atol=1e-5)
    s2 = torch.tensor([0.0, 4.0])
    assert torch.allclose(normalize_rewards(s2, "batch", reward_scale=True), s2 / s2.std(), atol=1e-5)


def test_group_norm():
    s = torch.tensor([1.0, 3.0, 10.0, 30.0])
    out = normalize_rewards(s, "group", index=["a", "a", "b", "b"])
    assert torch.allclose(out, torch.tensor([-0.7071, 0.7071, -0.7071, 0.7071]), atol=1e-3)
    with pytest.raises(ValueError, match="group index"):
        normalize_rewards(s, "group")


def test_running_statistics_accumulate_and_checkpoint():
    rs = RunningMeanStd()
    data = torch.randn(1000) * 3 + 2
    for chunk in data.split(100):
        normalize_rewards(chunk, "running", running=rs)
    assert rs.mean == pytest.approx(data.mean().item(), abs=1e-5)
    assert rs.std == pytest.approx(data.std(unbiased=False).item(), rel=1e-4)
    restored = RunningMeanStd()
    restored.load_state_dict(rs.state_dict())
    x = torch.tensor([2.0])
    rs_copy = RunningMeanStd()
    rs_copy.load_state_dict(rs.state_dict())
    assert torch.equal(
        normalize_rewards(x, "running", running=restored), normalize_rewards(x, "running", running=rs_copy)
    )


def test_clip_after_normalisation():
    s = torch.tensor([-10.0, 0.5, 10.0])
    assert torch.equal(postprocess_rewards(s, None, False, False, reward_clip=1.0), torch.tensor([-1.0, 0.5, 1.0]))
