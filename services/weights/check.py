"""The one check of a version, whatever brought it (the push stream, shared memory, an in-process
update): its header; every tensor's name, shape and dtype against the model's
(`parameter_specs`); that a "full" version covers every tensor of the model; and that floating
tensors are finite. Anything wrong raises `BadRequest` (a ValueError) before anything is loaded."""

from __future__ import annotations

import math
from typing import Iterable, Mapping

import torch

from ..common.rpc.codec import DTYPE_NAMES, DTYPES
from ..common.rpc.errors import BadRequest, Reason
from ..common.rpc.gen import common_pb2 as pb
from .protocol import COMPLETE_FORMATS, WEIGHT_FORMATS, PushKind

Specs = Mapping[str, tuple[tuple, torch.dtype]]


def tensor_bytes(shape, dtype: torch.dtype) -> int:
    return math.prod(int(s) for s in shape) * torch.empty((), dtype=dtype).element_size()


def check_header(
    h: pb.WeightHeader, specs: Specs | None, max_bytes: int | None, formats: tuple[str, ...] = WEIGHT_FORMATS
) -> None:
    """A version's header (format, one of the transport's `formats`; tensor count, bytes) against
    the model and the size limit."""
    if h.format not in formats:
        raise BadRequest(f"weights.header.format: {h.format!r} is not one of {', '.join(formats)}")
    if h.format == PushKind.DELTA:
        if not 0 <= h.base_policy_version < h.policy_version:
            raise BadRequest(
                f"weights.header.base_policy_version: {h.base_policy_version}, expected in "
                f"[0, policy_version={h.policy_version})"
            )
    elif h.base_policy_version:
        raise BadRequest(f"weights.header.base_policy_version: set in a {h.format!r} version (only 'delta' has one)")
    if h.total_bytes < 0:
        raise BadRequest(f"weights.header.total_bytes: {h.total_bytes} is negative")
    if specs is not None:
        model_bytes = sum(tensor_bytes(shape, dtype) for shape, dtype in specs.values())
        if h.total_bytes > model_bytes:
            raise BadRequest(f"weights.header.total_bytes: {h.total_bytes}, more than the model's {model_bytes} bytes")
        if not 1 <= h.num_tensors <= len(specs):
            raise BadRequest(
                f"weights.header.num_tensors: {h.num_tensors} outside [1, {len(specs)}] (the model's tensors)"
            )
    elif h.num_tensors < 1:
        raise BadRequest(f"weights.header.num_tensors: {h.num_tensors}, expected at least 1")
    if max_bytes is not None and h.total_bytes > max_bytes:
        raise BadRequest(f"weights.header.total_bytes: {h.total_bytes} above the limit {max_bytes}")


def _dtype_name(dtype) -> str:
    return dtype if isinstance(dtype, str) else DTYPE_NAMES.get(dtype, str(dtype))


def check_tensor(name: str, shape, dtype, specs: Specs, where: str) -> None:
    """One tensor's name, shape and dtype (a torch dtype, or its name on the wire) against the model's."""
    if name not in specs:
        raise BadRequest(f"{where}: unknown tensor {name!r}")
    want_shape, want_dtype = specs[name]
    if tuple(shape) != tuple(want_shape):
        raise BadRequest(f"{where}: tensor {name!r} has shape: {list(shape)}, expected {list(want_shape)}")
    if (DTYPES.get(dtype) if isinstance(dtype, str) else dtype) != want_dtype:
        raise BadRequest(
            f"{where}: tensor {name!r} has dtype: {_dtype_name(dtype)}, expected {_dtype_name(want_dtype)}"
        )


def check_coverage(names: Iterable[str], specs: Specs, fmt: str, where: str, what: str = "version") -> None:
    """A "full" (or "delta") version has every tensor of the model ("partial" may have a subset)."""
    if fmt not in COMPLETE_FORMATS:
        return
    names = set(names)
    missing = [k for k in specs if k not in names]
    if missing:
        raise BadRequest(
            f"{where}: a {fmt} {what} without {len(missing)} of the model's tensors: "
            f"{', '.join(missing[:5])}{', ...' if len(missing) > 5 else ''} (format 'partial' "
            f"sends a subset)"
        )


def all_finite(t: torch.Tensor) -> bool:
    """No NaN or infinity in a floating tensor: min and max are finite (both propagate NaN). A
    reduction, ~10x faster than `isfinite(t).all()` and without its tensor-sized temporary."""
    flat = t.reshape(-1)
    if flat.numel() == 0:
        return True
    lo, hi = torch.aminmax(flat)
    return bool(torch.isfinite(lo)) and bool(torch.isfinite(hi))


def check_version(
    state: Mapping[str, torch.Tensor],
    specs: Specs,
    fmt: str | None = None,
    finite: bool = False,
    where: str = "weights",
) -> None:
    """A state dict as a whole: every tensor's name, shape and dtype; with `fmt`, its coverage;
    with `finite`, no NaN or infinity. (The transports run the same checks piece by piece, as the
    bytes arrive, through `check_tensor`, `check_coverage` and `all_finite`.)"""
    for name, t in state.items():
        check_tensor(name, t.shape, t.dtype, specs, where)
    if fmt is not None:
        check_coverage(state, specs, fmt, where)
    if finite:
        for name, t in state.items():
            if t.is_floating_point() and not all_finite(t):
                raise BadRequest(f"{where}: tensor {name!r} contains NaN or infinity")


def check_newer(policy_version: int, serving: int) -> None:
    """Versions only move forward: an older or equal one is refused with `Reason.VERSION_NOT_NEWER`."""
    if policy_version <= serving:
        raise BadRequest(
            f"weights: version {policy_version} is not newer than the serving version {serving}",
            Reason.VERSION_NOT_NEWER,
            field="header.policy_version",
        )
