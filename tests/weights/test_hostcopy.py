"""Weight copies between a GPU and the host (services/weights/hostcopy.py). The CPU cases run
everywhere; the CUDA cases need a GPU (CI has none: they ran on a lent H100, see
docs/measurements.md)."""

import mmap
import os

import pytest
import torch

from services.weights import hostcopy
from services.weights.hostcopy import copy_to_device, to_host

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _state(device, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(300, 70, generator=g).to(device),
        "b": torch.randn(11, generator=g).to(device),
        "h": torch.randn(5, 9, generator=g).to(torch.bfloat16).to(device),
        "i": torch.arange(7).to(device),
        "flag": torch.tensor([True, False]).to(device),
        "empty": torch.zeros(0, 4).to(device),
    }


def test_to_host_keeps_host_tensors_without_a_copy():
    state = {k: v.requires_grad_(v.is_floating_point()) for k, v in _state("cpu").items()}
    out = to_host(state)
    assert list(out) == list(state)
    for k, v in out.items():
        assert v.data_ptr() == state[k].data_ptr() and not v.requires_grad


def test_copy_to_device_on_the_host_is_a_plain_copy():
    src, dst = _state("cpu", 1), {k: torch.empty_like(v) for k, v in _state("cpu").items()}
    copy_to_device((dst[k], v) for k, v in src.items())
    assert all(torch.equal(dst[k], src[k]) for k in src)


@cuda
def test_to_host_copies_a_gpu_state_into_page_locked_memory():
    state = _state("cuda")
    out = to_host(state)
    for k, v in out.items():
        assert v.device.type == "cpu" and (v.is_pinned() or not v.numel()) and v.dtype == state[k].dtype
        assert torch.equal(v, state[k].cpu())
    before = out["w"].clone()
    state["w"].add_(1)  # the snapshot is a copy: training on does not change it
    assert torch.equal(out["w"], before)
    strided = {"t": torch.randn(64, 32, device="cuda").t()}
    assert torch.equal(to_host(strided)["t"], strided["t"].cpu())


@cuda
def test_copy_to_device_stages_through_page_locked_buffers(monkeypatch, tmp_path):
    """Many chunks, both buffers in turn, sources in a file mapping (a co-located push), a strided
    and a pinned source, another dtype: every destination equals its source."""
    monkeypatch.setattr(hostcopy, "STAGE_BYTES", 4096)
    src = _state("cpu", 2)
    flat = torch.cat([src["w"].reshape(-1), src["b"]])
    path = tmp_path / "w.bin"
    flat.numpy().tofile(path)
    fd = os.open(path, os.O_RDONLY)
    mm = mmap.mmap(fd, flat.numel() * 4, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    os.close(fd)
    mapped = torch.frombuffer(mm, dtype=torch.float32)
    src["w"], src["b"] = mapped[: src["w"].numel()].view(300, 70), mapped[src["w"].numel() :]
    src["strided"] = torch.randn(40, 30).t()
    src["pinned"] = torch.randn(1000).pin_memory()
    dst = {
        k: torch.full(v.shape, 7, dtype=v.dtype, device="cuda")
        if v.dtype != torch.bool
        else torch.zeros(v.shape, dtype=torch.bool, device="cuda")
        for k, v in src.items()
    }
    copy_to_device((dst[k], v) for k, v in src.items())
    for k, v in src.items():
        assert torch.equal(dst[k].cpu(), v), k
    del mapped, src


@cuda
def test_hf_backend_on_a_gpu_serves_pushed_weights(tiny_model_dir):
    """A GPU generation server's swap (page-locked staging) gives the pushed weights exactly."""
    from services.common.model_files import load_causal_lm
    from services.generation.backend import HFBackend

    backend = HFBackend(tiny_model_dir, "cuda")
    model = load_causal_lm(tiny_model_dir, "cpu")
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.01)
    new = {k: v.clone() for k, v in model.state_dict().items()}
    backend.update_weights(new, 1)
    served = backend.model.state_dict()
    assert backend.policy_version == 1
    assert all(torch.equal(served[k].cpu(), v) for k, v in new.items())
