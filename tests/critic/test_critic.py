import torch

from services.common.token_batch import build_token_batch
from services.critic.critic import Critic


def _batch(tok):
    prompts = [tok(s)["input_ids"] for s in ["abc=", "hgfed="]]
    responses = [tok("cba</s>", add_special_tokens=False)["input_ids"][:3], tok("d")["input_ids"][1:]]
    return build_token_batch(prompts, responses, tok.pad_token_id)


def test_values_are_masked_and_training_fits_returns(tiny_model_dir, tmp_path):
    from services.common.model_files import load_tokenizer

    tok = load_tokenizer(tiny_model_dir)
    critic = Critic(tiny_model_dir, lr=3e-3, device="cpu")
    batch = _batch(tok)
    v0 = critic.values(batch)
    assert v0.shape == batch.response_mask.shape
    assert torch.all(v0[batch.response_mask == 0] == 0)
    returns = batch.response_mask * 1.5
    first = critic.train_step(batch, returns, v0)["critic/vf_loss"]
    for _ in range(30):
        last = critic.train_step(batch, returns, critic.values(batch))["critic/vf_loss"]
    assert last < first * 0.2
    critic.save(tmp_path / "c")
    other = Critic(str(tmp_path / "c"), device="cpu")
    other.load(tmp_path / "c")
    assert torch.allclose(other.values(batch), critic.values(batch), atol=1e-6)
    assert other.steps == critic.steps == 31


def test_value_clip_limits_the_step(tiny_model_dir):
    from services.common.model_files import load_tokenizer

    tok = load_tokenizer(tiny_model_dir)
    batch = _batch(tok)
    clipped = Critic(tiny_model_dir, lr=1e-2, value_clip=0.01, device="cpu")
    v0 = clipped.values(batch)
    m = clipped.train_step(batch, batch.response_mask * 100, v0)
    assert m["critic/vf_clipfrac"] == 0.0  # the first step starts at the old values: nothing clipped yet
    # the prediction has moved past v0 + 0.01 towards the target: the clipped term is larger now
    m = clipped.train_step(batch, batch.response_mask * 100, v0)
    assert m["critic/vf_clipfrac"] == 1.0


def test_a_non_finite_step_is_not_taken(tiny_model_dir):
    import pytest

    from services.common.model_files import load_tokenizer
    from services.critic.critic import NonFiniteStep

    batch = _batch(load_tokenizer(tiny_model_dir))
    critic = Critic(tiny_model_dir, lr=1e-2, device="cpu")
    critic.train_step(batch, batch.response_mask, critic.values(batch))
    weights = {k: v.clone() for k, v in critic.model.state_dict().items()}
    optim = {k: v.clone() for k, v in critic.optimizer.state_dict()["state"][0].items()}
    with pytest.raises(NonFiniteStep, match="step skipped"):
        critic.train_step(batch, batch.response_mask * 3.4e38, critic.values(batch))
    assert critic.steps == 1
    assert all(torch.equal(v, weights[k]) for k, v in critic.model.state_dict().items())
    assert all(torch.equal(v, optim[k]) for k, v in critic.optimizer.state_dict()["state"][0].items())
    assert all(p.grad is None for p in critic.model.parameters())
    assert torch.isfinite(critic.values(batch)).all()
