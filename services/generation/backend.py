"""The `hf` generation backend: transformers' `generate` with per-token log-probs from the
current policy, and new policy weights swapped in atomically between batches. It implements
`GenerationBackend` (`services/common/types.py`), the interface the generation server and the
in-process trainer call.
"""
from __future__ import annotations

import threading
import time
from concurrent.futures import Future, TimeoutError as FutureTimeout
from typing import Callable, Mapping, Sequence

import torch
import torch.nn.functional as F
from transformers import StoppingCriteria, StoppingCriteriaList

from ..common.modeling import load_causal_lm, load_tokenizer, resolve_device
from ..common.padding import pad_left
from ..common.types import Completion, GenerationResult, SamplingParams
from ..weights.check import check_newer, check_version
from ..weights.hostcopy import copy_to_device

# Temperatures below this sample greedily, exactly as temperature 0 does (log-probs then are of the
# unscaled distribution): dividing logits by a tiny or denormal temperature overflows to inf/NaN.
GREEDY_BELOW = 1e-5


class GenerationStopped(Exception):
    """A batch given up before its end because `stop()` said nobody waits for it any more (every
    caller of the generation server left: deadline passed or call cancelled)."""


class CallNotStarted(TimeoutError):
    """A call for the compute thread (a weight swap) that had not started when its wait's deadline
    passed (the running batch was still decoding): it was withdrawn, nothing changed."""


def wait_for_call(fut: Future, timeout: float | None):
    """The result of a call queued for the compute thread: waiting up to `timeout` seconds for it
    to start (None = as long as it takes); one still queued then is withdrawn (`CallNotStarted`);
    one that has started is waited for to the end (it holds what it was given)."""
    try:
        return fut.result(timeout)
    except FutureTimeout:
        if fut.cancel():
            raise CallNotStarted(f"it waited {timeout:.0f} s for the running batch to finish and never ran") \
                from None
        return fut.result()


def run_call(fut: Future, fn: Callable[[], object]) -> None:
    """The compute thread's side of `wait_for_call`: `fn()` into `fut`, unless its caller withdrew
    it (then nothing runs); an exception goes to the caller."""
    if not fut.set_running_or_notify_cancel():
        return  # withdrawn by its caller, whose wait ran out
    try:
        fut.set_result(fn())
    except BaseException as e:  # the caller sees it
        fut.set_exception(e)


class _StopWhen(StoppingCriteria):
    """Ends `generate` after the current decoding step, every row at once, once `stop()` is True."""

    def __init__(self, stop: Callable[[], bool]):
        self.stop, self.fired = stop, False

    def __call__(self, input_ids: torch.LongTensor, scores, **kwargs) -> torch.BoolTensor:
        self.fired = self.fired or self.stop()
        return torch.full((input_ids.shape[0],), self.fired, device=input_ids.device, dtype=torch.bool)


class HFBackend:
    """transformers `generate` behind a lock: a batch runs start to end on one set of weights,
    and `update_weights` waits for it, so no sample mixes two policy versions."""

    def __init__(self, model_path: str, device: str = "auto", dtype: torch.dtype = torch.float32):
        self.device = resolve_device(device)
        self.tokenizer = load_tokenizer(model_path)
        self.model = load_causal_lm(model_path, self.device, dtype).eval()
        self.vocab_size = self.model.config.vocab_size
        self.eos_token_id = self.tokenizer.eos_token_id
        self.pad_token_id = self.tokenizer.pad_token_id
        self.version = 0
        self._lock = threading.Lock()

    def info(self) -> dict:
        """What GetInfo reports: the engine that really serves, and where."""
        import transformers
        dtype = next(self.model.parameters()).dtype
        return {"backend": "hf", "engine_version": f"transformers {transformers.__version__}",
                "dtype": str(dtype).removeprefix("torch."), "device": str(self.device)}

    def parameter_specs(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        return {k: (tuple(v.shape), v.dtype) for k, v in self.model.state_dict().items()}

    def update_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        """Load a full or partial state dict as policy `version`. Checks every name, shape and
        dtype first (`weights.check`); on any mismatch nothing changes. Versions only move forward."""
        check_version(state_dict, self.parameter_specs())
        with self._lock:
            check_newer(version, self.version)
            if self.device.type == "cuda":  # through page-locked buffers (hostcopy)
                own = self.model.state_dict()
                copy_to_device((own[k], v) for k, v in state_dict.items())
            else:
                self.model.load_state_dict(dict(state_dict), strict=False)
            self.version = version

    @torch.no_grad()
    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams,
                 stop: Callable[[], bool] | None = None) -> GenerationResult:
        """`stop`, when given, is asked after every decoding step; once it says True the batch ends
        there and `GenerationStopped` is raised (its partial samples are nobody's)."""
        if not prompts:
            return GenerationResult([], self.version, 0, 0.0)
        t0 = time.perf_counter()
        ids, attn = pad_left([p for p in prompts for _ in range(params.n)], self.pad_token_id)
        P = ids.shape[1]
        stops = sorted({self.eos_token_id, *params.stop_token_ids})
        greedy = params.temperature < GREEDY_BELOW
        kwargs = dict(do_sample=not greedy, max_new_tokens=params.max_new_tokens, eos_token_id=stops,
                      pad_token_id=self.pad_token_id, output_scores=True, return_dict_in_generate=True)
        if not greedy:
            kwargs.update(temperature=params.temperature, top_p=params.top_p, top_k=params.top_k or None)
        stopper = _StopWhen(stop) if stop is not None else None
        if stopper is not None:
            kwargs.update(stopping_criteria=StoppingCriteriaList([stopper]))
        with self._lock:
            version = self.version
            if params.seed is not None:
                torch.manual_seed(params.seed)
            out = self.model.generate(input_ids=ids.to(self.device), attention_mask=attn.to(self.device), **kwargs)
        if stopper is not None and stopper.fired:
            raise GenerationStopped(f"stopped after {out.sequences.shape[1] - P} of {params.max_new_tokens} tokens: "
                                    "nobody waits for this batch any more")
        sequences = out.sequences[:, P:].cpu()
        scores = torch.stack(out.scores, dim=1).float().cpu()  # (N, steps, V) sampling-distribution logits
        logps = F.log_softmax(scores, dim=-1).gather(-1, sequences.unsqueeze(-1)).squeeze(-1)
        stop_set = set(stops)
        completions: list[list[Completion]] = []
        tokens = 0
        for i, seq in enumerate(sequences.tolist()):
            n_tok, reason = len(seq), "length"
            for j, t in enumerate(seq):
                if t in stop_set:
                    n_tok, reason = j + 1, "stop"
                    break
            tokens += n_tok
            c = Completion(seq[:n_tok], logps[i, :n_tok].tolist(), reason)
            if i % params.n == 0:
                completions.append([])
            completions[-1].append(c)
        return GenerationResult(completions, version, tokens, time.perf_counter() - t0)
