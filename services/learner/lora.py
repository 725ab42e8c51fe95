"""The weights of a LoRA policy (a PEFT model) as a generation server holds them: the plain
model's names, with every adapter merged into its layer's weight."""

from __future__ import annotations

import torch


def merged_lora_weights(policy) -> dict[str, torch.Tensor]:
    """Each LoRA-targeted layer's weight with its active adapters merged in, on the CPU: the only
    tensors training changes (the rest is the frozen base)."""
    from peft.tuners.lora import LoraLayer

    out = {}
    with torch.no_grad():
        for name, module in policy.get_base_model().named_modules():
            if isinstance(module, LoraLayer):
                w = getattr(module.get_base_layer(), "weight").detach().to("cpu", copy=True)
                for adapter in module.active_adapters:  # each LoRA layer type has its own delta (peft)
                    w = w + getattr(module, "get_delta_weight")(adapter).detach().cpu().to(w.dtype)
                out[f"{name}.weight"] = w
    return out


def merged_state_dict(policy) -> dict[str, torch.Tensor]:
    """The whole merged model: the frozen base's tensors (copies) and `merged_lora_weights`."""
    with torch.no_grad():
        state = {
            k.replace(".base_layer", ""): v.detach().cpu().clone()
            for k, v in policy.get_base_model().state_dict().items()
            if "lora_" not in k
        }
    state.update(merged_lora_weights(policy))
    return state
