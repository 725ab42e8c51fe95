"""The Tinker-compatible training API's section (`rlhf serve tinker`, docs/tinker.md): where it
listens, what it serves, what one client can make it hold, and the defaults of what a request
leaves out."""

from __future__ import annotations

from typing import Optional

from pydantic import Field

from .base import Strict


class TinkerConfig(Strict):
    host: str = Field(default="127.0.0.1", description="address the Tinker API binds (0.0.0.0 binds all)")
    port: int = Field(default=8765, ge=0, le=65535, description="its HTTP port; 0 picks a free port")
    model_name: Optional[str] = Field(
        default=None,
        description="the name the one model (model.path) is served under, what a client's base_model "
        "names (e.g. HuggingFaceTB/SmolLM2-135M-Instruct); null = model.path's directory name. model.path "
        "itself is always accepted too",
    )
    root: str = Field(
        default="runs/tinker",
        description="where tinker:// checkpoints live: ROOT/<training run>/weights/<name> (save_state) "
        "and ROOT/<training run>/sampler_weights/<name> (save_weights_for_sampler)",
    )
    generation: Optional[str] = Field(
        default=None,
        description="host:port of a generation server of this API's own (`rlhf serve generation` on the same "
        "model.path, no replay.url) that decodes its samples, each sampler's weights pushed to it as the learner "
        "pushes a policy (hf: the changed tensors; vllm: whole policies); null = an hf generation backend in this "
        "process",
    )
    trainer: Optional[str] = Field(
        default=None,
        description="host:port of a trainer of this API's own (`rlhf serve tinker-trainer` on the same model.path) "
        "that holds its clients' training models and computes their forward_backward and optim_step calls; "
        "null = they train in this process",
    )
    lora_rank: int = Field(
        default=32, ge=0, description="the LoRA rank of a create_model that names none; 0 = full weights"
    )
    max_lora_rank: int = Field(default=128, ge=1, description="the largest LoRA rank a client may ask for")
    lora_alpha: float = Field(
        default=32.0, gt=0, description="LoRA scale numerator of every training model: adapters scaled by alpha / rank"
    )
    learning_rate: float = Field(
        default=1e-4, gt=0, description="AdamW learning rate of an optim_step whose adam_params leave it out"
    )
    adam_betas: tuple[float, float] = Field(
        default=(0.9, 0.95), description="AdamW betas of an optim_step whose adam_params leave them out"
    )
    adam_eps: float = Field(
        default=1e-12, gt=0, description="AdamW eps of an optim_step whose adam_params leave it out"
    )
    max_request_bytes: int = Field(
        default=16_777_216,
        ge=65_536,
        description="largest request body read, in bytes (a forward_backward chunk: the SDK sends at most "
        "about 5 MB); beyond it 413",
    )
    max_datums: int = Field(
        default=1024, ge=1, description="most datums in one forward_backward or forward request; beyond it 400"
    )
    max_datum_tokens: Optional[int] = Field(
        default=None,
        ge=2,
        description="most tokens of one datum (and of a sampling prompt plus its max_tokens); "
        "null = prompt_length + response_length",
    )
    max_samples: int = Field(default=64, ge=1, description="most num_samples of one sample request")
    sample_batch: int = Field(
        default=64,
        ge=1,
        description="most sequences (prompts x num_samples) decoded together: sample requests queued at once on "
        "the same weights with the same sampling parameters share one generate call, up to this many",
    )
    max_sample_tokens: Optional[int] = Field(
        default=None, ge=1, description="most max_tokens of one sample request; null = response_length"
    )
    micro_batch_size: int = Field(
        default=8, ge=1, description="datums per forward (and backward) pass: what bounds activation memory"
    )
    max_sessions: int = Field(
        default=64,
        ge=1,
        description="client sessions held at once; beyond it those silent for session_timeout_s are finished, "
        "else a new one is refused",
    )
    max_models: int = Field(
        default=4, ge=1, description="training models held at once, each a copy of the model with its optimiser"
    )
    session_timeout_s: float = Field(
        default=600.0,
        gt=0,
        description="a session with no request or heartbeat this long (the SDK beats every 10 s) is finished "
        "when room is needed for another session or model: its models and sampling sessions are dropped",
    )
    max_sampling_sessions: int = Field(default=256, ge=1, description="sampling sessions held at once")
    max_sampler_weights: int = Field(
        default=4,
        ge=1,
        description="sampler weights held in memory (each LoRA-merged layer, or the whole model for full "
        "weights); the least recently used beyond it are dropped, a named one reloads from disk",
    )
    max_futures: int = Field(
        default=4096,
        ge=16,
        description="request results kept for retrieve_future and retries; the oldest finished go first; "
        "with all of them pending a new request is answered 429",
    )
    max_result_bytes: int = Field(
        default=1_073_741_824,
        ge=1_048_576,
        description="what the kept results may hold together, in bytes (a forward_backward's is 8 bytes a "
        "token); beyond it the oldest finished go",
    )
    max_queued_per_model: int = Field(
        default=64,
        ge=1,
        description="training requests of one model waiting for their seq_id's turn; beyond it 429",
    )
    poll_hold_s: float = Field(
        default=25.0,
        gt=0,
        le=40,
        description="retrieve_future holds a request for an unfinished result this long, then answers 408 "
        "(the SDK asks again at once; its own timeout is 45 s)",
    )
    seq_wait_s: float = Field(
        default=600.0,
        gt=0,
        description="a training request waits this long for the request before it (seq_id - 1) to "
        "arrive, then fails: a client that skipped a seq_id does not stall its model forever",
    )

    def datum_tokens(self, prompt_length: int, response_length: int) -> int:
        return self.max_datum_tokens or prompt_length + response_length

    def sample_tokens(self, response_length: int) -> int:
        return self.max_sample_tokens or response_length
