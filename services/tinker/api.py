"""What each Tinker API request does, apart from HTTP: `TinkerApi` holds the sessions, the
training models and the sampling sessions, checks a request against them and the configured
limits, and queues its work on the one compute thread.

A request is answered in one of two ways:
    at once        the client's and the server's configuration, sessions, get_info,
                   sampling sessions, training runs: a JSON dict
    a future       create_model, load_weights, forward_backward (and forward), optim_step, the
                   saves, asample: `{"request_id", ...}` at once, the result from retrieve_future
                   (futures.py). A training model's requests go through its `Sequence` (seq_id
                   order, exactly once); the others run in the order they came.

Everything a request names is checked before its work is queued: an id of a process that has
since restarted is told apart from one that never existed (`Ids.earlier`): after a restart a
model's weights, optimiser state and accumulated gradients are gone, and its next request
(an optim_step most of all: half a step) is refused with what to do instead.

The methods run on the event loop (routes.py awaits none of them but `retrieve`): the
dictionaries here are the loop's; the compute thread gets closures over what they hold."""

from __future__ import annotations

import hashlib
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Callable, TypeVar

from ..common.checkpoints import read_overlay, write_overlay
from ..common.compute import ComputeThread
from ..common.types import SamplingParams
from .checkpoints import Store, TinkerPath, check_name
from .decoders import Decoder
from .futures import PROTOBUF, Futures, Outcome, json_outcome, outcome_of
from .losses import check_inputs, loss_for
from .protocol import (
    AdamSpec,
    ApiError,
    CreateModel,
    CreateSamplingSession,
    CreateSession,
    Ids,
    LoadWeights,
    ModelRef,
    OptimStep,
    Retrieve,
    Sample,
    SaveForSampler,
    SaveWeights,
    SessionRef,
)
from .sampling import Engine, SampleBatches, SampleJob, SampleSpec, Weights, WeightsCache
from .sequence import Sequence
from .trainers import Model, Trainer, trainer_for
from .training import Adam, Call, ModelSpec, lora_targets
from .wire import Limits, read_forward_backward, sample_response

if TYPE_CHECKING:
    from ..common.config import Config

T = TypeVar("T")
STATE_FILE = "state.pt"


@dataclass
class Session:
    id: str
    last_seen: float
    models: set[str] = field(default_factory=set)
    samplers: set[str] = field(default_factory=set)


@dataclass
class ModelState:
    """A training model as the API knows it: its id and session, the request that made it (for a
    retried create), its sequence; the model itself once the compute thread has built it."""

    id: str
    session: str
    digest: str
    answer: dict
    sequence: Sequence
    spec: ModelSpec | None = None
    model: Model | None = None
    failed: str | None = None


@dataclass
class SamplerSession:
    """A sampling session: the weights it samples (`key` in the weights cache; "" = the base model),
    how to read them again (None: an unnamed snapshot, only in memory), its requests by seq_id."""

    id: str
    session: str
    key: str
    load: Callable[[], Weights] | None
    model_path: str | None = None
    seen: OrderedDict[int, tuple[str, str, dict]] = field(default_factory=OrderedDict)


def digest_of(data: bytes | str) -> str:
    return hashlib.sha256(data.encode() if isinstance(data, str) else data).hexdigest()


class TinkerApi:
    def __init__(self, cfg: Config, decoder: Decoder, ids: Ids | None = None, trainer: Trainer | None = None):
        from transformers import AutoConfig

        self.cfg, self.t = cfg, cfg.tinker
        self.trainer = trainer if trainer is not None else trainer_for(cfg)
        self.ids = ids or Ids()
        self.compute = ComputeThread("tinker-compute")
        self.futures = Futures(self.ids, self.t.max_futures, self.t.poll_hold_s, self.t.max_result_bytes)
        self.store = Store(self.t.root)
        self.engine = Engine(decoder)
        self.weights = WeightsCache(self.t.max_sampler_weights)
        # samples decoded elsewhere (a generation server of the API's own) take no turn of the
        # compute thread: they go on while it trains
        self.sampling = ComputeThread("tinker-sampling") if decoder.remote else self.compute
        self.batches = SampleBatches(self.sampling.submit, self._sample_batch, self.t.sample_batch)
        local = Path(cfg.model.path)
        self.model_dir = str(local.resolve()) if local.is_dir() else cfg.model.path
        self.model_name = self.t.model_name or local.name
        self.arch = getattr(AutoConfig.from_pretrained(cfg.model.path), "model_type", None)
        self.max_tokens = self.t.datum_tokens(cfg.prompt_length, cfg.response_length)
        self.limits = Limits(self.t.max_datums, self.max_tokens, decoder.vocab_size)
        self.sessions: dict[str, Session] = {}
        self.models: dict[str, ModelState] = {}
        self.samplers: OrderedDict[str, SamplerSession] = OrderedDict()
        # told of each piece of the compute thread's work: its kind and seconds (the service's metrics)
        self.on_work: Callable[[str, float], None] = lambda kind, seconds: None

    def close(self) -> None:
        for state in self.models.values():
            state.sequence.close("the server is stopping")
        self.compute.close()
        if self.sampling is not self.compute:
            self.sampling.close()
        self.engine.decoder.close()
        self.trainer.close()

    # ------------------------------------------------------------------ the client's configuration
    def client_config(self) -> dict:
        """The SDK's flags: plain httpx (no pyqwest), no JWTs, protobuf uncompressed, chunks of at
        most this server's datums and a third of its body limit."""
        return {
            "pjwt_auth_enabled": False,
            "use_pyqwest_transport": False,
            "sample_use_retrieve_futures": False,
            "sample_join_sampling_session": False,
            "custom_loss_server_side": False,
            "proto_compress_fwdbwd": False,
            "parallel_fwdbwd_chunks": True,
            "fwdbwd_max_chunk_len": self.t.max_datums,
            "fwdbwd_max_chunk_bytes_count": min(5_000_000, self.t.max_request_bytes // 3),
            "sample_no_retries": False,
        }

    def capabilities(self) -> dict:
        model = {"model_name": self.model_name, "max_context_length": self.max_tokens}
        return {"supported_models": [{**model, "trainable": True, "sampleable": True}]}

    def _check_base_model(self, name: str, param: str = "base_model") -> None:
        if name not in (self.model_name, self.cfg.model.path, self.model_dir):
            raise ApiError(
                400,
                f"{param}: this server serves one model, {self.model_name!r} (model.path {self.cfg.model.path}); "
                f"not {name[:120]!r}",
                param=param,
                code="unknown_model",
            )

    # ------------------------------------------------------------------ sessions
    def create_session(self, req: CreateSession) -> dict:
        if len(self.sessions) >= self.t.max_sessions:
            self._reap()
        if len(self.sessions) >= self.t.max_sessions:
            raise ApiError(
                400,
                f"{self.t.max_sessions} sessions are open, this server's limit (tinker.max_sessions); close a "
                "ServiceClient (or wait tinker.session_timeout_s for an abandoned one)",
                code="too_many_sessions",
            )
        session = Session(self.ids.new("s"), time.monotonic())
        self.sessions[session.id] = session
        return {"type": "create_session", "session_id": session.id}

    def heartbeat(self, req: SessionRef) -> dict:
        self._session(req.session_id)
        return {"type": "session_heartbeat"}

    def finish(self, session_id: str) -> dict:
        """The session's models and sampling sessions dropped; an unknown session is finished already."""
        session = self.sessions.pop(session_id, None)
        if session is not None:
            self._drop(session, "its session finished")
        return {}

    def _drop(self, session: Session, why: str) -> None:
        for model_id in session.models:
            state = self.models.pop(model_id, None)
            if state is not None:
                state.sequence.close(f"model {model_id} is gone: {why}")
                self.compute.submit(lambda s=state: self._let_go(s))
        for sampler_id in session.samplers:
            self.samplers.pop(sampler_id, None)

    def _let_go(self, state: ModelState) -> None:
        """A dropped model released (on the compute thread: after the work queued for it)."""
        if state.model is not None:
            state.model.release()

    def _reap(self) -> None:
        """Sessions silent for session_timeout_s finished (what an abandoned client held)."""
        now = time.monotonic()
        for session in [s for s in self.sessions.values() if now - s.last_seen > self.t.session_timeout_s]:
            del self.sessions[session.id]
            self._drop(session, f"its session sent nothing for {self.t.session_timeout_s:g} s")

    def _session(self, session_id: str) -> Session:
        session = self.sessions.get(session_id)
        if session is not None:
            session.last_seen = time.monotonic()
            return session
        if self.ids.earlier(session_id):
            raise ApiError(
                410,
                f"session {session_id} belongs to a server process that has since restarted; start a new ServiceClient",
                param="session_id",
                code="server_restarted",
            )
        raise ApiError(404, f"no session {session_id[:80]}", param="session_id", code="session_not_found")

    # ------------------------------------------------------------------ training models
    def _model(self, model_id: str, action: str) -> ModelState:
        state = self.models.get(model_id)
        if state is not None:
            self._session(state.session)
            return state
        if self.ids.earlier(model_id):
            raise ApiError(400, _restarted(model_id, action), param="model_id", code="server_restarted")
        raise ApiError(404, f"no training model {model_id[:80]}", param="model_id", code="model_not_found")

    def _room_for_model(self) -> None:
        for state in [s for s in self.models.values() if s.failed is not None]:
            del self.models[state.id]
        if len(self.models) >= self.t.max_models:
            self._reap()
        if len(self.models) >= self.t.max_models:
            raise ApiError(
                400,
                f"{self.t.max_models} training models are held, this server's limit (tinker.max_models); close "
                "the ServiceClient of one you are done with",
                code="too_many_models",
            )

    def _new_model(
        self, session: Session, model_seq_id: int, digest: str, build: Callable[[], Model], result: dict
    ) -> dict:
        """A training model `build` makes on the compute thread, as a future whose result is `result`
        with the model's id; a retry of the request that made it answers with the same future."""
        model_id = f"{session.id}:train:{model_seq_id}"
        known = self.models.get(model_id)
        if known is not None:
            if known.digest != digest:
                raise ApiError(400, f"model_seq_id {model_seq_id} is taken in this session", code="seq_id_reused")
            return known.answer
        self._room_for_model()
        request_id, future = self.futures.create()
        sequence = Sequence(self.compute.submit, self.t.max_queued_per_model, self.t.seq_wait_s)
        state = ModelState(model_id, session.id, digest, {"request_id": request_id, "model_id": model_id}, sequence)
        self.models[model_id] = state
        session.models.add(model_id)

        def work() -> Outcome:
            try:
                state.model = build()
            except Exception as e:
                state.failed = f"model {model_id} could not be built: {getattr(e, 'message', None) or e}"
                raise
            state.spec = state.model.spec
            return json_outcome({**result, "model_id": model_id})

        timed = self._timed("create_model", work)
        self.compute.submit(lambda: future.set_result(outcome_of(timed)))
        return state.answer

    def create_model(self, req: CreateModel) -> dict:
        session = self._session(req.session_id)
        self._check_base_model(req.base_model)
        if req.optimizer_config and req.optimizer_config.get("type", "adamw") != "adamw":
            raise ApiError(400, "optimizer_config: this server trains with AdamW only", param="optimizer_config")
        lora = req.lora_config
        rank = lora.rank if lora is not None else self.t.lora_rank
        if rank > self.t.max_lora_rank:
            raise ApiError(
                400,
                f"lora_config.rank: {rank} is over {self.t.max_lora_rank} (tinker.max_lora_rank)",
                "lora_config.rank",
            )
        flags = lora.model_dump(include={"train_attn", "train_mlp", "train_unembed"}) if lora is not None else {}
        seed = lora.seed if lora is not None else None
        meta = {"user_metadata": req.user_metadata}
        model_id = f"{session.id}:train:{req.model_seq_id}"

        def build() -> Model:
            spec = ModelSpec(rank, lora_targets(self.cfg, flags) if rank else (), seed)
            model = self.trainer.create(model_id, spec)
            try:
                self._write_run(model_id, spec, meta)
            except Exception:
                model.release()
                raise
            return model

        digest = digest_of(req.model_dump_json())
        return self._new_model(session, req.model_seq_id, digest, build, {"type": "create_model"})

    def _write_run(self, model_id: str, spec: ModelSpec, meta: dict) -> None:
        created = datetime.now(timezone.utc).isoformat()
        self.store.write_run(
            model_id, {"base_model": self.model_name, "spec": spec.as_dict(), "created": created, **meta}
        )

    def get_info(self, req: ModelRef) -> dict:
        state = self._model(req.model_id, "get_info")
        if state.failed is not None or state.spec is None:
            raise ApiError(400, state.failed or f"model {state.id} is still being built", param="model_id")
        rank = state.spec.rank
        return {
            "type": "get_info",
            "model_id": state.id,
            "model_data": {"arch": self.arch, "model_name": self.model_name, "tokenizer_id": self.model_dir},
            "is_lora": rank > 0,
            "lora_rank": rank or None,
            "model_name": self.model_name,
        }

    def training_run(self, run_id: str) -> dict:
        meta = self.store.read_run(run_id)
        spec = ModelSpec.from_dict(meta["spec"])
        user = meta.get("user_metadata") or None
        return {
            "training_run_id": run_id,
            "base_model": meta["base_model"],
            "model_owner": "local",
            "is_lora": spec.rank > 0,
            "corrupted": False,
            "lora_rank": spec.rank or None,
            "last_request_time": meta["created"],
            "user_metadata": {str(k): str(v) for k, v in user.items()} if user else None,
        }

    # ------------------------------------------------------------------ a training model's requests
    def _queue(self, state: ModelState, seq_id: int, digest: str, work: Callable[[Model], Outcome], kind: str) -> dict:
        if seq_id < 1:
            raise ApiError(400, f"seq_id: {seq_id}; a training client's requests count from 1", param="seq_id")

        def run() -> Outcome:
            if state.model is None:
                raise ApiError(400, state.failed or f"model {state.id} was not built")
            return work(state.model)

        return {
            "request_id": state.sequence.add(seq_id, digest, self.futures, self._timed(kind, run)),
            "model_id": state.id,
        }

    def _timed(self, kind: str, work: Callable[[], T]) -> Callable[[], T]:
        """`work`, its seconds told to `on_work` under `kind` when it ends (failed or not)."""

        def run() -> T:
            t0 = time.perf_counter()
            try:
                return work()
            finally:
                self.on_work(kind, time.perf_counter() - t0)

        return run

    def forward_backward(self, body: bytes) -> dict:
        req = read_forward_backward(body, self.limits)
        state = self._model(req.model_id, "forward" if req.forward_only else "forward_backward")
        loss, settings = loss_for(req.loss_fn, req.config)
        for i, d in enumerate(req.data):
            check_inputs(loss, i, set(d.inputs))

        digest = digest_of(body)
        call = Call(body, req.data, loss, settings, not req.forward_only, op=f"{state.id}:{req.seq_id}:{digest}")

        def work(model: Model) -> Outcome:
            return Outcome(model.forward_backward(call), PROTOBUF)

        return self._queue(state, req.seq_id, digest, work, "forward" if req.forward_only else "forward_backward")

    def optim_step(self, req: OptimStep) -> dict:
        state = self._model(req.model_id, "optim_step")
        if req.adam_params is None and req.optimizer_params is not None:
            raise ApiError(400, "optimizer_params: this server steps with AdamW only (adam_params)", "optimizer_params")
        adam = self._adam(req.adam_params or AdamSpec())
        digest = digest_of(req.model_dump_json())
        op = f"{state.id}:{req.seq_id}:{digest}"

        def work(model: Model) -> Outcome:
            return json_outcome({"type": "optim_step", "metrics": model.optim_step(adam, op)})

        return self._queue(state, req.seq_id, digest, work, "optim_step")

    def _adam(self, p: AdamSpec) -> Adam:
        t = self.t
        return Adam(
            p.learning_rate if p.learning_rate is not None else t.learning_rate,
            (p.beta1 if p.beta1 is not None else t.adam_betas[0], p.beta2 if p.beta2 is not None else t.adam_betas[1]),
            p.eps if p.eps is not None else t.adam_eps,
            p.weight_decay,
            p.grad_clip_norm,
        )

    def save_weights(self, req: SaveWeights) -> dict:
        state = self._model(req.model_id, "save_state")
        path = TinkerPath(state.id, "weights", check_name(req.path, "path"))
        if self.store.exists(path) and not req.overwrite:
            raise ApiError(400, f"{path.uri} exists; save under another name or with overwrite", param="path")

        def work(model: Model) -> Outcome:
            self.store.write(path, lambda d: model.save(d / STATE_FILE), overwrite=req.overwrite)
            return json_outcome({"type": "save_weights", "path": path.uri})

        return self._queue(state, req.seq_id, digest_of(req.model_dump_json()), work, "save_weights")

    def save_for_sampler(self, req: SaveForSampler) -> dict:
        """Named: the sampler weights written to tinker://<model>/sampler_weights/<name>. Unnamed
        (`sampling_session_seq_id`): held in memory under a new sampling session of the model's
        session, the SDK's `save_weights_and_get_sampling_client`."""
        state = self._model(req.model_id, "save_weights_for_sampler")
        digest = digest_of(req.model_dump_json())
        if req.path is not None:
            path = TinkerPath(state.id, "sampler_weights", check_name(req.path, "path"))

            def named(model: Model) -> Outcome:
                weights = model.sampler_weights()
                self.store.write(path, lambda d: write_overlay(d, weights))
                self.weights.put(path.uri, weights)
                return json_outcome({"type": "save_weights_for_sampler", "path": path.uri})

            return self._queue(state, req.seq_id, digest, named, "save_weights_for_sampler")
        if req.sampling_session_seq_id is None:
            raise ApiError(400, "save_weights_for_sampler needs a path (a name) or a sampling_session_seq_id")
        sampler_id = f"{state.session}:sample:{req.sampling_session_seq_id}"
        key = f"snapshot:{self.ids.new('r')}"
        snapshot = lambda model: self._snapshot(model, key, sampler_id)  # noqa: E731
        answer = self._queue(state, req.seq_id, digest, snapshot, "save_weights_for_sampler")
        if sampler_id not in self.samplers:
            self._add_sampler(SamplerSession(sampler_id, state.session, key, None))
        return answer

    def _snapshot(self, model: Model, key: str, sampler_id: str) -> Outcome:
        self.weights.put(key, model.sampler_weights())
        return json_outcome({"type": "save_weights_for_sampler", "sampling_session_id": sampler_id})

    def load_weights(self, req: LoadWeights) -> dict:
        """A weights/ checkpoint: into a new model of the session (the SDK's
        create_training_client_from_state), or over an existing one in its seq_id order."""
        path = TinkerPath.parse(req.path, "weights")
        directory = self.store.found(path)
        digest = digest_of(req.model_dump_json())
        answer = {"type": "load_weights", "path": path.uri}
        if req.session_id is not None and req.model_seq_id is not None:
            session = self._session(req.session_id)
            model_id = f"{session.id}:train:{req.model_seq_id}"
            source = self.store.read_run(path.run)

            def build() -> Model:
                model = self.trainer.create(model_id, ModelSpec.from_dict(source["spec"]))
                try:
                    model.load(directory / STATE_FILE, req.optimizer)
                except Exception:
                    model.release()
                    raise
                self._write_run(model_id, model.spec, {"user_metadata": source.get("user_metadata")})
                return model

            return self._new_model(session, req.model_seq_id, digest, build, answer)
        if req.model_id is None or req.seq_id is None:
            raise ApiError(400, "load_weights needs session_id and model_seq_id (a new model), or model_id and seq_id")
        state = self._model(req.model_id, "load_state")

        def work(model: Model) -> Outcome:
            model.load(directory / STATE_FILE, req.optimizer)
            return json_outcome({**answer, "model_id": state.id})

        return self._queue(state, req.seq_id, digest, work, "load_state")

    # ------------------------------------------------------------------ sampling
    def _add_sampler(self, sampler: SamplerSession) -> None:
        self.samplers[sampler.id] = sampler
        self.sessions[sampler.session].samplers.add(sampler.id)
        while len(self.samplers) > self.t.max_sampling_sessions:
            _, dropped = self.samplers.popitem(last=False)
            owner = self.sessions.get(dropped.session)
            if owner is not None:
                owner.samplers.discard(dropped.id)

    def _weights_source(self, base_model: str | None, model_path: str | None) -> tuple[str, Callable[[], Weights]]:
        """The cache key of a sampler checkpoint (tinker://.../sampler_weights/NAME) or of the base
        model, and how to read its weights."""
        if model_path is not None:
            path = TinkerPath.parse(model_path, "sampler_weights", what="model_path")
            directory = self.store.found(path)
            return path.uri, lambda: read_overlay(directory)
        if base_model is None:
            raise ApiError(400, "name the weights to sample: base_model or model_path", param="model_path")
        self._check_base_model(base_model)
        return Engine.BASE, dict

    def create_sampling_session(self, req: CreateSamplingSession) -> dict:
        session = self._session(req.session_id)
        sampler_id = f"{session.id}:sample:{req.sampling_session_seq_id}"
        if sampler_id not in self.samplers:
            key, load = self._weights_source(req.base_model, req.model_path)
            self._add_sampler(SamplerSession(sampler_id, session.id, key, load, req.model_path))
        return {"type": "create_sampling_session", "sampling_session_id": sampler_id}

    def _sampler(self, sampler_id: str) -> SamplerSession:
        sampler = self.samplers.get(sampler_id)
        if sampler is not None:
            self._session(sampler.session)
            self.samplers.move_to_end(sampler_id)
            return sampler
        if self.ids.earlier(sampler_id):
            raise ApiError(
                400,
                f"sampling session {sampler_id} belongs to a server process that has since restarted; make a new "
                "sampling client (its weights: a named sampler checkpoint, tinker://...)",
                param="sampling_session_id",
                code="server_restarted",
            )
        raise ApiError(
            404,
            f"no sampling session {sampler_id[:80]} (or it was dropped: tinker.max_sampling_sessions are held)",
            param="sampling_session_id",
            code="sampler_not_found",
        )

    def get_sampler(self, sampler_id: str) -> dict:
        sampler = self._sampler(sampler_id)
        return {"sampler_id": sampler.id, "base_model": self.model_name, "model_path": sampler.model_path}

    def sample(self, req: Sample) -> dict:
        if req.sampling_session_id is not None:
            sampler = self._sampler(req.sampling_session_id)
            key, load = sampler.key, sampler.load
        else:
            sampler = None
            key, load = self._weights_source(req.base_model, req.model_path)
        spec = self._sample_spec(req)
        digest = digest_of(req.model_dump_json())
        if sampler is not None and req.seq_id is not None and req.seq_id in sampler.seen:
            request_id, seen_digest, answer = sampler.seen[req.seq_id]
            if seen_digest != digest:
                raise ApiError(400, f"seq_id {req.seq_id} was already used by another sample request", "seq_id")
            return answer
        request_id, future = self.futures.create()

        def finish(result) -> None:
            def answer() -> Outcome:
                if isinstance(result, BaseException):
                    raise result
                return Outcome(sample_response(*result), PROTOBUF)

            future.set_result(outcome_of(answer))

        self.batches.add(SampleJob(key, load, spec, finish))
        answer = {
            "request_id": request_id,
            "sample_sequence_ids": [f"{request_id}:{i}" for i in range(req.num_samples)],
        }
        if sampler is not None and req.seq_id is not None:
            sampler.seen[req.seq_id] = (request_id, digest, answer)
            while len(sampler.seen) > 1024:
                sampler.seen.popitem(last=False)
        return answer

    def _sample_batch(self, key: str, load, specs: list[SampleSpec]):
        """One batch of sample requests on the sampling thread (the compute thread, unless the
        decoder is remote): the weights they name served, one generate call (its seconds are the
        metrics' `sample` work)."""

        def work():
            self.engine.use(key, {} if key == Engine.BASE else self.weights.get(key, load))
            return self.engine.sample(specs)

        return self._timed("sample", work)()

    def _sample_spec(self, req: Sample) -> SampleSpec:
        """The request as the backend takes it, every number inside what this server serves."""
        unsupported = [
            k for k in ("topk_prompt_logprobs", "topk_sample_logprobs", "prompt_alt_tokens_k") if getattr(req, k)
        ]
        if unsupported or req.target_prompt_logprobs is not None:
            what = (unsupported or ["target_prompt_logprobs"])[0]
            raise ApiError(400, f"{what}: not supported by this server (tokens and their logprobs are)", param=what)
        prompt = self._prompt(req)
        p = req.sampling_params
        limit = self.t.sample_tokens(self.cfg.response_length)
        max_tokens = p.max_tokens or limit
        if max_tokens > limit or len(prompt) + max_tokens > self.max_tokens:
            raise ApiError(
                400,
                f"sampling_params.max_tokens: {max_tokens} new tokens after {len(prompt)} of prompt; this server "
                f"samples at most {limit} (tinker.max_sample_tokens), {self.max_tokens} in all",
                param="sampling_params.max_tokens",
            )
        if req.num_samples > self.t.max_samples:
            raise ApiError(
                400, f"num_samples: {req.num_samples} is over {self.t.max_samples} (tinker.max_samples)", "num_samples"
            )
        stop = p.stop if isinstance(p.stop, list) else [p.stop] if p.stop is not None else []
        stop_ids = [s for s in stop if isinstance(s, int)]
        if any(not 0 <= s < self.limits.vocab_size for s in stop_ids):
            raise ApiError(400, "sampling_params.stop: a token id outside the vocabulary", "sampling_params.stop")
        params = SamplingParams(
            n=req.num_samples,
            temperature=p.temperature,
            top_p=p.top_p,
            top_k=max(p.top_k, 0),
            max_new_tokens=max_tokens,
            stop_token_ids=stop_ids,
            seed=p.seed,
        )
        strings = tuple(s for s in stop if isinstance(s, str))
        return SampleSpec(prompt, params, strings, bool(req.prompt_logprobs))

    def _prompt(self, req: Sample) -> list[int]:
        tokens: list[int] = []
        for chunk in req.prompt.chunks:
            if chunk.type != "encoded_text" or chunk.tokens is None:
                raise ApiError(400, "prompt: only encoded_text chunks (tokens) are supported", param="prompt")
            tokens += chunk.tokens
        if not 1 <= len(tokens) < self.max_tokens:
            raise ApiError(400, f"prompt: {len(tokens)} tokens; 1 to {self.max_tokens - 1} are served", "prompt")
        bad = next((t for t in tokens if not 0 <= t < self.limits.vocab_size), None)
        if bad is not None:
            raise ApiError(
                400, f"prompt: token id {bad} is outside the vocabulary (0 to {self.limits.vocab_size - 1})", "prompt"
            )
        return tokens

    # ------------------------------------------------------------------ futures
    async def retrieve(self, req: Retrieve) -> Outcome | None:
        """The request's result, or None while it is not done after poll_hold_s."""

        def expire() -> None:
            for state in list(self.models.values()):
                state.sequence.expire(req.request_id)

        return await self.futures.wait(req.request_id, expire)


def _restarted(model_id: str, action: str) -> str:
    lost = "its weights, its optimiser state and the gradients its forward_backward calls accumulated"
    if action == "optim_step":
        return (
            f"optim_step: model {model_id} has no gradients to step with: the server restarted after they were "
            f"accumulated, and {lost} were in the process that is gone, so this step would be half a step. "
            "Create a training client from your last checkpoint (ServiceClient."
            "create_training_client_from_state_with_optimizer) and redo the forward_backward"
        )
    return (
        f"{action}: model {model_id} belongs to a server process that has since restarted: {lost} are gone. "
        "Create a training client from your last checkpoint (ServiceClient."
        "create_training_client_from_state_with_optimizer)"
    )
