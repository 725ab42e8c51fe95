"""Replicas of one scaled generation service take one GPU each (services/generation/gpu_slot.py):
real processes contending for real `flock`s in a shared directory, as containers on one volume do.
No GPU is needed: the slot is what CUDA_VISIBLE_DEVICES is set to before CUDA starts."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from services.generation.gpu_slot import claim_gpu, visible_gpus

ROOT = Path(__file__).resolve().parents[2]
HOLD = (
    "import os, sys, time; from services.generation.gpu_slot import claim_gpu; "
    "slot = claim_gpu(sys.argv[1]); print(slot, os.environ.get('CUDA_VISIBLE_DEVICES'), flush=True); "
    "time.sleep(60)"
)


def _replica(claim_dir, gpus: str) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    return subprocess.Popen(
        [sys.executable, "-c", HOLD, str(claim_dir)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**env, "NVIDIA_VISIBLE_DEVICES": gpus},
    )


def test_visible_gpus_reads_what_docker_sets():
    assert visible_gpus({"NVIDIA_VISIBLE_DEVICES": "0,1, 3"}) == ["0", "1", "3"]
    for unknown in ("", "all", "void"):
        assert visible_gpus({"NVIDIA_VISIBLE_DEVICES": unknown}) == []
    assert visible_gpus({}) == []


def test_each_replica_takes_its_own_gpu_and_a_dead_one_frees_it(tmp_path):
    replicas = [_replica(tmp_path, "4,5"), _replica(tmp_path, "4,5")]
    try:
        got = [tuple(p.stdout.readline().split()) for p in replicas]
        assert sorted(got) == [("0", "0"), ("1", "1")], [p.stderr.read() for p in replicas if p.poll() is not None]
        # a third replica finds both taken: a clear error, not a second process on a busy GPU
        with pytest.raises(RuntimeError, match="scale generation to at most 2"):
            claim_gpu(tmp_path, {"NVIDIA_VISIBLE_DEVICES": "4,5"})
        # the first replica dies (a crash): its replacement gets the slot it held
        replicas[0].kill()
        replicas[0].wait(10)
        env, slot, deadline = {"NVIDIA_VISIBLE_DEVICES": "4,5"}, None, time.time() + 10
        while slot is None and time.time() < deadline:
            try:
                slot = claim_gpu(tmp_path, env)
            except RuntimeError:
                time.sleep(0.1)
        assert slot == int(got[0][0]) and env["CUDA_VISIBLE_DEVICES"] == got[0][0]
    finally:
        for p in replicas:
            p.kill()
            p.wait(10)


def test_nothing_to_choose_leaves_the_environment_alone(tmp_path):
    one = {"NVIDIA_VISIBLE_DEVICES": "2"}
    assert claim_gpu(tmp_path, one) is None and "CUDA_VISIBLE_DEVICES" not in one
    chosen = {"NVIDIA_VISIBLE_DEVICES": "0,1", "CUDA_VISIBLE_DEVICES": "1"}
    assert claim_gpu(tmp_path, chosen) is None and chosen["CUDA_VISIBLE_DEVICES"] == "1"
    assert claim_gpu(tmp_path, {}) is None
