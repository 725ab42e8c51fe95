"""Benchmark: the learner's weight push over gRPC against a raw loopback TCP copy of the same bytes.

    .venv/bin/python benchmarks/bench_push.py            (writes runs/bench/push.json, prints a table)

For each size (random float32 state dicts of 16 MiB tensors plus a few small ones) and each
server count, in one run on one machine:

- grpc: `WeightBroadcaster.push` (encode once, fan out to every server in parallel) to N
  in-process generation servers on loopback, end to end: until every server serves the new
  version (assembled, checked, swapped in by the backend);
- tcp: the same bytes sent raw over N loopback TCP connections in parallel, received into
  preallocated buffers (no framing, no checks);
- memcpy: one copy of the state dict into preallocated tensors.

MB/s counts the bytes delivered to all servers (size x N per second); ratios are from the same run.

Backend: a stand-in, not `HFBackend` itself, because the hf backend loads a real model from a
model directory and cannot hold a random state dict of an arbitrary size. The stand-in *is* an
`HFBackend` object whose `model` is a plain `torch.nn.Module` holding tensors of the bench's
shapes, so the push goes through the real `parameter_specs` / `update_weights` (name, shape and
dtype checks, versions only forward, `load_state_dict` copy under the backend lock).
The learner's snapshot copy (`take_snapshot` clones CPU parameters) is not part of the grpc
time; it is reported on its own (snapshot_s).
"""
from __future__ import annotations

import argparse
import json
import socket
import statistics
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import torch

TENSOR = 4 << 20  # float32 elements per big tensor (16 MiB)


def random_state(nbytes: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    n_big = max(1, nbytes // (TENSOR * 4))
    state = {f"layers.{i}.weight": torch.randn(TENSOR, generator=g).reshape(2048, -1) for i in range(n_big)}
    for i in range(4):
        state[f"layers.{i}.bias"] = torch.randn(2048, generator=g)
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


def stand_in_backend(state):
    from services.generation.backend import HFBackend
    b = HFBackend.__new__(HFBackend)
    b.device = torch.device("cpu")
    b.model = _Holder(state)
    b.tokenizer = None
    b.vocab_size = 16
    b.eos_token_id = b.pad_token_id = 0
    b.version = 0
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
            c.sendall(payload[off:off + chunk])
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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes-mb", default="64,512,2048")
    ap.add_argument("--servers", default="1,3")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-total-gb", type=float, default=14.0,
                    help="skip a (size, servers) case whose resident copies would exceed this")
    ap.add_argument("--out", default="runs/bench/push.json")
    args = ap.parse_args()
    torch.set_num_threads(2)

    from services.common.config import config_from_dict
    from services.generation.server import serve
    from services.learner.broadcast import WeightBroadcaster

    cfg = config_from_dict({"model": {"path": "unused", "device": "cpu"}})
    rows = []
    for size_mb in [int(s) for s in args.sizes_mb.split(",")]:
        state = random_state(size_mb << 20)
        nbytes = sum(t.numel() * t.element_size() for t in state.values())
        flat = torch.cat([t.reshape(-1) for t in state.values()])
        payload = memoryview(flat.view(torch.uint8).numpy())
        dst = {k: torch.empty_like(t) for k, t in state.items()}
        for k in state:
            dst[k].copy_(state[k])  # touch the pages once
        memcpy_s = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            for k in state:
                dst[k].copy_(state[k])
            memcpy_s.append(time.perf_counter() - t0)
        del dst
        t0 = time.perf_counter()
        _ = {k: v.clone() for k, v in state.items()}
        snapshot_s = time.perf_counter() - t0
        del _
        memcpy = nbytes / statistics.median(memcpy_s) / 1e6
        for n in [int(s) for s in args.servers.split(",")]:
            if (1 + 3 * n) * nbytes > args.max_total_gb * (1 << 30) + 1:  # sender + per server: model, staging, tcp buf
                print(f"skip {size_mb} MB x {n} servers (memory)")
                continue
            services = [serve(cfg, backend=stand_in_backend(state), port=0, metrics_port=None).start()
                        for _ in range(n)]
            addresses = [f"127.0.0.1:{s.server.port}" for s in services]
            store = SimpleNamespace(live=lambda kind: {a: {} for a in addresses},
                                    heartbeat=lambda *a, **kw: None, publish_learner=lambda *a, **kw: None)
            learner = SimpleNamespace(policy_state_dict=lambda: state, device=torch.device("cpu"), lora=True)
            bc = WeightBroadcaster(cfg, store, learner)
            grpc_s, version = [], 0
            for r in range(args.repeats + 1):  # the first one warms up channels and pages
                version += 1
                t0 = time.perf_counter()
                out = bc.push(version, "learner:0")
                dt = time.perf_counter() - t0
                assert out["push/failed"] == 0, out
                assert all(s.servicer.backend.version == version for s in services)
                if r:
                    grpc_s.append(dt)
            check = services[-1].servicer.backend.model.state_dict()
            assert all(torch.equal(check[k], state[k]) for k in state)
            bc.close()
            for s in services:
                s.stop()
            del services, check
            tcp_copy(payload, n)  # warm-up
            tcp_s = statistics.median([tcp_copy(payload, n) for _ in range(args.repeats)])
            g = statistics.median(grpc_s)
            row = {"size_mb": round(nbytes / 2 ** 20), "servers": n, "bytes": nbytes,
                   "grpc_s": g, "grpc_mb_s": nbytes * n / g / 1e6, "tcp_s": tcp_s,
                   "tcp_mb_s": nbytes * n / tcp_s / 1e6, "memcpy_mb_s": memcpy,
                   "grpc_vs_tcp": tcp_s / g, "grpc_vs_memcpy": nbytes * n / g / 1e6 / memcpy,
                   "snapshot_s": snapshot_s, "grpc_runs_s": grpc_s}
            rows.append(row)
            print(f"{row['size_mb']:>6} MiB x{n}: grpc {row['grpc_mb_s']:8.0f} MB/s  tcp {row['tcp_mb_s']:8.0f} MB/s  "
                  f"memcpy {memcpy:8.0f} MB/s  grpc/tcp {row['grpc_vs_tcp']:.2f}  (snapshot {snapshot_s:.2f}s)",
                  flush=True)
        del state, flat, payload
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"rows": rows, "cpus": torch.get_num_threads()}, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
