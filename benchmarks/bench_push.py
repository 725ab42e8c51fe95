"""Benchmark: the learner's weight push over gRPC and through shared memory, against a raw
loopback TCP copy of the same bytes and a memory copy.

    .venv/bin/python benchmarks/bench_push.py            (writes runs/bench/push.json, prints a table)
    .venv/bin/python benchmarks/bench_push.py --quick    (64 and 512 MiB, 2 repeats: about a minute)

For each size (random float32 state dicts of 16 MiB tensors plus a few small ones) and each
server count, in one run on one machine:

- grpc: `Publisher.push` (encode once, fan out to every server in parallel) to N
  in-process generation servers on loopback, end to end: until every server serves the new
  version (assembled, checked, swapped in by the backend);
- shm: the same push to the same servers registered as co-located (`rpc.shm_dir` on a tmpfs,
  /dev/shm): the learner writes the version once (checksummed as it is written), every server
  maps it, checks it (structure, xxh3_64 of every piece, finiteness) and swaps it in; end to end
  as for grpc. The learner's file is recycled from push to push, as in a run;
- tcp: the same bytes sent raw over N loopback TCP connections in parallel, received into
  preallocated buffers (no framing, no checks);
- memcpy: one copy of the state dict into preallocated tensors.

MB/s counts the bytes delivered to all servers (size x N per second); ratios are from the same run.
A case whose copies would not fit `--max-total-gb` is skipped for that method alone.

`--device cuda` (with `--dtype bfloat16`, say) keeps the learner's state dict and the servers'
models on the GPU: a push then starts with the learner's copy to the host (`hostcopy.to_host`, as
`PolicyTrainer.policy_state_dict` does) and ends with each server's copy to its GPU; the row adds
plain device-to-host and host-to-device copy rates (pageable memory), and tcp and memcpy copy
the same bytes on the host.

Backend: a stand-in, not `HFBackend` itself, because the hf backend loads a real model from a
model directory and cannot hold a random state dict of an arbitrary size. The stand-in *is* an
`HFBackend` object whose `model` is a plain `torch.nn.Module` holding tensors of the bench's
shapes, so the push goes through the real `parameter_specs` / `update_weights` (name, shape and
dtype checks, versions only forward, `load_state_dict` copy under the backend lock).
On the CPU the learner's snapshot copy (`take_snapshot` clones CPU parameters) is not part of the
push time; it is reported on its own (snapshot_s), as is the copy to the host on cuda.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import socket
import statistics
import tempfile
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import torch

TENSOR = 4 << 20  # float32 elements per big tensor (16 MiB)


def random_state(nbytes: int, seed: int = 0, dtype=torch.float32, device="cpu") -> dict[str, torch.Tensor]:
    g = torch.Generator(device=device).manual_seed(seed)
    per = TENSOR * 4 // torch.empty((), dtype=dtype).element_size()  # elements of a 16 MiB tensor
    n_big = max(1, nbytes // (TENSOR * 4))
    state = {
        f"layers.{i}.weight": torch.randn(per, generator=g, device=device, dtype=dtype).reshape(2048, -1)
        for i in range(n_big)
    }
    for i in range(4):
        state[f"layers.{i}.bias"] = torch.randn(2048, generator=g, device=device, dtype=dtype)
    return state


class _Holder(torch.nn.Module):
    def __init__(self, state):
        super().__init__()
        self._names = list(state)
        for i, (k, t) in enumerate(state.items()):
            self.register_buffer(f"t{i}", torch.zeros_like(t))

    def state_dict(self, *a, **kw):
        own = super().state_dict(*a, **kw)
        return {name: own[f"t{i}"] for i, name in enumerate(self._names)}

    def load_state_dict(self, state_dict, strict=True, assign=False):
        index = {name: i for i, name in enumerate(self._names)}
        with torch.no_grad():
            for k, v in state_dict.items():
                getattr(self, f"t{index[k]}").copy_(v)


def stand_in_backend(state, device="cpu"):
    from services.generation.backend import HFBackend

    b = HFBackend.__new__(HFBackend)
    b.device = torch.device(device)
    b.model = _Holder(state).to(device)
    b.tokenizer = None
    b.vocab_size = 16
    b.eos_token_id = b.pad_token_id = 0
    b.policy_version = 0
    b._lock = threading.Lock()
    return b


def tcp_copy(payload: memoryview, receivers: int, chunk: int = 4 << 20) -> float:
    """Seconds to send `payload` over `receivers` loopback connections in parallel (into
    preallocated buffers)."""
    n = len(payload)
    listeners, bufs, done = [], [], []
    for _ in range(receivers):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        listeners.append(s)
        bufs.append(bytearray(n))

    def recv(i):
        conn, _ = listeners[i].accept()
        view, got = memoryview(bufs[i]), 0
        while got < n:
            r = conn.recv_into(view[got:], min(chunk, n - got))
            if not r:
                break
            got += r
        done.append(got)
        conn.close()

    def send(i):
        c = socket.create_connection(listeners[i].getsockname())
        for off in range(0, n, chunk):
            c.sendall(payload[off : off + chunk])
        c.shutdown(socket.SHUT_WR)
        c.close()

    rts = [threading.Thread(target=recv, args=(i,)) for i in range(receivers)]
    for t in rts:
        t.start()
    t0 = time.perf_counter()
    sts = [threading.Thread(target=send, args=(i,)) for i in range(receivers)]
    for t in sts:
        t.start()
    for t in sts + rts:
        t.join()
    secs = time.perf_counter() - t0
    assert done == [n] * receivers, done
    for s in listeners:
        s.close()
    return secs


def copy_seconds(state: dict[str, torch.Tensor], device: str, repeats: int) -> float:
    """Median seconds to copy `state` into preallocated tensors on `device` (after one copy that
    touches the pages)."""
    dst = {k: torch.empty(t.shape, dtype=t.dtype, device=device) for k, t in state.items()}
    times = []
    for r in range(repeats + 1):
        t0 = time.perf_counter()
        for k in state:
            dst[k].copy_(state[k])
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        if r:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def timed_pushes(bc, services, repeats: int, policy_version: int) -> tuple[list[float], int, dict]:
    """Seconds of `repeats` pushes (after one warm-up), each until every server serves it."""
    runs, out = [], {}
    for r in range(repeats + 1):  # the first one warms up channels and pages
        policy_version += 1
        t0 = time.perf_counter()
        out = bc.push(policy_version, "learner:0")
        dt = time.perf_counter() - t0
        assert out["push/failed"] == 0, out
        assert all(s.servicer.backend.policy_version == policy_version for s in services)
        if r:
            runs.append(dt)
    return runs, policy_version, out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes-mb", default="64,512,2048")
    ap.add_argument("--servers", default="1,3")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="64 and 512 MiB, 2 repeats")
    ap.add_argument(
        "--max-total-gb",
        type=float,
        default=14.0,
        help="skip a method's (size, servers) case whose resident copies would exceed this",
    )
    ap.add_argument(
        "--shm-dir",
        default="/dev/shm" if Path("/dev/shm").is_dir() else None,
        help="a tmpfs directory for the shm method (a fresh subdirectory is made in it)",
    )
    ap.add_argument(
        "--device",
        default="cpu",
        help="where the learner's and the servers' tensors live (cuda: "
        "the push includes the learner's copy to the host and each server's copy to its GPU)",
    )
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--out", default="runs/bench/push.json")
    args = ap.parse_args()
    if args.quick:
        args.sizes_mb, args.repeats = "64,512", 2

    from services.common.config import config_from_dict
    from services.generation.server import serve
    from services.weights.hostcopy import to_host

    shm_dir = tempfile.mkdtemp(prefix="rlhf-bench-", dir=args.shm_dir)
    cfg = config_from_dict(
        {
            "model": {"path": "unused", "device": "cpu"},
            "rpc": {"shm_dir": shm_dir, "generation": {"port": 0, "metrics_port": None}},
        }
    )
    limit = args.max_total_gb * (1 << 30) + 1
    rows = []
    try:
        for size_mb in [int(s) for s in args.sizes_mb.split(",")]:
            rows += bench_size(size_mb, args, cfg, serve, limit, to_host)
    finally:
        shutil.rmtree(shm_dir, ignore_errors=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(
        json.dumps(
            {
                "rows": rows,
                "cpus": os.cpu_count(),
                "device": args.device,
                "gpu": torch.cuda.get_device_name() if args.device == "cuda" else None,
                "dtype": args.dtype,
            },
            indent=2,
        )
    )
    print(f"wrote {args.out}")


def bench_size(size_mb, args, cfg, serve, limit, to_host) -> list[dict]:
    from services.common.servers import ServerPool
    from services.generation.client import generation_clients
    from services.weights.publisher import Publisher

    state = random_state(size_mb << 20, dtype=getattr(torch, args.dtype), device=args.device)
    host = state if args.device == "cpu" else {k: v.cpu() for k, v in state.items()}
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    memcpy = nbytes / copy_seconds(host, "cpu", args.repeats) / 1e6  # host memory to host memory
    gpu = {}
    if args.device != "cpu":  # the learner's copy to the host, a server's copy to its GPU
        gpu = {
            "d2h_mb_s": nbytes / copy_seconds(state, "cpu", args.repeats) / 1e6,
            "h2d_mb_s": nbytes / copy_seconds(host, args.device, args.repeats) / 1e6,
        }
    to_host(state)  # warms torch's page-locked host cache (a learner's first push)
    t0 = time.perf_counter()
    _ = {k: v.clone() for k, v in state.items()} if args.device == "cpu" else to_host(state)
    snapshot_s = time.perf_counter() - t0
    del _
    rows = []
    for n in [int(s) for s in args.servers.split(",")]:
        # resident copies: the sender's state, each server's model, and per method what it adds
        fits = {
            "grpc": (1 + 2 * n) * nbytes <= limit,
            "shm": (2 + n) * nbytes <= limit,
            "tcp": (2 + n) * nbytes <= limit,
        }
        row = {
            "size_mb": round(nbytes / 2**20),
            "servers": n,
            "bytes": nbytes,
            "memcpy_mb_s": memcpy,
            "snapshot_s": snapshot_s,
            **gpu,
        }
        if fits["grpc"] or fits["shm"]:
            services = [serve(cfg, backend=stand_in_backend(state, args.device)).start() for _ in range(n)]
            entries = {f"127.0.0.1:{s.server.port}": s.servicer.registry_info() for s in services}
            # as PolicyTrainer.policy_state_dict: the weights on the host (from a GPU through page-locked memory)
            learner = SimpleNamespace(
                policy_state_dict=lambda: to_host(state), device=torch.device(args.device), lora=True
            )
            policy_version = 0
            for method in ("grpc", "shm"):
                if not fits[method]:
                    print(f"skip {size_mb} MB x {n} servers {method} (memory)")
                    continue
                # grpc: the same servers, without the probe in their registry entry (so not co-located)
                live = {a: {**e, "shm": e["shm"] if method == "shm" else ""} for a, e in entries.items()}
                store = SimpleNamespace(
                    live=lambda kind, live=live: live,
                    heartbeat=lambda *a, **kw: None,
                    publish_learner=lambda *a, **kw: None,
                )
                bc = Publisher(
                    cfg,
                    store,
                    learner,
                    ServerPool(lambda store=store: store.live("generation"), generation_clients(cfg.rpc), 1.0),
                )
                bc.identity = ("bench", 1)
                runs, policy_version, out = timed_pushes(bc, services, args.repeats, policy_version)
                assert out["push/shm"] == (n if method == "shm" else 0), out
                check = services[-1].servicer.backend.model.state_dict()
                assert all(torch.equal(check[k], state[k]) for k in state)
                del check
                bc.close()
                bc.servers.close()
                s = statistics.median(runs)
                row.update({f"{method}_s": s, f"{method}_mb_s": nbytes * n / s / 1e6, f"{method}_runs_s": runs})
            for s in services:
                s.stop()
            del services, learner, bc, store
            gc.collect()  # the stopped servers' models, before the next case allocates its own
        if fits["tcp"]:
            flat = torch.cat([t.reshape(-1) for t in host.values()])
            payload = memoryview(flat.view(torch.uint8).numpy())
            tcp_copy(payload, n)  # warm-up
            tcp_s = statistics.median([tcp_copy(payload, n) for _ in range(args.repeats)])
            row.update({"tcp_s": tcp_s, "tcp_mb_s": nbytes * n / tcp_s / 1e6})
            del flat, payload
        for method in ("grpc", "shm"):
            if f"{method}_s" in row:
                row[f"{method}_vs_memcpy"] = row[f"{method}_mb_s"] / memcpy
                if "tcp_s" in row:
                    row[f"{method}_vs_tcp"] = row["tcp_s"] / row[f"{method}_s"]
        rows.append(row)
        cell = lambda k: f"{row[k]:8.0f}" if k in row else "       -"  # noqa: E731
        print(
            f"{row['size_mb']:>6} MiB x{n}: grpc {cell('grpc_mb_s')} MB/s  shm {cell('shm_mb_s')} MB/s  "
            f"tcp {cell('tcp_mb_s')} MB/s  memcpy {memcpy:8.0f} MB/s  (snapshot {snapshot_s:.2f}s)"
            + (f"  d2h {gpu['d2h_mb_s']:8.0f} MB/s  h2d {gpu['h2d_mb_s']:8.0f} MB/s" if gpu else ""),
            flush=True,
        )
    return rows


if __name__ == "__main__":
    main()
