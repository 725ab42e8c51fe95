"""Whether the critic works, in numbers a user reads: the explained variance of the values the
rollout was given against the returns (1 = every return predicted, 0 = no better than their
mean), the values' RMS error, the returns' spread; the critic reads each response token's value
at the position GAE expects (the state before that token); on the tiny model the explained
variance is reported every iteration."""

import json
import math
from pathlib import Path

import pytest
import torch
from torch import nn

from services.common.config import load_config
from services.common.modeling import ValueModel
from services.common.token_batch import build_token_batch
from services.local import run_local
from services.ppo import explained_variance

ROOT = Path(__file__).resolve().parents[2]


def test_explained_variance_by_hand():
    returns = torch.tensor([[1.0, 2.0, 3.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])  # the last position is padding: never counted
    assert explained_variance(returns, returns, mask) == pytest.approx(1.0)
    assert explained_variance(torch.full_like(returns, 2.0), returns, mask) == pytest.approx(0.0)  # the mean
    assert explained_variance(torch.zeros_like(returns), returns, mask) == pytest.approx(0.0)  # a constant
    assert explained_variance(-returns, returns, mask) == pytest.approx(1 - 4.0)  # Var(2R) / Var(R) = 4
    assert math.isnan(explained_variance(returns, torch.ones_like(returns), mask))  # returns that do not vary


class _Ids(nn.Module):
    """A backbone whose hidden state at each position is the token id there."""

    def forward(self, input_ids, attention_mask, position_ids, use_cache):
        return type("Out", (), {"last_hidden_state": input_ids.float().unsqueeze(-1)})()


def test_values_are_read_at_the_state_before_each_response_token():
    model = ValueModel(_Ids(), 1)
    with torch.no_grad():
        model.value_head.weight.fill_(1.0)  # value = the id of the token the head reads
    prompts, responses = [[11, 12, 13], [21]], [[31, 32, 33, 34], [41, 42]]
    batch = build_token_batch(prompts, responses, pad_id=0)
    values = model.response_values(batch)
    # V(s_t) is read after the token before response token t: the last prompt token for t = 0
    assert values.tolist() == [[13.0, 31.0, 32.0, 33.0], [21.0, 41.0, 0.0, 0.0]]


def test_a_run_reports_the_critics_diagnostics(tiny_model_dir, tmp_path):
    """Every iteration's row carries the critic's numbers. Whether the critic learns is asserted on
    a fixed batch (tests/learner/test_learning_guarantees.py): the rise over a run is a chaotic
    trajectory that another CPU's float kernels change (0.17 here, 0.03 on another machine)."""
    cfg = load_config(
        ROOT / "configs" / "tiny-cpu.yaml",
        [
            f"model.path={tiny_model_dir}",
            "adv_estimator=gae",
            "run.iterations=3",
            "run.eval_interval=0",
            "rollout_batch_size=16",
        ],
    )
    run_local(cfg, tmp_path)
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()][1:]
    ev = [r["critic/explained_variance"] for r in rows]
    assert len(ev) == 3 and all(math.isfinite(v) and v <= 1 for v in ev), ev
    assert ev[0] == pytest.approx(0.0, abs=1e-6)  # a zero-initialised head: values 0, a constant
    for r in rows:
        assert r["critic/value_error"] >= 0 and r["ppo/returns_std"] >= 0
