from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Tensor(_message.Message):
    __slots__ = ("dtype", "shape", "data")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    def __init__(self, dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ...) -> None: ...

class TokenBatch(_message.Message):
    __slots__ = ("input_ids", "attention_mask", "position_ids", "response_mask", "prompt_width")
    INPUT_IDS_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_MASK_FIELD_NUMBER: _ClassVar[int]
    POSITION_IDS_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_MASK_FIELD_NUMBER: _ClassVar[int]
    PROMPT_WIDTH_FIELD_NUMBER: _ClassVar[int]
    input_ids: Tensor
    attention_mask: Tensor
    position_ids: Tensor
    response_mask: Tensor
    prompt_width: int
    def __init__(self, input_ids: _Optional[_Union[Tensor, _Mapping]] = ..., attention_mask: _Optional[_Union[Tensor, _Mapping]] = ..., position_ids: _Optional[_Union[Tensor, _Mapping]] = ..., response_mask: _Optional[_Union[Tensor, _Mapping]] = ..., prompt_width: _Optional[int] = ...) -> None: ...

class WeightChunk(_message.Message):
    __slots__ = ("header", "piece", "footer")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    PIECE_FIELD_NUMBER: _ClassVar[int]
    FOOTER_FIELD_NUMBER: _ClassVar[int]
    header: WeightHeader
    piece: TensorPiece
    footer: WeightFooter
    def __init__(self, header: _Optional[_Union[WeightHeader, _Mapping]] = ..., piece: _Optional[_Union[TensorPiece, _Mapping]] = ..., footer: _Optional[_Union[WeightFooter, _Mapping]] = ...) -> None: ...

class WeightHeader(_message.Message):
    __slots__ = ("policy_version", "format", "num_tensors", "total_bytes", "run_id", "epoch", "base_policy_version")
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    FORMAT_FIELD_NUMBER: _ClassVar[int]
    NUM_TENSORS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    BASE_POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    policy_version: int
    format: str
    num_tensors: int
    total_bytes: int
    run_id: str
    epoch: int
    base_policy_version: int
    def __init__(self, policy_version: _Optional[int] = ..., format: _Optional[str] = ..., num_tensors: _Optional[int] = ..., total_bytes: _Optional[int] = ..., run_id: _Optional[str] = ..., epoch: _Optional[int] = ..., base_policy_version: _Optional[int] = ...) -> None: ...

class TensorPiece(_message.Message):
    __slots__ = ("name", "dtype", "shape", "offset", "total_bytes", "data", "crc32", "xxh3", "encoding", "raw_bytes")
    class Encoding(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        RAW: _ClassVar[TensorPiece.Encoding]
        XOR_PLANES_ZSTD: _ClassVar[TensorPiece.Encoding]
    RAW: TensorPiece.Encoding
    XOR_PLANES_ZSTD: TensorPiece.Encoding
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    CRC32_FIELD_NUMBER: _ClassVar[int]
    XXH3_FIELD_NUMBER: _ClassVar[int]
    ENCODING_FIELD_NUMBER: _ClassVar[int]
    RAW_BYTES_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    offset: int
    total_bytes: int
    data: bytes
    crc32: int
    xxh3: int
    encoding: TensorPiece.Encoding
    raw_bytes: int
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., offset: _Optional[int] = ..., total_bytes: _Optional[int] = ..., data: _Optional[bytes] = ..., crc32: _Optional[int] = ..., xxh3: _Optional[int] = ..., encoding: _Optional[_Union[TensorPiece.Encoding, str]] = ..., raw_bytes: _Optional[int] = ...) -> None: ...

class WeightFooter(_message.Message):
    __slots__ = ("sha256",)
    SHA256_FIELD_NUMBER: _ClassVar[int]
    sha256: str
    def __init__(self, sha256: _Optional[str] = ...) -> None: ...

class PushWeightsResponse(_message.Message):
    __slots__ = ("policy_version", "bytes", "seconds", "swap_wait_seconds", "swap_seconds")
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    SWAP_WAIT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    SWAP_SECONDS_FIELD_NUMBER: _ClassVar[int]
    policy_version: int
    bytes: int
    seconds: float
    swap_wait_seconds: float
    swap_seconds: float
    def __init__(self, policy_version: _Optional[int] = ..., bytes: _Optional[int] = ..., seconds: _Optional[float] = ..., swap_wait_seconds: _Optional[float] = ..., swap_seconds: _Optional[float] = ...) -> None: ...
