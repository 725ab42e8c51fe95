"""Helpers for tests of the gRPC servers."""

import hashlib

import grpc
import pytest

TOKEN = "s3cret"


def expect_code(fn, code, fragment=""):
    """Call fn, expect an RpcError with `code` whose details contain `fragment`; its details."""
    with pytest.raises(grpc.RpcError) as e:
        fn()
    assert e.value.code() == code, e.value.details()
    assert fragment in (e.value.details() or ""), e.value.details()
    return e.value.details()


def restream(chunks):
    """Weight-push `chunks` (a list) with its checks recomputed (each piece's xxh3 when the pieces
    carry it, else the footer's sha256), so that only the tampering under test is wrong; returns
    the list."""
    import xxhash

    pieces = [c.piece for c in chunks if c.WhichOneof("payload") == "piece"]
    if pieces and pieces[0].HasField("xxh3"):
        for p in pieces:
            p.xxh3 = xxhash.xxh3_64_intdigest(p.data)
        return chunks
    digest = hashlib.sha256()
    for p in pieces:
        digest.update(p.data)
    chunks[-1].footer.sha256 = digest.hexdigest()
    return chunks


def on_free_ports(cfg, service: str, metrics: bool = False, http: bool = False):
    """A copy of `cfg` whose `rpc.<service>` binds a free gRPC port, and a free /metrics port with
    `metrics` and HTTP port (reward, learner) with `http`, else none: how a test starts a server."""
    out = cfg.model_copy(deep=True)
    ep = getattr(out.rpc, service)
    ep.port, ep.metrics_port = 0, 0 if metrics else None
    if hasattr(ep, "http_port"):
        ep.http_port = 0 if http else None
    return out


def held_backend(model_dir: str, hold_s: float):
    """An HFBackend whose every batch waits, once started (`started` set), until `release` is set
    (or `hold_s` passes) before decoding: a batch to keep running while a test does something
    else (a swap then waits for it). Returns (backend, started, release)."""
    import threading

    from services.generation.backend import HFBackend

    backend = HFBackend(model_dir, "cpu")
    started, release = threading.Event(), threading.Event()
    real = backend.generate

    def held_generate(*a, **kw):
        started.set()
        release.wait(hold_s)
        return real(*a, **kw)

    backend.generate = held_generate
    return backend, started, release


def publisher(cfg, store, learner):
    """A weight `Publisher` over `store`'s registry with a `ServerPool` of its own, as the learner
    builds one; `closed(p)` closes both."""
    from services.common.servers import ServerPool
    from services.generation.client import generation_clients
    from services.weights.publisher import Publisher

    pool = ServerPool(lambda: store.live("generation"), generation_clients(cfg.rpc), cfg.replay.heartbeat_s / 2)
    return Publisher(cfg, store, learner, pool)


def closed(p) -> None:
    p.close()
    p.servers.close()
