"""The `vllm` generation backend: vLLM's engine with its continuous batching, per-token log-probs
of the sampling distribution, and new policy weights loaded into the running engine.

One thread owns the engine (`LLMEngine`, stepped here): Generate calls hand it their prompts
and each prompt joins the running batch at the next step, whatever else is decoding. A weight
swap is a call on the same thread: admission pauses, the requests in flight finish on the old
weights, the new ones load through vLLM's in-place reload (`reload_weights`), the prefix cache
is reset (its blocks hold the old policy's keys and values), and admission resumes. So every
completion comes from one policy version, the version it reports. With
generation.weight_update: in_flight the swap runs between two engine steps instead, nothing
drained, and each token records the version that sampled it (`_Job.switches`); the requests in
flight are preempted and prefilled again under the new weights (in_flight_cache: recompute, vLLM's
`reset_prefix_cache(reset_running_requests=True)`) or keep their keys and values.

Log-probs: the engine runs with `logprobs_mode="processed_logprobs"`, the log-probs of the
distribution tokens are drawn from (temperature, top-k and top-p applied), as the `hf` backend
and the learner's `response_log_probs` compute them; a greedy request gets the unscaled ones.

With `tensor_parallel_size: 1` the engine runs inside the server process
(VLLM_ENABLE_V1_MULTIPROCESSING=0) and a swap hands the tensors to the model directly. With more
GPUs the engine's workers are processes: the swap writes the weights once as safetensors (to
/dev/shm when it exists) and every worker reads them through `WeightSwapExtension`.
"""

from __future__ import annotations

import itertools
import logging
import os
import queue
import tempfile
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterable, Mapping, Sequence

import torch

from ..common.compute import Call, run_call, wait_for_call
from ..common.model_files import check_model_dir, load_tokenizer
from ..common.rpc.errors import BadRequest, Unavailable
from ..common.types import Completion, GenerationResult, SamplingParams, TokenScores, switched_versions
from ..weights.check import check_newer, check_version
from .backend import GenerationStopped
from .decode import GREEDY_BELOW

if TYPE_CHECKING:
    from ..common.config_sections import VLLMConfig

log = logging.getLogger(__name__)

INSTALL_HINT = (
    "generation.backend: vllm needs vLLM, which is not installed in this Python environment "
    "({python}): on a GPU box `pip install '.[vllm]'`; on a CPU `make vllm-venv` builds .venv-vllm with "
    "vLLM's CPU build (then run .venv-vllm/bin/rlhf)"
)


def import_vllm():
    """vLLM, imported after its environment is set, or a one-line error saying how to install it."""
    try:
        import vllm
    except ImportError as e:
        import sys

        raise ValueError(INSTALL_HINT.format(python=sys.executable) + f" [{e}]") from None
    return vllm


class WeightSwapExtension:
    """Mixed into every vLLM worker (`worker_extension_cls`): load a policy version from a
    safetensors file, in place, through the worker's own reload path. Used when the engine's
    workers are other processes (tensor parallel); called by name through `collective_rpc`."""

    if TYPE_CHECKING:  # the vLLM worker's own method (defined here, it would shadow the worker's)

        def reload_weights(
            self, weights_iterator: Iterable[tuple[str, torch.Tensor]] | None = None, is_checkpoint_format: bool = True
        ) -> None: ...

    def rlhf_load_weights(self, path: str) -> None:
        from safetensors import safe_open

        def tensors():
            with safe_open(path, framework="pt", device="cpu") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)

        self.reload_weights(weights_iterator=tensors(), is_checkpoint_format=True)


@dataclass
class _Part:
    """A sample's tokens so far (weight updates in flight: the engine hands them out step by step)."""

    token_ids: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    finish_reason: str | None = None


@dataclass
class _Job:
    prompts: list[list[int]]
    params: SamplingParams
    future: Future
    policy_version: int = -1
    outputs: list = field(default_factory=list)
    left: int = 0
    t0: float = 0.0
    stopped: Callable[[], bool] | None = None  # True once nobody waits for it: its requests are aborted
    # in flight: per (prompt, sample) its tokens so far; per switch the new version and how many
    # tokens each sample had then
    parts: dict[tuple[int, int], _Part] = field(default_factory=dict)
    switches: list[tuple[int, dict[tuple[int, int], int]]] = field(default_factory=list)

    def versions(self, key: tuple[int, int], n_tokens: int) -> list[int] | None:
        """Per token of sample `key`, the version that sampled it; None when one version."""
        switches = [(counts.get(key, 0), version) for version, counts in self.switches]
        return switched_versions(self.policy_version, switches, n_tokens)


class VLLMBackend:
    """`GenerationBackend` over vLLM's engine. `generate` may be called from many threads at
    once: the engine thread batches them continuously. `update_weights` (and `call`) run
    between requests: admission pauses, the engine drains, the call runs, admission resumes.
    With `in_flight` they run between two engine steps instead, nothing drained: the engine hands
    out each step's tokens (vLLM's DELTA outputs), so each token's version is known, and the
    requests in flight are recomputed under the new weights (`recompute`: vLLM preempts them and
    prefills prompt + tokens so far again) or go on with the keys and values they have."""

    continuous_batching = True  # the server hands it calls as they come (no batching window)
    partial_updates = False  # whole policies only (see update_weights): the learner pushes it full versions
    scores_tokens = True  # ScoreTokens: `score`, vLLM's prompt log-probs on the engine thread
    in_flight = False
    recompute = True

    def __init__(
        self,
        model_path: str,
        vcfg: VLLMConfig,
        dtype: str = "float32",
        max_model_len: int | None = None,
        in_flight: bool = False,
        recompute: bool = True,
    ):
        self.in_flight, self.recompute = in_flight, recompute
        tp = vcfg.tensor_parallel_size
        self.inprocess = tp == 1
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0" if self.inprocess else "1")
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", f"{vcfg.cpu_kvcache_space_gb:g}")
        vllm = import_vllm()
        self.engine_version = f"vllm {vllm.__version__}"
        from vllm import EngineArgs
        from vllm import SamplingParams as VSamplingParams
        from vllm.sampling_params import RequestOutputKind
        from vllm.v1.engine.llm_engine import LLMEngine

        self._sampling_params = VSamplingParams
        # in flight, every step's new tokens (to know each token's version); else each request's end
        self._output_kind = RequestOutputKind.DELTA if in_flight else RequestOutputKind.FINAL_ONLY
        self._final_only = RequestOutputKind.FINAL_ONLY

        model_dir = check_model_dir(model_path)
        self.tokenizer = load_tokenizer(model_dir)
        self.eos_token_id = self.tokenizer.eos_token_id
        self.pad_token_id = self.tokenizer.pad_token_id
        from transformers import AutoConfig

        hf_config = AutoConfig.from_pretrained(str(model_dir))
        self.vocab_size = hf_config.vocab_size
        self._specs = hf_parameter_specs(hf_config)
        args = EngineArgs(
            model=str(model_dir),
            tokenizer=str(model_dir),
            dtype=dtype,
            seed=vcfg.seed,
            max_model_len=vcfg.max_model_len or max_model_len,
            tensor_parallel_size=tp,
            gpu_memory_utilization=vcfg.gpu_memory_utilization,
            enforce_eager=vcfg.enforce_eager,
            enable_prefix_caching=vcfg.enable_prefix_caching,
            logprobs_mode="processed_logprobs",
            worker_extension_cls=f"{__name__}.WeightSwapExtension",
        )
        t0 = time.perf_counter()
        self.engine = LLMEngine.from_engine_args(args)
        from vllm.platforms import current_platform

        self.device = current_platform.device_type + (f" x{tp} (tensor parallel)" if tp > 1 else "")
        self.dtype = str(self.engine.model_config.dtype).removeprefix("torch.")
        log.info(
            "vLLM engine up in %.1fs (%s, %s, %s)",
            time.perf_counter() - t0,
            self.engine_version,
            self.dtype,
            self.device,
        )
        self._run_engine()

    def _run_engine(self) -> None:
        """Start the thread that owns `self.engine` (tests drive a fake engine through this)."""
        self.policy_version = 0
        self.swap_seconds = 0.0
        self.broken: str | None = None  # why the engine must not serve (a reload failed midway)
        self._q: queue.Queue = queue.Queue()
        self._ids = itertools.count()
        self._inflight: dict[str, tuple[_Job, int]] = {}
        self._held: list[_Job] = []
        self._calls: list[Call] = []
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="vllm-engine", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ what GetInfo reports
    def info(self) -> dict:
        return {"backend": "vllm", "engine_version": self.engine_version, "dtype": self.dtype, "device": self.device}

    def parameter_specs(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """The policy's tensors as the learner pushes them: the transformers model's state dict
        names and shapes in float32 (the engine casts to its own dtype and layout as it loads)."""
        return self._specs

    def dead(self) -> str | None:
        """Why this backend can no longer make progress (the server's liveness fails then), or None:
        marked broken (a reload failed midway, or vLLM's engine core died), or the engine thread
        gone while the backend is not closing."""
        if self.broken:
            return self.broken
        if not self._closed and not self._thread.is_alive():
            return "the vLLM engine thread has exited; nothing is decoded or swapped any more"
        return None

    # ------------------------------------------------------------------ callers' side
    def submit(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams, stopped: Callable[[], bool] | None = None
    ) -> Future:
        """`stopped()`, when given, is asked before each engine step: once True, the job's
        requests are aborted and its future raises `GenerationStopped`."""
        fut: Future = Future()
        if self.broken:
            fut.set_exception(Unavailable(self.broken))
        elif self._closed:
            fut.set_exception(Unavailable("the vLLM engine is stopping"))
        else:
            self._q.put(_Job([list(p) for p in prompts], params, fut, stopped=stopped))
        return fut

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        stop: Callable[[], bool] | None = None,
        between: Callable[[], None] | None = None,
    ) -> GenerationResult:
        """`stop`, when given, is `submit`'s `stopped`: once True the requests are aborted and
        `GenerationStopped` is raised. `between` must be None: weight updates reach this engine
        through `call`, between requests (generation.weight_update: in_flight is the hf backend's)."""
        if between is not None:
            raise ValueError("the vllm backend takes weight updates between requests only, not in flight")
        if not prompts:
            return GenerationResult([], self.policy_version, 0, 0.0)
        return self.submit(prompts, params, stop).result()

    def call(self, fn, *args, timeout: float | None = None):
        """Run fn(*args) on the engine thread with nothing in flight (pause, drain, run, resume).
        With a `timeout`: not started within it (the requests in flight still decoding), it is
        withdrawn and `CallNotStarted` raised (`wait_for_call`)."""
        if threading.current_thread() is self._thread:
            return fn(*args)
        fut: Future = Future()
        self._q.put(Call(lambda: fn(*args), fut))
        return wait_for_call(fut, timeout)

    def score(self, sequences: Sequence[Sequence[int]], starts: Sequence[int]) -> TokenScores:
        """The log-prob of each token of `sequences[i][starts[i]:]` given the tokens before it, at
        temperature 1, under the version served: vLLM's prompt log-probs (a prefill, one token
        sampled and dropped), run on the engine thread (a `call`: no swap in between; with
        `in_flight`, other requests go on stepping meanwhile and keep their outputs)."""
        if threading.current_thread() is not self._thread:
            return self.call(self.score, sequences, starts)
        sp = self._sampling_params(max_tokens=1, temperature=1.0, prompt_logprobs=0, logprobs=None,
                                   detokenize=False, output_kind=self._final_only)  # fmt: skip
        rids = [f"score-{next(self._ids)}-{i}" for i in range(len(sequences))]
        for rid, ids in zip(rids, sequences):
            self.engine.add_request(rid, {"prompt_token_ids": list(ids)}, sp)
        done = self._step_until(set(rids))
        out = []
        for rid, ids, start in zip(rids, sequences, starts):
            prompt = done[rid].prompt_logprobs  # per position: {token: Logprob} (None at the first)
            out.append([prompt[t][ids[t]].logprob for t in range(max(start, 1), len(ids))])
        return TokenScores(out, self.policy_version, self.dtype)

    def _step_until(self, rids: set[str]) -> dict:
        """Step the engine until the requests `rids` finish (their final outputs); the outputs of
        any other request in flight go where the loop sends them."""
        done: dict = {}
        while len(done) < len(rids):
            for out in self.engine.step():
                if out.request_id in rids:
                    if out.finished:
                        done[out.request_id] = out
                    continue
                if self.in_flight:
                    self._collect(out)
                if out.finished:
                    self._finished(out)
        return done

    def update_weights(self, state_dict: Mapping[str, torch.Tensor], policy_version: int) -> None:
        """Load a full state dict (transformers names, see `parameter_specs`) as `policy_version`.
        Names, shapes and dtypes are checked first; on a mismatch nothing changes."""
        check_version(state_dict, self._specs)
        missing = set(self._specs) - set(state_dict)
        if missing:  # vLLM fuses q/k/v and gate/up: a layer loaded from part of its tensors is corrupt
            raise ValueError(
                f"the vllm backend loads whole policies only: {len(missing)} tensors missing "
                f"(first {sorted(missing)[0]!r})"
            )
        self.call(self._swap, state_dict, policy_version)

    def close(self) -> None:
        """Stop the engine thread, then shut the engine down now: left to the garbage collector,
        its teardown of vLLM's process-wide parallel state could run in the middle of the start of
        another engine in this process (a test or benchmark running several)."""
        if self._closed:
            return
        self._closed = True
        self._q.put(None)
        self._thread.join(timeout=30)
        try:
            self.engine.engine_core.shutdown()
        except Exception:  # already down; nothing more to release
            log.debug("vLLM engine shutdown", exc_info=True)
        self.engine = None
        import gc

        gc.collect()

    # ------------------------------------------------------------------ the engine thread
    def _swap(self, state_dict: Mapping[str, torch.Tensor], policy_version: int) -> None:
        check_newer(policy_version, self.policy_version)
        t0 = time.perf_counter()
        try:
            self._reload(state_dict)
        except Exception as e:  # after every check passed: the engine holds a half-loaded policy
            self.broken = (
                f"the vLLM engine failed while loading policy version {policy_version} ({type(e).__name__}: "
                f"{e}); it serves nothing until this server is restarted"
            )
            log.critical("%s", self.broken)
            raise
        self._reset_cache()
        self.policy_version = policy_version
        self.swap_seconds = time.perf_counter() - t0

    def _reset_cache(self) -> None:
        """The prefix cache's blocks hold the old policy's keys and values: dropped. In flight with
        `recompute`, the requests in flight are preempted first (vLLM prefills them again, under
        the new weights); kept, the cache cannot be reset while they hold blocks."""
        if not (self.in_flight and self.engine.has_unfinished_requests()):
            self.engine.reset_prefix_cache()
        elif not self.engine.reset_prefix_cache(reset_running_requests=self.recompute):
            log.warning(
                "weights swapped in flight with in_flight_cache: keep: the prefix cache could not be reset "
                "while requests hold blocks, so new requests may reuse prefixes the old weights encoded "
                "(set generation.vllm.enable_prefix_caching: false with keep)"
            )

    def _reload(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        if self.inprocess:
            self.engine.collective_rpc(
                "reload_weights",
                kwargs={"weights_iterator": iter(list(state_dict.items())), "is_checkpoint_format": True},
            )
        else:
            from safetensors.torch import save_file

            shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
            with tempfile.TemporaryDirectory(prefix="rlhf-weights-", dir=shm) as d:
                path = str(Path(d) / "model.safetensors")
                save_file({k: v.contiguous() for k, v in state_dict.items()}, path)
                self.engine.collective_rpc("rlhf_load_weights", args=(path,))

    def _loop(self) -> None:
        while True:
            busy = self.engine.has_unfinished_requests()
            if not self._take(block=not busy):
                break
            if self._calls and not self.engine.has_unfinished_requests():
                self._run_calls()
            self._abort_stopped()
            if self.engine.has_unfinished_requests():
                try:
                    outputs = self.engine.step()
                except Exception as e:  # the engine failed: every request in flight sees it
                    log.exception("vLLM engine step failed")
                    if type(e).__name__ == "EngineDeadError":  # vLLM's engine core is gone: nothing recovers it
                        self.broken = (
                            f"the vLLM engine core died ({e}); it serves nothing until this server is restarted"
                        )
                        log.critical("%s", self.broken)
                    self._fail_inflight(e)
                    continue
                for out in outputs:
                    if self.in_flight:
                        self._collect(out)
                    if out.finished:
                        self._finished(out)
        self._fail_all(Unavailable("the vLLM engine is stopping"))

    def _take(self, block: bool) -> bool:
        """Move what callers queued into the engine (jobs) or the pending calls; False at close."""
        while True:
            try:
                item = self._q.get(timeout=0.5) if block else self._q.get_nowait()
            except queue.Empty:
                return True
            block = False
            if item is None:
                return False
            if isinstance(item, Call) and self.in_flight:
                self._run_in_flight(item)  # between two steps, nothing drained
            elif isinstance(item, Call):
                self._calls.append(item)
            elif self._calls:
                self._held.append(item)  # admission is paused until the calls have run
            else:
                self._admit(item)

    def _run_calls(self) -> None:
        calls, self._calls = self._calls, []
        for c in calls:
            run_call(c.future, c.fn)
        held, self._held = self._held, []
        for job in held:
            self._admit(job)

    def _run_in_flight(self, c: Call) -> None:
        """A call between two engine steps; a new version it loaded is a switch of every job in
        flight, at the tokens each of its samples has so far."""
        before = self.policy_version
        run_call(c.future, c.fn)
        if self.policy_version == before:
            return
        for job in {id(j): j for j, _ in self._inflight.values()}.values():
            job.switches.append((self.policy_version, {k: len(p.token_ids) for k, p in job.parts.items()}))

    def _collect(self, out) -> None:
        """In flight: one step's new tokens of a request's samples (DELTA outputs), kept on its job."""
        entry = self._inflight.get(out.request_id)
        if entry is None:
            return
        job, i = entry
        for c in out.outputs:
            part = job.parts.setdefault((i, c.index), _Part())
            ids = list(c.token_ids)
            part.token_ids += ids
            part.log_probs += [d[t].logprob for t, d in zip(ids, c.logprobs)] if c.logprobs else []
            if c.finish_reason is not None:
                part.finish_reason = c.finish_reason

    def _admit(self, job: _Job) -> None:
        if self.broken:
            job.future.set_exception(Unavailable(self.broken))
            return
        if job.stopped is not None and job.stopped():
            job.future.set_exception(GenerationStopped("nobody waits for this request any more; not run"))
            return
        p = job.params
        greedy = p.temperature < GREEDY_BELOW
        job.policy_version, job.t0, job.left = self.policy_version, time.perf_counter(), len(job.prompts)
        job.outputs = [None] * len(job.prompts)
        base = next(self._ids)
        added = []
        try:
            for i, ids in enumerate(job.prompts):
                sp = self._sampling_params(  # greedy samples are all alike: one is decoded, n are returned
                    n=1 if greedy else p.n,
                    temperature=0.0 if greedy else p.temperature,
                    top_p=1.0 if greedy else p.top_p,
                    top_k=0 if greedy or not p.top_k else p.top_k,
                    max_tokens=p.max_new_tokens,
                    stop_token_ids=sorted({self.eos_token_id, *p.stop_token_ids}),
                    logprobs=0,
                    detokenize=False,
                    seed=None if p.seed is None else (p.seed + i * p.n) % 2**63,  # any int64: vLLM's range
                    output_kind=self._output_kind,
                )
                rid = f"{base}-{i}"
                self.engine.add_request(rid, {"prompt_token_ids": ids}, sp)
                added.append(rid)
                self._inflight[rid] = (job, i)
        except Exception as e:  # refused by the engine (too long for max_model_len, ...)
            for rid in added:
                self._inflight.pop(rid, None)
            if added:
                self.engine.abort_request(added)
            job.future.set_exception(BadRequest(f"request: vLLM's engine refused it: {e}"))

    def _finished(self, out) -> None:
        entry = self._inflight.pop(out.request_id, None)
        if entry is None:
            return
        job, i = entry
        comps = self._collected(job, i) if self.in_flight else self._final(out)
        if len(comps) < job.params.n:  # greedy: the one decoded sample, n times
            comps = [
                Completion(list(c.token_ids), list(c.log_probs), c.finish_reason, None, c.token_versions)
                for c in comps
                for _ in range(job.params.n)
            ]
        job.outputs[i] = comps
        job.left -= 1
        if job.left == 0 and not job.future.done():
            tokens = sum(len(c.token_ids) for cs in job.outputs for c in cs)
            job.future.set_result(
                GenerationResult(job.outputs, job.policy_version, tokens, time.perf_counter() - job.t0)
            )

    @staticmethod
    def _final(out) -> list[Completion]:
        """A request's completions from its final output (FINAL_ONLY: every token in it)."""
        comps = []
        for c in sorted(out.outputs, key=lambda c: c.index):
            ids = list(c.token_ids)
            lps = [d[t].logprob for t, d in zip(ids, c.logprobs)] if c.logprobs else []
            comps.append(Completion(ids, lps, "stop" if c.finish_reason == "stop" else "length"))
        return comps

    @staticmethod
    def _collected(job: _Job, i: int) -> list[Completion]:
        """Prompt i's completions from the steps' outputs collected in flight, each token's version."""
        keys = sorted(k for k in job.parts if k[0] == i)
        return [
            Completion(
                job.parts[k].token_ids,
                job.parts[k].log_probs,
                "stop" if job.parts[k].finish_reason == "stop" else "length",
                None,
                job.versions(k, len(job.parts[k].token_ids)),
            )
            for k in keys
        ]

    _stops_checked_at = 0.0
    STOP_CHECK_S = 0.1  # how often (seconds) `_abort_stopped` looks: it walks every request in flight

    def _abort_stopped(self) -> None:
        """Abort the requests of the jobs nobody waits for any more (their `stopped()`)."""
        now = time.monotonic()
        if now - self._stops_checked_at < self.STOP_CHECK_S:
            return
        self._stops_checked_at = now
        jobs = {id(j): j for j, _ in self._inflight.values() if j.stopped is not None}
        gone = {k for k, j in jobs.items() if j.stopped is not None and j.stopped()}
        if not gone:
            return
        rids = [rid for rid, (j, _) in self._inflight.items() if id(j) in gone]
        for rid in rids:
            del self._inflight[rid]
        self.engine.abort_request(rids)
        for k in gone:
            if not jobs[k].future.done():
                jobs[k].future.set_exception(GenerationStopped("nobody waits for this request any more"))

    def _fail_inflight(self, e: Exception) -> None:
        rids = list(self._inflight)
        jobs = {id(j): j for j, _ in self._inflight.values()}
        self._inflight.clear()
        if rids:
            try:
                self.engine.abort_request(rids)
            except Exception:  # the engine is already broken; the callers learn it below
                pass
        for job in jobs.values():
            if not job.future.done():
                job.future.set_exception(e)

    def _fail_all(self, e: Exception) -> None:
        self._fail_inflight(e)
        pending: list[_Job | Call] = [*self._held, *self._calls]
        for item in pending:
            if not item.future.done():  # a withdrawn call is done (cancelled)
                item.future.set_exception(e)
        while True:
            try:
                item = self._q.get_nowait()
            except queue.Empty:
                return
            if item is not None and not item.future.done():
                item.future.set_exception(e)


def hf_parameter_specs(config) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Names and shapes of the transformers model's state dict (float32), from its config alone:
    the model is built on the meta device, so nothing is allocated."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return {k: (tuple(v.shape), v.dtype) for k, v in model.state_dict().items()}
