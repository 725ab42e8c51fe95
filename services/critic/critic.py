"""The critic: a value model and its optimiser. `values` scores states; `train_step` takes one
optimiser step of the (optionally clipped) value loss. The critic server and the in-process
trainer both host this object.
"""
from __future__ import annotations

from pathlib import Path

import torch

from ..common.modeling import TokenBatch, ValueModel, resolve_device
from ..ppo import compute_value_loss, masked_mean


class Critic:
    def __init__(self, model_path: str, lr: float = 1e-4, value_clip: float | None = None,
                 loss_agg_mode: str = "token-mean", max_grad_norm: float | None = 1.0,
                 value_loss_coef: float = 1.0, device: str = "auto", weight_decay: float = 0.0):
        self.device = resolve_device(device)
        self.model = ValueModel.from_pretrained(model_path).to(self.device)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=lr, weight_decay=weight_decay)
        self.value_clip, self.loss_agg_mode = value_clip, loss_agg_mode
        self.max_grad_norm, self.value_loss_coef = max_grad_norm, value_loss_coef
        self.steps = 0

    @classmethod
    def from_config(cls, cfg) -> "Critic":
        return cls(cfg.critic.model_path or cfg.model.path, lr=cfg.critic.lr, value_clip=cfg.value_clip,
                   loss_agg_mode=cfg.loss_agg_mode, max_grad_norm=cfg.max_grad_norm,
                   value_loss_coef=cfg.critic.value_loss_coef, device=cfg.model.device,
                   weight_decay=cfg.weight_decay)

    @torch.no_grad()
    def values(self, batch: TokenBatch) -> torch.Tensor:
        """V(s_t) per response position: (B, T), 0 where `response_mask` is 0."""
        self.model.eval()
        return self.model.response_values(batch.to(self.device)).cpu()

    def train_step(self, batch: TokenBatch, returns: torch.Tensor, old_values: torch.Tensor) -> dict:
        """One optimiser step on a mini-batch. returns, old_values: (B, T)."""
        self.model.train()
        batch = batch.to(self.device)
        returns, old_values = returns.to(self.device), old_values.to(self.device)
        vpreds = self.model.response_values(batch)
        vf_loss, vf_clipfrac = compute_value_loss(vpreds, returns, old_values, batch.response_mask,
                                                  self.value_clip, self.loss_agg_mode)
        self.optimizer.zero_grad(set_to_none=True)
        (self.value_loss_coef * vf_loss).backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_grad_norm or float("inf"))
        self.optimizer.step()
        self.steps += 1
        return {"critic/vf_loss": vf_loss.item(), "critic/vf_clipfrac": vf_clipfrac.item(),
                "critic/vpred_mean": masked_mean(vpreds.detach(), batch.response_mask).item(),
                "critic/grad_norm": float(grad_norm)}

    def save(self, path: str | Path) -> None:
        path = Path(path)
        self.model.save_pretrained(path)
        torch.save({"optimizer": self.optimizer.state_dict(), "steps": self.steps}, path / "critic_optim.pt")

    def load(self, path: str | Path) -> None:
        path = Path(path)
        fresh = ValueModel.from_pretrained(path).to(self.device)
        self.model.load_state_dict(fresh.state_dict())
        state = torch.load(path / "critic_optim.pt", weights_only=True)
        self.optimizer.load_state_dict(state["optimizer"])
        self.steps = int(state["steps"])
