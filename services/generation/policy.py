"""A policy as a generation backend: the sampling engine the config names (`make_backend`: vLLM's
or transformers', from `model.path`), or a policy from any of the places a run keeps one, as a
backend or a model directory.

`path` may be a Hugging Face model directory (the base, a run's `final/` or `best/`, a checkpoint of
`rlhf train --local`), a checkpoint of `rlhf up` (`learner.pt` alone: its policy loaded into
`base`'s architecture; the format is services/common/checkpoints.py's), weights over `base` (the
Tinker API's sampler weights), or a LoRA adapter directory (merged into the base it names)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from ..common.checkpoints import is_complete, is_overlay, policy_weights, read_overlay
from ..common.model_files import check_model_dir, save_model_dir
from .backend import HFBackend

if TYPE_CHECKING:
    from ..common.config import Config
    from ..common.types import GenerationBackend


def make_backend(cfg: Config) -> GenerationBackend:
    """The sampling engine `generation.backend` names, loaded from `model.path`."""
    dtype = cfg.generation.engine_dtype(cfg.model.bf16)
    if cfg.generation.backend == "vllm":
        from .vllm_backend import VLLMBackend

        return VLLMBackend(
            cfg.model.path,
            cfg.generation.vllm,
            dtype=dtype,
            max_model_len=cfg.prompt_length + cfg.response_length,
            in_flight=cfg.generation.weight_update == "in_flight",
            recompute=cfg.generation.in_flight_cache == "recompute",
        )
    import torch

    from .backend import HFBackend

    return HFBackend(
        cfg.model.path, cfg.model.device, getattr(torch, dtype), recompute=cfg.generation.in_flight_cache == "recompute"
    )


def load_policy(path: str, base: str, device: str = "cpu") -> HFBackend:
    """A generation backend serving the policy in `path`."""
    p = Path(path)
    if is_complete(p):
        policy = policy_weights(p)
        backend = HFBackend(base, device)
        missing, unexpected = backend.model.load_state_dict(policy, strict=False)
        if unexpected or [k for k in missing if not k.endswith("lm_head.weight")]:
            raise ValueError(
                f"{p}: its policy does not fit model.path={base} (missing {missing[:3]}, unexpected {unexpected[:3]})"
            )
        return backend
    if is_overlay(p):  # weights over the base (the Tinker API's sampler weights)
        backend, weights = HFBackend(base, device), read_overlay(p)
        unexpected = sorted(set(weights) - set(backend.model.state_dict()))
        if unexpected:
            raise ValueError(f"{p}: its weights do not fit model.path={base} (unexpected {unexpected[:3]})")
        backend.model.load_state_dict(weights, strict=False)
        return backend
    if (p / "adapter_config.json").exists() and not (p / "config.json").exists():
        from peft import PeftModel

        adapter_base = json.loads((p / "adapter_config.json").read_text()).get("base_model_name_or_path") or base
        backend = HFBackend(adapter_base, device)
        backend.model = PeftModel.from_pretrained(backend.model, str(p)).merge_and_unload().eval()
        return backend
    return HFBackend(str(check_model_dir(path)), device)


def export_policy(path: str, base: str, out: Path) -> None:
    """The policy in `path` (any kind `load_policy` reads) written to `out` as a Hugging Face
    model directory (weights, config, tokenizer)."""
    backend = load_policy(path, base, "cpu")
    save_model_dir(backend.model, out, backend.tokenizer)
