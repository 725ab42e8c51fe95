"""Sampling for the Tinker API: a decoder (decoders.py: the `hf` generation backend in this process,
or a generation server of the API's own over gRPC) holding the base model or a sampler
checkpoint's weights over it.

Sample requests are decoded in batches (`SampleBatches`): what has queued by the time the compute
thread comes to them is grouped by weights and sampling parameters, and each group is one
`generate` call of at most `tinker.sample_batch` sequences (a recipe's `asample`s of one step,
sent at once, decode together). A seeded request is decoded alone: its samples must not depend on
what else was queued.

Weights are swapped in through the decoder's `update_weights` (each swap a newer policy
version) only when a request names other weights than those it holds: a LoRA checkpoint is its
merged layers (loaded over the base), and the base tensors those replace are kept (`_base`) so
that the base, or another checkpoint, can be put back (a decoder that takes whole policies only
gets the base with the checkpoint over it). A generation server found restarted (serving an
older version than the last pushed) gets the weights again. Each sample is decoded by the decoder
(`generate`: the sampled tokens' log-probs come with them); a prompt's own log-probs are its
teacher-forced scores (`score`). Everything here runs on the compute thread."""

from __future__ import annotations

import logging
import math
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable

import torch

from ..common.types import SamplingParams
from .decoders import Decoder
from .protocol import ApiError
from .wire import Sequence

log = logging.getLogger(__name__)

Weights = dict[str, torch.Tensor]


@dataclass(frozen=True)
class SampleSpec:
    """One sample request as the backend takes it; `stop_strings` are cut after decoding."""

    prompt: list[int]
    params: SamplingParams
    stop_strings: tuple[str, ...] = ()
    prompt_logprobs: bool = False


class WeightsCache:
    """Sampler weights by key, the least recently used dropped beyond `limit`: a named checkpoint's
    read again from disk by its `load`, an unnamed snapshot's gone (its sampling session says so)."""

    def __init__(self, limit: int):
        self.limit = limit
        self._held: OrderedDict[str, Weights] = OrderedDict()
        self._lock = threading.Lock()  # put by the compute thread, got by the sampling one

    def put(self, key: str, weights: Weights) -> None:
        with self._lock:
            self._held[key] = weights
            self._held.move_to_end(key)
            while len(self._held) > self.limit:
                self._held.popitem(last=False)

    def get(self, key: str, load: Callable[[], Weights] | None) -> Weights:
        with self._lock:
            if key in self._held:
                self._held.move_to_end(key)
                return self._held[key]
        if load is None:
            raise ApiError(
                400,
                "this sampling session's weights were dropped to make room for newer ones (tinker.max_sampler_weights "
                "are held); save them by name (save_weights_for_sampler(name)) to sample them for longer",
                code="weights_dropped",
            )
        weights = load()  # read from disk outside the lock
        self.put(key, weights)
        return weights


class Engine:
    """The weights a decoder (decoders.py: this process's backend or a generation server) serves
    now, the base model's or a sampler checkpoint's over them: one set at a time, swapped when a
    batch names another."""

    BASE = ""  # the key of the base model's weights
    UNKNOWN = None  # what is served is not known: the next `use` pushes the whole policy

    def __init__(self, decoder: Decoder):
        self.decoder = decoder
        self.tokenizer: Any = decoder.tokenizer
        self._base: Weights = {}  # the base model's tensors that some loaded weights replaced
        self._version = 0
        self._held: tuple[str | None, Weights] = (self.UNKNOWN, {})  # the key and the weights served
        self._changed: set[str] = set()  # the tensors that differ from the base
        self._found(decoder.policy_version)

    def _found(self, version: int) -> None:
        """The decoder serves `version`: 0 is the base model as it loaded it (versions only move
        forward); any other is what this engine pushed last, or (a server this API did not start
        clean) not known."""
        self._version = version
        self._held, self._changed = ((self.BASE, {}) if version == 0 else (self.UNKNOWN, {})), set()

    def use(self, key: str, weights: Weights) -> None:
        """Serve `weights` (over the base; {} = the base itself) under `key`: loaded unless they are
        the ones served (a checkpoint saved again under its name is another dict: loaded). A push
        that fails leaves what is served unknown: the next one is of the whole policy."""
        if key == self._held[0] and (key == self.BASE or weights is self._held[1]):
            return
        if self.decoder.partial and self._held[0] is not self.UNKNOWN:
            self._base.update(self.decoder.base(weights.keys() - self._changed - self._base.keys()))
            push = {**{name: self._base[name] for name in self._changed - weights.keys()}, **weights}
        else:  # the whole policy: the base with `weights` over it
            push = {**self.decoder.base(), **weights}
        self._held = (self.UNKNOWN, {})
        self.decoder.update_weights(push, self._version + 1)
        self._version += 1
        self._changed, self._held = set(weights), (key, weights)

    def sample(self, specs: list[SampleSpec]) -> list[tuple[list[Sequence], list[float] | None]]:
        """Per spec (one sampling parameters for all), `params.n` samples of its prompt and the
        prompt's own log-probs when asked (NaN first): one generate call for them all."""
        key, weights = self._held
        assert key is not self.UNKNOWN, "use() comes first"
        result = self.decoder.generate([spec.prompt for spec in specs], specs[0].params)
        if not self._served(result.policy_version):
            self.use(key, weights)
            return self.sample(specs)
        return [
            (
                [self._cut(_sequence(c), spec.stop_strings) for c in completions],
                self._prompt_logprobs(spec.prompt, key, weights) if spec.prompt_logprobs else None,
            )
            for spec, completions in zip(specs, result.completions)
        ]

    def _served(self, version: int) -> bool:
        """Whether an answer computed under `version` is of the weights this engine put there. An
        older version: the decoder restarted (its weights pushed again, then asked again: False);
        a newer one: another writer pushes to it (refused)."""
        if version == self._version:
            return True
        if version > self._version:
            raise ApiError(
                409,
                f"{self.decoder.where} serves version {version}, which this API did not push: another writer "
                "pushes weights to it; give the Tinker API a generation server of its own",
                code="generation_shared",
            )
        log.warning(
            "%s serves version %d, not %d: restarted; pushing the sampler's weights again",
            self.decoder.where,
            version,
            self._version,
        )
        self._found(version)
        return False

    def _prompt_logprobs(self, prompt: list[int], key: str, weights: Weights) -> list[float]:
        if len(prompt) < 2:
            return [math.nan]
        scores = self.decoder.score([prompt], [1])
        if not self._served(scores.policy_version):
            self.use(key, weights)
            return self._prompt_logprobs(prompt, key, weights)
        return [math.nan, *scores.log_probs[0]]

    def _cut(self, s: Sequence, stops: tuple[str, ...]) -> Sequence:
        """`s` up to and including the token that completes the first stop string, if one does."""
        if not stops or not any(stop in self.tokenizer.decode(s.tokens) for stop in stops):
            return s
        for k in range(1, len(s.tokens) + 1):
            if any(stop in self.tokenizer.decode(s.tokens[:k]) for stop in stops):
                return Sequence(s.tokens[:k], s.logprobs[:k], True)
        return s


def _sequence(c) -> Sequence:
    return Sequence(list(c.token_ids), list(c.log_probs), c.finish_reason == "stop")


@dataclass
class SampleJob:
    """A queued sample request: the weights it names (`key`, and how to read them back when not
    held), what to decode, and where its answer goes (`finish`: its samples, or the exception)."""

    key: str
    load: Callable[[], Weights] | None
    spec: SampleSpec
    finish: Callable[[tuple[list[Sequence], list[float] | None] | BaseException], None]

    def batch_key(self) -> tuple | None:
        """Jobs of one key decode together; None: alone (a seeded request)."""
        p = self.spec.params
        if p.seed is not None:
            return None
        stops = (tuple(p.stop_token_ids), self.spec.stop_strings)
        return (self.key, p.n, p.temperature, p.top_p, p.top_k, p.max_new_tokens, stops)


class SampleBatches:
    """Sample jobs waiting for the thread that samples (`submit` queues work there: the compute
    thread, or with a generation server of the API's own a sampling thread), run as batches:
    `run(key, load, specs)` decodes one batch there (a list of each spec's result). A drain is
    queued when the first job of an empty queue arrives; it takes every job queued by then."""

    def __init__(self, submit: Callable[[Callable[[], None]], Any], run: Callable, max_sequences: int):
        self.submit, self.run, self.max_sequences = submit, run, max_sequences
        self._pending: list[SampleJob] = []
        self._scheduled = False
        self._lock = threading.Lock()

    def add(self, job: SampleJob) -> None:
        with self._lock:
            self._pending.append(job)
            if self._scheduled:
                return
            self._scheduled = True
        self.submit(self._drain)

    def _drain(self) -> None:
        with self._lock:
            jobs, self._pending, self._scheduled = self._pending, [], False
        for batch in self.batches(jobs):
            try:
                results = self.run(batch[0].key, batch[0].load, [j.spec for j in batch])
            except BaseException as e:  # every job of the batch is answered with it
                for job in batch:
                    job.finish(e)
                continue
            for job, result in zip(batch, results):
                job.finish(result)

    def batches(self, jobs: list[SampleJob]) -> list[list[SampleJob]]:
        """`jobs` in batches: by batch key, in the order each key first came, each batch at most
        `max_sequences` sequences (a job larger than that alone)."""
        groups: dict[object, list[list[SampleJob]]] = {}
        for i, job in enumerate(jobs):
            key = job.batch_key()
            runs = groups.setdefault(key if key is not None else ("alone", i), [[]])
            size = sum(j.spec.params.n for j in runs[-1])
            if runs[-1] and size + job.spec.params.n > self.max_sequences:
                runs.append([])
            runs[-1].append(job)
        return [batch for runs in groups.values() for batch in runs]
