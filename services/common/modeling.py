"""The forward passes every service shares: response log-probs of a causal LM (chunked over the
vocabulary, never a whole (batch, sequence, vocabulary) tensor), per-token values of a value model,
bf16 autocast, and whether a model's train-mode forward differs from its eval-mode one. Model
directories are model_files.py; the batches, token_batch.py."""

from __future__ import annotations

import contextlib
import functools
import inspect
from pathlib import Path
from typing import Any, Protocol, Sequence, cast

import torch
import torch.utils.checkpoint
from torch import nn

from ..ppo.losses import entropy_from_logits, logprobs_from_logits
from .model_files import check_model_dir, save_model_dir
from .token_batch import TokenBatch


def bf16_autocast(device: torch.device, bf16: bool):
    """bfloat16 autocast on `device` when `bf16` (model.bf16), else no context."""
    return torch.autocast(device.type, dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()


def has_dropout(model: torch.nn.Module) -> bool:
    """Whether a forward in train mode can differ from one in eval mode: a dropout module with
    p > 0, or a dropout probability > 0 in the model's config (attention dropout is a functional
    call in most transformers models, not a module)."""
    if any(isinstance(m, torch.nn.modules.dropout._DropoutNd) and m.p > 0 for m in model.modules()):
        return True
    config: Any = getattr(model, "config", None)
    items = config.to_dict().items() if hasattr(config, "to_dict") else ()
    return any(
        ("dropout" in k or "pdrop" in k) and isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0
        for k, v in items
    )


def response_logits(
    model: nn.Module, batch: TokenBatch, temperature: float = 1.0, past_key_values: Any = None
) -> torch.Tensor:
    """Logits (B, T, V) in float32 predicting each response token, divided by the sampling
    temperature: the whole vocabulary at every response position (what kl_penalty 'full' needs).
    Only the response positions go through the output layer. `past_key_values`: as in
    `response_log_probs`."""
    out = model(
        input_ids=batch.input_ids,
        attention_mask=batch.attention_mask,
        position_ids=batch.position_ids,
        use_cache=False,
        past_key_values=past_key_values,
        **_keep_kwargs(model, batch),
    )
    logits = out.logits[:, -(batch.response_mask.shape[1] + 1) : -1, :].float()
    return logits / temperature if temperature not in (0, 1.0) else logits


# float32 logits one chunk of the output layer holds at most (elements): 64 Mi = 256 MB
LOGIT_CHUNK_ELEMENTS = 1 << 26


def response_log_probs(
    model: nn.Module,
    batch: TokenBatch,
    temperature: float = 1.0,
    with_entropy: bool = False,
    full: bool = False,
    top_k: int = 0,
    targets: torch.Tensor | None = None,
    gather_ids: torch.Tensor | None = None,
    past_key_values: Any = None,
):
    """Log-prob (B, T) of each response token; optionally the entropy (B, T) of each position,
    the full log-probability tensor (B, T, V) and, with `top_k` > 0, each position's k most likely
    tokens: their log-probs (B, T, k) and ids (B, T, k), in descending log-prob (a teacher's
    top-k). Returns a dict with keys log_probs/entropy/full/top_log_probs/top_ids. `targets`
    (B, T), when given, are the tokens whose log-probs are read at the response positions instead
    of the response tokens themselves (the Tinker API's datums name their targets). `gather_ids`
    (B, T, k), when given, are k tokens per position whose log-probs are read too
    (`gathered_log_probs`, (B, T, k): a teacher's top-k under the policy, for the top-k forward KL).
    `past_key_values`, when given, is a cache of tokens before the batch's (a shared prompt's
    prefix, computed once): `batch.attention_mask` then covers them too, and `position_ids` go on
    from them.

    Memory does not grow with the vocabulary times the batch: the output layer runs inside the
    model's forward on the response positions only, a chunk of positions at a time (at most
    `LOGIT_CHUNK_ELEMENTS` float32 logits), and with gradients each chunk's logits are recomputed
    in the backward pass instead of kept. Only `full` (kl_penalty 'full') materialises (B, T, V).
    """
    if full or not _head_is_plain(model):
        logits = response_logits(model, batch, temperature, past_key_values)
        out = {"log_probs": logprobs_from_logits(logits, batch.responses if targets is None else targets)}
        if with_entropy:
            out["entropy"] = entropy_from_logits(logits)
        if full:
            out["full"] = torch.log_softmax(logits, dim=-1)
        if top_k:
            top = torch.log_softmax(logits, dim=-1).topk(top_k, dim=-1)
            out["top_log_probs"], out["top_ids"] = top.values, top.indices
        if gather_ids is not None:
            out["gathered_log_probs"] = torch.log_softmax(logits, dim=-1).gather(-1, gather_ids)
        return out
    # a Linear (`_head_is_plain`), whose forward is replaced below
    head: Any = cast(_PretrainedModel, model).get_output_embeddings()
    T = batch.response_mask.shape[1]
    targets = batch.responses if targets is None else targets
    gathered = 0 if gather_ids is None else gather_ids.shape[-1]

    def chunked_head(hidden: torch.Tensor) -> torch.Tensor:
        # hidden (B, L, H), the last L positions; the response is predicted from [-(T+1), -1)
        h = hidden[:, -(T + 1) : -1, :]
        B, _, H = h.shape
        flat_h, flat_t = h.reshape(B * T, H), targets.reshape(B * T)
        flat_g = None if gather_ids is None else gather_ids.reshape(B * T, gathered)
        step = max(1, LOGIT_CHUNK_ELEMENTS // head.weight.shape[0])
        pieces = []
        for s in range(0, B * T, step):
            args = (
                flat_h[s : s + step],
                flat_t[s : s + step],
                head.weight,
                head.bias,
                temperature,
                with_entropy,
                top_k,
                None if flat_g is None else flat_g[s : s + step],
            )
            if torch.is_grad_enabled():
                pieces.append(torch.utils.checkpoint.checkpoint(_token_stats, *args, use_reentrant=False))
            else:
                pieces.append(_token_stats(*args))
        stats = torch.cat(pieces).reshape(B, T, -1)
        # returned as the model's "logits" so that the result leaves through the model's forward
        # (FSDP2's backward hooks hang on the root module's outputs)
        return torch.nn.functional.pad(stats, (0, 0, 0, 1))

    head.forward = chunked_head
    try:
        stats = model(
            input_ids=batch.input_ids,
            attention_mask=batch.attention_mask,
            position_ids=batch.position_ids,
            use_cache=False,
            past_key_values=past_key_values,
            **_keep_kwargs(model, batch),
        ).logits
    finally:
        del head.forward
    stats = stats[:, -(T + 1) : -1]
    out = {"log_probs": stats[..., 0]}
    if with_entropy:
        out["entropy"] = stats[..., 1]
    if top_k:
        first = 2 if with_entropy else 1
        out["top_log_probs"] = stats[..., first : first + top_k]
        out["top_ids"] = stats[..., first + top_k : first + 2 * top_k].long()
    if gathered:
        out["gathered_log_probs"] = stats[..., stats.shape[-1] - gathered :]
    return out


def token_log_probs(model: nn.Module, token_ids: Sequence[int], start: int) -> torch.Tensor:
    """log p(token_ids[t] | token_ids[:t]) for t in [start, len(token_ids)), float32, at
    temperature 1: one unpadded no-grad forward of the sequence (`response_log_probs` on a batch
    of one, so the output layer runs on the scored positions only, in float32). What both ends
    of the push parity check compute: the generation server's ScoreTokens and the learner."""
    device = next(model.parameters()).device
    ids = torch.tensor([list(token_ids)], dtype=torch.long, device=device)
    n = ids.shape[1]
    batch = TokenBatch(
        ids,
        torch.ones_like(ids),
        torch.arange(n, device=device).unsqueeze(0),
        torch.ones((1, n - start), dtype=torch.long, device=device),
        start,
    )
    with torch.no_grad():
        return response_log_probs(model, batch)["log_probs"][0].float()


def _token_stats(
    hidden, targets, weight, bias, temperature: float, with_entropy: bool, top_k: int = 0, gather=None
) -> torch.Tensor:
    """(N, 1 [+ 1] [+ 2k] [+ g]): the log-prob of each target (and the entropy; and the k largest
    log-probs, then their token ids as floats: exact below 2**24, far above any vocabulary; and
    the log-probs of the g tokens of each row of `gather`, (N, g)) under
    the output layer, in float32 under bf16 autocast too (bf16 logits would move each log-prob by
    ~1e-2, as much as a PPO step moves it)."""
    with torch.autocast(hidden.device.type, enabled=False):
        logits = torch.nn.functional.linear(hidden.float(), weight.float(), None if bias is None else bias.float())
    if temperature not in (0, 1.0):
        logits = logits / temperature
    log_probs = torch.log_softmax(logits, dim=-1)
    cols = [log_probs.gather(-1, targets.unsqueeze(-1))]
    if with_entropy:
        cols.append(-(log_probs.exp() * log_probs).sum(-1, keepdim=True))
    if top_k:
        top = log_probs.topk(top_k, dim=-1)
        cols += [top.values, top.indices.float()]
    if gather is not None:
        cols.append(log_probs.gather(-1, gather))
    return torch.cat(cols, dim=-1)


class _PretrainedModel(Protocol):
    """What is called here on a transformers model, or on PEFT's wrapper of one, beyond nn.Module's
    own methods (nn.Module's type says any other attribute is a Tensor or a Module)."""

    def get_output_embeddings(self) -> nn.Module | None: ...

    def get_base_model(self) -> nn.Module: ...  # PEFT's wrapper's only


def _base_model(model: nn.Module) -> nn.Module:
    # the model inside PEFT's wrapper
    return cast(_PretrainedModel, model).get_base_model() if hasattr(model, "get_base_model") else model


def _keep_kwargs(model: nn.Module, batch: TokenBatch) -> dict:
    """`logits_to_keep`: only the last T + 1 positions reach the output layer, where the model
    takes it (transformers' causal LMs do)."""
    keeps = _takes_logits_to_keep(type(_base_model(model)))  # type: ignore[arg-type]  # python/mypy#11470
    return {"logits_to_keep": batch.response_mask.shape[1] + 1} if keeps else {}


@functools.cache
def _takes_logits_to_keep(cls: type[nn.Module]) -> bool:
    return "logits_to_keep" in inspect.signature(cls.forward).parameters


def last_logits_kwargs(model: nn.Module) -> dict:
    """`logits_to_keep=1` where the model takes it: a prefill computes the output layer for the
    last position only."""
    keeps = _takes_logits_to_keep(type(_base_model(model)))  # type: ignore[arg-type]  # python/mypy#11470
    return {"logits_to_keep": 1} if keeps else {}


def _head_is_plain(model: nn.Module) -> bool:
    """Whether the model's logits are its output layer's plain output (a Linear), so that the
    layer can be replaced for the forward by the chunked log-prob computation: not with logit
    soft-capping (Gemma 2) or a scaled or non-linear head."""
    head = cast(_PretrainedModel, model).get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    config = getattr(_base_model(model), "config", None)
    scaled = any(
        getattr(config, k, None) not in (None, 1.0, 1)
        for k in ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale")
    )
    return isinstance(head, nn.Linear) and not scaled


class ValueModel(nn.Module):
    """A transformer backbone with a scalar head: one value per position.

    Initialised from any model directory (the policy's or a reward model's); saved as the
    backbone's own files plus `value_head.safetensors`.
    """

    def __init__(self, backbone: nn.Module, hidden_size: int):
        super().__init__()
        self.backbone = backbone
        self.value_head = nn.Linear(hidden_size, 1)
        nn.init.zeros_(self.value_head.weight)
        nn.init.zeros_(self.value_head.bias)

    @classmethod
    def from_pretrained(cls, path: str | Path, dtype: torch.dtype = torch.float32) -> "ValueModel":
        from transformers import AutoModel

        path = check_model_dir(path)
        backbone = AutoModel.from_pretrained(str(path), dtype=dtype)
        model = cls(backbone, backbone.config.hidden_size)
        head = Path(path) / "value_head.safetensors"
        if head.exists():
            from safetensors.torch import load_file

            model.value_head.load_state_dict(load_file(str(head)))
        return model

    @classmethod
    def from_reward_model(cls, path: str | Path, mean: float = 0.0, std: float = 1.0) -> "ValueModel":
        """InstructGPT's critic: the reward model's backbone, and its one-label head as the value
        head rescaled to the normalised reward (weight / std, bias - mean / std), so a value reads
        what the reward model would pay for the text so far, on the scale the returns have."""
        path = check_model_dir(path)
        model = cls.from_pretrained(path)
        weight, bias = reward_head(path)
        with torch.no_grad():
            model.value_head.weight.copy_(weight.reshape(1, -1).float() / std)
            model.value_head.bias.fill_((float(bias) - mean) / std)
        return model

    def save_pretrained(self, path: str | Path) -> None:
        from safetensors.torch import save_file

        Path(path).mkdir(parents=True, exist_ok=True)
        save_model_dir(self.backbone, path)
        save_file(
            {k: v.contiguous() for k, v in self.value_head.state_dict().items()},
            str(Path(path) / "value_head.safetensors"),
        )

    def forward(self, input_ids, attention_mask, position_ids) -> torch.Tensor:
        hidden = self.backbone(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
        ).last_hidden_state
        with torch.autocast(hidden.device.type, enabled=False):  # the head in float32 under bf16 autocast
            return self.value_head(hidden.float()).squeeze(-1)

    def response_values(self, batch: TokenBatch) -> torch.Tensor:
        """V(s_t) for each response position t (B, T): the value of the state before token t."""
        values = self(batch.input_ids, batch.attention_mask, batch.position_ids)
        P = batch.prompt_width
        return values[:, P - 1 : -1] * batch.response_mask


def reward_head(path: str | Path) -> tuple[torch.Tensor, float]:
    """The one-label head of a sequence-classification model directory (such as `rlhf train-rm`
    writes): its weight (hidden,) and bias (0 when it has none), read from the safetensors files."""
    from safetensors import safe_open

    from .model_files import safetensors_files

    found: dict[str, torch.Tensor] = {}
    for file in safetensors_files(path):
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                if key.split(".")[0] in ("score", "classifier") and key.endswith(("weight", "bias")):
                    found[key.rsplit(".", 1)[1]] = f.get_tensor(key)
    if "weight" not in found or found["weight"].numel() != found["weight"].shape[-1]:
        raise ValueError(
            f"{path}: no one-label reward head (score.weight) in its safetensors files; is it a reward model?"
        )
    return found["weight"].reshape(-1), float(found["bias"].reshape(-1)[0]) if "bias" in found else 0.0
