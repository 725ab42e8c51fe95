"""The critic server: Values, Train (one optimiser step), Save, Load, Info. Checkpoints live under
one root (the run directory); at start the newest complete checkpoint there is loaded.

    rlhf serve critic -c configs/tiny-cpu.yaml
"""

from __future__ import annotations

import logging
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING

from ..common.checkpoints import CRITIC_DIR, complete_checkpoints
from ..common.compute import ComputeThread
from ..common.lifecycle import GrpcService
from ..common.rpc.codec import BadRequest, batch_from_proto, tensor_from_proto, tensor_to_proto
from ..common.rpc.gen import critic_pb2 as cpb
from ..common.rpc.gen import critic_pb2_grpc
from ..common.rpc.server import RPCServer, batch_size_histogram
from .critic import CheckpointError, NonFiniteStep

if TYPE_CHECKING:
    from ..common.config import Config

log = logging.getLogger(__name__)
MAX_PATH_CHARS = 1024


class CriticServicer(critic_pb2_grpc.CriticServicer):
    def __init__(self, critic, cfg: Config, batch_size=None, root: str | Path | None = None):
        """`batch_size`: the `rlhf_batch_size` child that counts sequences per call (None = not counted)."""
        self.critic, self.cfg, self.batch_size = critic, cfg, batch_size
        self.root = Path(cfg.run.run_dir if root is None else root).resolve()
        self.vocab_size = critic.model.backbone.config.vocab_size
        self.max_bytes = cfg.rpc.max_message_mb << 20  # no tensor of a request spans more than its message
        self.compute = ComputeThread("critic")  # one step at a time, in order; values wait for it
        self.loaded_from, self.incarnation, self.started_at = "", uuid.uuid4().hex, time.time()

    def _batch(self, msg):
        b = batch_from_proto(
            msg, self.vocab_size, self.cfg.prompt_length, self.cfg.response_length, max_bytes=self.max_bytes
        )
        if self.batch_size is not None:
            self.batch_size.observe(b.input_ids.shape[0])
        return b

    def Values(self, request, context):
        batch = self._batch(request.batch)
        values = self.compute.run(self.critic.values, batch)
        return cpb.ValuesResponse(values=tensor_to_proto(values.float()))

    def Train(self, request, context):
        batch = self._batch(request.batch)
        shape = tuple(batch.response_mask.shape)
        returns = tensor_from_proto(request.returns, "returns", ndim=2, max_bytes=self.max_bytes).float()
        old = tensor_from_proto(request.old_values, "old_values", ndim=2, max_bytes=self.max_bytes).float()
        limit = self.cfg.critic.max_abs_target
        for name, t in (("returns", returns), ("old_values", old)):
            if tuple(t.shape) != shape:
                raise BadRequest(f"{name}: shape {list(t.shape)}, expected {list(shape)} (the response_mask's)")
            if t.abs().max() > limit:
                raise BadRequest(f"{name}: |value| {t.abs().max().item():.3g} above critic.max_abs_target={limit:g}")
        try:
            metrics = self.compute.run(self.critic.train_step, batch, returns, old)
        except NonFiniteStep as e:
            raise BadRequest(str(e)) from None
        return cpb.TrainResponse(metrics=metrics, step=self.critic.steps)

    def _path(self, path: str) -> tuple[str, Path]:
        """`path` (relative to the checkpoint root, normalised) and where it resolves; a path that is
        not relative or would leave the root (by `..` or a symlink) is a BadRequest."""
        if not path:
            raise BadRequest("path: empty")
        if len(path) > MAX_PATH_CHARS:
            raise BadRequest(f"path: {len(path)} characters, more than {MAX_PATH_CHARS}")
        if "\0" in path:
            raise BadRequest("path: contains a NUL byte")
        rel = Path(path)
        if rel.is_absolute() or ".." in rel.parts:
            raise BadRequest(f"path: {path!r} must be relative to the checkpoint root, without '..'")
        long = [p for p in rel.parts if len(p.encode()) > 255]
        if long:
            raise BadRequest(
                f"path: a component of {len(long[0].encode())} bytes, more than a file name may have (255)"
            )
        full = (self.root / rel).resolve()
        if full == self.root or not full.is_relative_to(self.root):
            raise BadRequest(f"path: {path!r} does not lead to a directory inside the checkpoint root")
        return str(rel), full

    def Save(self, request, context):
        rel, full = self._path(request.path)
        try:
            self.compute.run(self.critic.save, full)
        except (FileExistsError, NotADirectoryError) as e:  # a file where the path needs a directory
            raise BadRequest(f"path: {rel}: {e.strerror}") from None
        return cpb.CheckpointResponse(path=rel, step=self.critic.steps)

    def Load(self, request, context):
        rel, full = self._path(request.path)
        if not (full / "value_head.safetensors").exists():
            raise BadRequest(f"path: no critic checkpoint in {rel} (value_head.safetensors missing)")
        try:
            self.compute.run(self.critic.load, full)
        except CheckpointError as e:
            raise BadRequest(f"path: {rel}: {e}") from None
        self.loaded_from = rel
        return cpb.CheckpointResponse(path=rel, step=self.critic.steps)

    def Info(self, request, context):
        return cpb.CriticInfo(
            step=self.critic.steps,
            loaded_from=self.loaded_from,
            incarnation=self.incarnation,
            started_at=self.started_at,
        )

    def restore_latest(self) -> None:
        """Load the critic of the newest complete checkpoint under the root (one with `learner.pt`
        and `critic/`), skipping any that cannot be loaded; without one, keep the initial weights."""
        done = [p for p in complete_checkpoints(self.root) if (p / CRITIC_DIR / "value_head.safetensors").is_file()]
        for ckpt in reversed(done):
            rel = str((ckpt / CRITIC_DIR).relative_to(self.root))
            try:
                self.critic.load(ckpt / CRITIC_DIR)
            except CheckpointError as e:
                log.warning("critic checkpoint %s in %s cannot be loaded: %s", rel, self.root, e)
                continue
            self.loaded_from = rel
            log.info("critic restored from %s in %s (step %d)", rel, self.root, self.critic.steps)
            return
        log.info("critic starts from its initial weights (no complete checkpoint in %s)", self.root)


def follower_main(cfg: Config) -> int:
    """Ranks 1..N-1 of a sharded critic (critic.nproc > 1): their shards, running what rank 0 announces."""
    from ..common.sharding.followers import follow
    from ..common.sharding.group import from_env
    from .sharded import ShardedCritic

    return follow(ShardedCritic.from_config(cfg, dist=from_env(cfg.model.device, cfg.critic.nproc)))


def serve(cfg: Config, critic=None, root: str | Path | None = None) -> GrpcService:
    """The critic service: loads the value model `critic` describes (or uses `critic`), restores the
    newest complete checkpoint under `root` (default: `run.run_dir`), then binds `rpc.critic`'s
    ports and serves gRPC. A config without a critic (adv_estimator grpo, rloo, ...: only gae uses
    one) gets an idle server: healthy, loading no model, answering no Critic call (UNIMPLEMENTED), so
    a deployment that always starts the critic (Docker Compose, Kubernetes) spends no memory on it."""
    if critic is None and not cfg.needs_critic:
        return GrpcService("critic", lambda: _idle(cfg))

    def build():
        c = critic
        if c is None and cfg.critic.nproc > 1:  # rank 0 of a sharded critic
            from ..common.sharding.group import from_env
            from .sharded import ShardedCritic

            c = ShardedCritic.from_config(cfg, dist=from_env(cfg.model.device, cfg.critic.nproc))
        elif c is None:
            from .critic import Critic

            c = Critic.from_config(cfg)
        ep = cfg.rpc.critic
        server = RPCServer("critic", cfg.rpc, ep.port, ep.metrics_port, host=ep.host)
        servicer = CriticServicer(c, cfg, batch_size_histogram(server.metrics, "sequences"), root=root)
        servicer.restore_latest()
        critic_pb2_grpc.add_CriticServicer_to_server(servicer, server.grpc)
        server.start()
        server.set_ready(True)
        from ..common.sharding.followers import release_followers

        return server, servicer, [servicer.compute.close, lambda: release_followers(c)]

    return GrpcService("critic", build)


def _idle(cfg: Config):
    """The critic server of a run that uses no critic: health SERVING, no model, no Critic service."""
    log.info("adv_estimator %s uses no critic: this critic server stays idle (no model loaded)", cfg.adv_estimator)
    ep = cfg.rpc.critic
    server = RPCServer("critic", cfg.rpc, ep.port, ep.metrics_port, host=ep.host)
    server.start()
    server.set_ready(True)
    return server, None, []
