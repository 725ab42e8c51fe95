"""The Tinker SDK's protobuf wire format, read and written with the SDK's own compiled module
(`tinker.proto.tinker_public_pb2`): a forward_backward request in (`read_forward_backward`), its
result and a sample's result out (`forward_backward_output`, `sample_response`).

Reading checks every byte that reaches torch: the datums' count and tokens against `Limits`,
token ids inside the vocabulary, each loss input 1-D with one value per input token, of the dtype
its name wants, finite. A request that fails any of them is an `ApiError` (400) naming the
datum and the field, before anything is queued."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from google.protobuf.message import DecodeError
from tinker.proto import tinker_public_pb2 as pb

from .protocol import ApiError

TOKEN_INPUTS = frozenset({"target_tokens"})  # loss inputs that hold token ids (int64)
_DTYPES = {pb.DTYPE_FLOAT32: np.float32, pb.DTYPE_INT64: np.int64, pb.DTYPE_INT32: np.int32}


@dataclass(frozen=True)
class Limits:
    max_datums: int
    max_tokens: int  # of one datum
    vocab_size: int


@dataclass
class Datum:
    """One datum: its input tokens (int64, n) and its loss inputs, each (n,) (token ids int64,
    the rest float32)."""

    tokens: np.ndarray
    inputs: dict[str, np.ndarray]


@dataclass
class ForwardBackward:
    model_id: str
    seq_id: int
    loss_fn: str
    config: dict[str, float | str]
    forward_only: bool
    data: list[Datum]


def read_forward_backward(body: bytes, limits: Limits) -> ForwardBackward:
    msg = pb.ForwardBackwardRequest()
    try:
        msg.ParseFromString(body)
    except DecodeError:
        raise ApiError(400, "the body is not a ForwardBackwardRequest protobuf (Content-Type: application/x-protobuf)")
    if not 1 <= len(msg.data) <= limits.max_datums:
        raise ApiError(
            400,
            f"data: {len(msg.data)} datums; this server takes 1 to {limits.max_datums} per request (tinker.max_datums)",
            param="data",
        )
    data = [_datum(i, d, limits) for i, d in enumerate(msg.data)]
    return ForwardBackward(msg.model_id, msg.seq_id, msg.loss_fn, _loss_config(msg), msg.forward_only, data)


def _loss_config(msg: pb.ForwardBackwardRequest) -> dict[str, float | str]:
    """loss_fn_config: the v2 map (numbers and text) when the client sent one, else the legacy
    float map; every number finite."""
    config: dict[str, float | str] = {}
    if msg.loss_fn_config_v2:
        for k, v in msg.loss_fn_config_v2.items():
            config[k] = v.text if v.WhichOneof("value") == "text" else v.number
    else:
        config.update(msg.loss_fn_config.items())
    for k, v in config.items():
        if isinstance(v, float) and not math.isfinite(v):
            raise ApiError(400, f"loss_fn_config.{k[:64]}: not a finite number", param=f"loss_fn_config.{k[:64]}")
    return config


def _datum(i: int, d: pb.Datum, limits: Limits) -> Datum:
    tokens = _tokens(i, d, limits)
    inputs = {name: _loss_input(i, name, t, len(tokens), limits) for name, t in d.loss_fn_inputs.items()}
    return Datum(tokens, inputs)


def _tokens(i: int, d: pb.Datum, limits: Limits) -> np.ndarray:
    parts = []
    for chunk in d.model_input:
        if chunk.WhichOneof("chunk") != "encoded_text":
            raise ApiError(400, f"data[{i}].model_input: only encoded_text chunks (tokens) are supported", "data")
        raw = chunk.encoded_text.tokens
        if len(raw) % 4:
            raise ApiError(400, f"data[{i}].model_input: tokens are int32, {len(raw)} bytes is no whole number", "data")
        parts.append(np.frombuffer(raw, dtype="<i4"))
    tokens = np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, np.int64)
    if not 1 <= len(tokens) <= limits.max_tokens:
        raise ApiError(
            400,
            f"data[{i}].model_input: {len(tokens)} tokens; a datum has 1 to {limits.max_tokens} "
            "(tinker.max_datum_tokens)",
            param="data",
        )
    _in_vocabulary(tokens, limits.vocab_size, f"data[{i}].model_input")
    return tokens


def _in_vocabulary(ids: np.ndarray, vocab_size: int, where: str) -> None:
    bad = (ids < 0) | (ids >= vocab_size)
    if bad.any():
        at = int(np.argmax(bad))
        raise ApiError(
            400, f"{where}[{at}]: token id {int(ids[at])} is outside the vocabulary (0 to {vocab_size - 1})", "data"
        )


def _loss_input(i: int, name: str, t: pb.Tensor, n: int, limits: Limits) -> np.ndarray:
    where = f"data[{i}].loss_fn_inputs.{name[:64]}"
    if t.WhichOneof("encoding") != "dense":
        raise ApiError(400, f"{where}: only dense 1-D tensors are supported (no sparse 2-D inputs)", "data")
    dtype = _DTYPES.get(t.dtype)
    if dtype is None:
        raise ApiError(400, f"{where}: dtype {t.dtype} is not float32, int64 or int32", "data")
    itemsize = np.dtype(dtype).itemsize
    if len(t.dense) != n * itemsize or list(t.shape) not in ([], [n]):
        raise ApiError(400, f"{where}: needs one value per input token ({n}), 1-D; got shape {list(t.shape)}", "data")
    values = np.frombuffer(t.dense, dtype=np.dtype(dtype).newbyteorder("<"))
    if name in TOKEN_INPUTS:
        if dtype is np.float32:
            raise ApiError(400, f"{where}: token ids are int64 (or int32), not float32", "data")
        ids = values.astype(np.int64)
        _in_vocabulary(ids, limits.vocab_size, where)
        return ids
    out = values.astype(np.float32)
    if not np.isfinite(out).all():
        raise ApiError(400, f"{where}[{int(np.argmax(~np.isfinite(out)))}]: NaN or infinity", "data")
    return out


def _batched(arrays: list[np.ndarray]) -> pb.BatchedTensor:
    """Per-datum float32 1-D arrays as one BatchedTensor: their bytes back to back, each datum's
    byte offsets (num_datums + 1)."""
    arrays = [np.ascontiguousarray(a, dtype="<f4") for a in arrays]
    offsets = np.cumsum([0, *(a.nbytes for a in arrays)]).astype("<i8")
    return pb.BatchedTensor(
        data=b"".join(a.tobytes() for a in arrays), offsets=offsets.tobytes(), dtype=pb.DTYPE_FLOAT32
    )


def forward_backward_output(fields: dict[str, list[np.ndarray]], metrics: dict[str, float]) -> bytes:
    """The result of a forward_backward: per datum each field (`logprobs`, `elementwise_loss`: one
    float per input token), and metrics named `name:reduction` (how the SDK merges chunks)."""
    n = len(next(iter(fields.values())))
    record = pb.ArrayRecord(num_datums=n)
    for name, arrays in fields.items():
        record.fields[name].CopyFrom(_batched(arrays))
    out = pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord", loss_fn_outputs=[record])
    for k, v in metrics.items():
        out.metrics[k] = float(v)
    return out.SerializeToString()


@dataclass
class Sequence:
    """One sampled sequence: its tokens, their log-probs, and whether a stop ended it."""

    tokens: list[int]
    logprobs: list[float]
    stopped: bool


def sample_response(sequences: list[Sequence], prompt_logprobs: list[float] | None) -> bytes:
    """A sample's result; `prompt_logprobs` (NaN for the first token, which nothing predicts)
    when asked."""
    out = pb.SampleResponse()
    for s in sequences:
        out.sequences.add(
            stop_reason=pb.STOP_REASON_STOP if s.stopped else pb.STOP_REASON_LENGTH,
            tokens=np.asarray(s.tokens, dtype="<i4").tobytes(),
            logprobs=np.asarray(s.logprobs, dtype="<f4").tobytes(),
        )
    if prompt_logprobs is not None:
        out.prompt_logprobs = np.asarray(prompt_logprobs, dtype="<f4").tobytes()
    return out.SerializeToString()
