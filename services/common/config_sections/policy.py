"""The policy's sections: the model (and its LoRA), and how the generation servers sample it
(vLLM's own settings among them)."""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import Field, model_validator

from .base import Strict


# ------------------------------------------ the policy (learner and generation)
class LoraConfig(Strict):
    rank: int = Field(
        default=0,
        ge=0,
        description="LoRA rank; 0 trains the full model (with LoRA the KL reference is the base model, adapters off)",
    )
    alpha: float = Field(
        default=16.0, gt=0, description="LoRA scale numerator: the adapters' output is scaled by alpha / rank"
    )
    dropout: float = Field(default=0.0, ge=0, lt=1, description="dropout probability on the adapters' input")
    target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"],
        description="names of the linear layers that get adapters",
    )


class ModelConfig(Strict):
    path: str = Field(
        default="runs/tiny-model",
        description="the policy: a local directory with config, weights and "
        "tokenizer, or a Hugging Face hub id (org/name)",
    )
    device: str = Field(
        default="auto", description="torch device: 'auto' (cuda when available), 'cpu', 'cuda', 'cuda:1', ..."
    )
    bf16: bool = Field(
        default=False,
        description="train in bfloat16 autocast (master weights, optimiser state and the "
        "log-prob head stay float32); generation.dtype auto samples in bfloat16 too",
    )
    reference_path: Optional[str] = Field(
        default=None,
        description="the KL reference (ref_model 'sft'): this model "
        "instead of model.path as loaded; set it to the original SFT model when "
        "model.path is an earlier run's final/ (a branch), or the reference moves "
        "with the policy",
    )
    gradient_checkpointing: bool = Field(
        default=False, description="recompute activations in the backward pass: less memory, more compute"
    )
    lora: LoraConfig = Field(default_factory=LoraConfig, description="LoRA adapters")
    nproc: int = Field(
        default=1,
        ge=1,
        description="learner processes (one per GPU) the actor and its optimiser state "
        "are sharded across with FSDP2; `rlhf serve learner` starts them (gloo on the CPU)",
    )


# ------------------------------------------ the generation server
class VLLMConfig(Strict):
    """Options of vLLM's engine (generation.backend: vllm). The defaults suit one GPU; on the CPU
    build, generation.dtype float32 and a few GiB of KV cache (`cpu_kvcache_space_gb`) are what to set."""

    gpu_memory_utilization: float = Field(
        default=0.85, gt=0, le=1, description="share of the GPU's memory vLLM takes (weights + KV cache)"
    )
    max_model_len: Optional[int] = Field(
        default=None, gt=0, description="longest sequence the engine serves; null = prompt_length + response_length"
    )
    tensor_parallel_size: int = Field(default=1, ge=1, description="GPUs one engine shards the model across")
    enforce_eager: bool = Field(
        default=False, description="no CUDA graphs (slower decoding, faster start, less memory)"
    )
    enable_prefix_caching: bool = Field(
        default=True, description="reuse the KV cache of shared prompt prefixes (reset at every weight swap)"
    )
    cpu_kvcache_space_gb: float = Field(
        default=1.0, gt=0, description="KV cache GiB of the CPU build (VLLM_CPU_KVCACHE_SPACE); unused on a GPU"
    )
    seed: int = Field(default=0, description="engine seed (requests with their own seed use theirs)")

    @model_validator(mode="before")
    @classmethod
    def _moved_keys(cls, data):
        if isinstance(data, dict) and "dtype" in data:
            raise ValueError("generation.vllm.dtype is now generation.dtype (one sampler dtype for either backend)")
        return data


class GenerationConfig(Strict):
    backend: Literal["hf", "vllm"] = Field(
        default="hf",
        description="sampling engine: transformers (CPU or GPU) or vLLM "
        "(its continuous batching; GPU, or its CPU build)",
    )
    temperature: float = Field(default=1.0, gt=0, le=10, description="sampling temperature of training rollouts")
    top_p: float = Field(
        default=1.0,
        gt=0,
        le=1,
        description="nucleus sampling: sample from the most likely tokens holding this much probability; 1 = off",
    )
    top_k: int = Field(default=0, ge=0, description="sample from the k most likely tokens; 0 = off")
    eval_temperature: float = Field(
        default=0.0, ge=0, le=10, description="sampling temperature of the held-out eval; 0 = greedy"
    )
    max_batch_size: int = Field(default=256, ge=1, description="most prompts a generation server decodes in one batch")
    batch_window_ms: float = Field(
        default=5.0,
        ge=0,
        description="milliseconds a generation server waits to batch "
        "concurrent calls together (hf; vLLM batches continuously)",
    )
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = Field(
        default="auto",
        description="the sampler's weights and arithmetic, either backend: auto = bfloat16 with model.bf16, "
        "else float32; float32 with model.bf16 trains in bfloat16 and samples in float32 (docs/speed.md)",
    )
    weight_update: Literal["between_batches", "in_flight"] = Field(
        default="between_batches",
        description="when a generation server takes a pushed version: between_batches = the requests in "
        "flight finish on the old one first (each sample one version); in_flight = between two decoding "
        "steps, the requests in flight go on under the new one (each token records its version; the push "
        "waits one step, not a batch; docs/async.md)",
    )
    in_flight_cache: Literal["recompute", "keep"] = Field(
        default="recompute",
        description="weight_update: in_flight: the keys and values of the requests in flight recomputed "
        "under the new weights (one prefill of prompt + tokens so far; vLLM preempts them) or kept as the "
        "old ones computed them",
    )
    vllm: VLLMConfig = Field(default_factory=VLLMConfig, description="vLLM engine options")

    def engine_dtype(self, bf16: bool) -> str:
        """The sampler's dtype by name: `dtype`, with auto resolved by the learner's model.bf16."""
        return self.dtype if self.dtype != "auto" else ("bfloat16" if bf16 else "float32")
