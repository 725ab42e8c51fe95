"""The Tinker API's JSON requests as the server reads them, and its one error.

Each model checks at the edge what is range-checkable without the server's state: ids are
bounded printable ASCII, seq ids fit the SDK's int32, floats are finite (`allow_inf_nan=False`),
integers that reach torch fit an int64. What depends on the server (the vocabulary, the
configured limits, whether a model exists) is checked by `api.py` before any work is queued.
Fields the server does not use are ignored, so a newer SDK's additions do not break it.

The ids this process hands out carry its incarnation (`Ids`): an id of an earlier process (the
server restarted) is told apart from one that never existed, and answered so."""

from __future__ import annotations

import itertools
import re
import secrets
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StringConstraints

INT32_MAX = 2**31 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


class ApiError(Exception):
    """A request the server refuses: its HTTP status, a sentence saying why (and what to do), the
    request field at fault and a machine-readable code. Answered in the one error shape
    (common/rpc/http_guard.py) at the edge, or as a failed future's result once queued."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


STATE_CHUNK = 1 << 20  # bytes of a saved state per message between the API and its trainer


class Request(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False, protected_namespaces=())


Id = Annotated[str, StringConstraints(min_length=1, max_length=256, pattern=r"^[\x21-\x7e]+$")]
SeqId = Annotated[int, Field(ge=0, le=INT32_MAX)]
Int64 = Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)]
Text = Annotated[str, StringConstraints(max_length=4096)]


class CreateSession(Request):
    tags: list[Annotated[str, StringConstraints(max_length=256)]] = Field(default_factory=list, max_length=64)
    user_metadata: Optional[dict[str, Any]] = None


class SessionRef(Request):
    session_id: Id


class LoraSpec(Request):
    rank: int = Field(ge=0, le=INT32_MAX)
    seed: Optional[Int64] = None
    train_unembed: bool = True
    train_mlp: bool = True
    train_attn: bool = True


class CreateModel(Request):
    session_id: Id
    model_seq_id: SeqId
    base_model: Text
    lora_config: Optional[LoraSpec] = None
    user_metadata: Optional[dict[str, Any]] = None
    optimizer_config: Optional[dict[str, Any]] = None


class ModelRef(Request):
    model_id: Id


class AdamSpec(Request):
    learning_rate: Optional[float] = Field(default=None, ge=0, le=10)
    beta1: Optional[float] = Field(default=None, ge=0, lt=1)
    beta2: Optional[float] = Field(default=None, ge=0, lt=1)
    eps: Optional[float] = Field(default=None, gt=0, le=1)
    weight_decay: float = Field(default=0.0, ge=0, le=10)
    grad_clip_norm: float = Field(default=0.0, ge=0)


class OptimStep(Request):
    model_id: Id
    seq_id: SeqId
    adam_params: Optional[AdamSpec] = None
    optimizer_params: Optional[dict[str, Any]] = None


Name = Annotated[str, StringConstraints(min_length=1, max_length=128)]


class SaveWeights(Request):
    model_id: Id
    seq_id: SeqId
    path: Name
    overwrite: bool = False


class SaveForSampler(Request):
    model_id: Id
    seq_id: SeqId
    path: Optional[Name] = None
    sampling_session_seq_id: Optional[SeqId] = None


class LoadWeights(Request):
    path: Text
    optimizer: bool = False
    model_id: Optional[Id] = None  # the legacy form: into an existing model, in its seq_id order
    seq_id: Optional[SeqId] = None
    session_id: Optional[Id] = None  # the SDK's form: a new model from the checkpoint
    model_seq_id: Optional[SeqId] = None


class CreateSamplingSession(Request):
    session_id: Id
    sampling_session_seq_id: SeqId
    base_model: Optional[Text] = None
    model_path: Optional[Text] = None


class Chunk(Request):
    type: Annotated[str, StringConstraints(max_length=64)]
    tokens: Optional[list[StrictInt]] = None


class ModelInput(Request):
    chunks: list[Chunk] = Field(max_length=1024)


class SampleParams(Request):
    max_tokens: Optional[int] = Field(default=None, ge=1, le=INT32_MAX)
    seed: Optional[Int64] = None
    stop: Union[
        Annotated[str, StringConstraints(min_length=1, max_length=256)],
        list[Annotated[str, StringConstraints(min_length=1, max_length=256)]],
        list[StrictInt],
        None,
    ] = Field(default=None, union_mode="left_to_right")
    temperature: float = Field(default=1.0, ge=0, le=10)
    top_k: int = Field(default=-1, ge=-1, le=INT32_MAX)
    top_p: float = Field(default=1.0, gt=0, le=1)


class Sample(Request):
    prompt: ModelInput
    sampling_params: SampleParams
    num_samples: int = Field(default=1, ge=1, le=INT32_MAX)
    sampling_session_id: Optional[Id] = None
    base_model: Optional[Text] = None
    model_path: Optional[Text] = None
    seq_id: Optional[SeqId] = None
    prompt_logprobs: Optional[bool] = None
    topk_prompt_logprobs: int = Field(default=0, ge=0, le=INT32_MAX)
    topk_sample_logprobs: int = Field(default=0, ge=0, le=INT32_MAX)
    prompt_alt_tokens_k: int = Field(default=0, ge=0, le=INT32_MAX)
    target_prompt_logprobs: Optional[Any] = None


class Retrieve(Request):
    request_id: Id
    allow_metadata_only: bool = False


class Ids:
    """The ids this process hands out: `<incarnation>-<kind><n>` for sessions and requests (a model
    is `<session>:train:<n>`, a sampling session `<session>:sample:<n>`, as the SDK derives them).
    The incarnation is new at every start."""

    FORM = re.compile(r"^([0-9a-f]{8})-[a-z]\d+(:|$)")

    def __init__(self) -> None:
        self.incarnation = secrets.token_hex(4)
        self._n = itertools.count()

    def new(self, kind: Literal["s", "r"]) -> str:
        return f"{self.incarnation}-{kind}{next(self._n)}"

    def earlier(self, any_id: str) -> bool:
        """Whether `any_id` is one an earlier process of this server handed out (it restarted since)."""
        m = self.FORM.match(any_id)
        return m is not None and m.group(1) != self.incarnation
