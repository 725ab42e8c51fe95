"""The `hf` generation backend: a transformers model sampled step by step (`decode`: each prompt
prefilled once for its group, the sampled tokens' log-probs kept as it goes), given tokens scored
under the version it serves (`score`: the push parity check's ScoreTokens), and new policy weights
swapped in atomically between batches. It implements
`GenerationBackend` (`services/common/types.py`), the interface the generation server and the
in-process trainer call.
"""

from __future__ import annotations

import threading
import time
from typing import Callable, Mapping, Sequence

import torch

from ..common.model_files import load_causal_lm, load_tokenizer, resolve_device
from ..common.modeling import token_log_probs
from ..common.types import Completion, GenerationResult, SamplingParams, TokenScores, switched_versions
from ..weights.check import check_newer, check_version
from ..weights.hostcopy import copy_to_device
from .decode import Decoded, decode


class GenerationStopped(Exception):
    """A batch given up before its end because `stop()` said nobody waits for it any more (every
    caller of the generation server left: deadline passed or call cancelled)."""


class HFBackend:
    """`decode` behind a lock: `update_weights` waits for the running batch, unless the batch itself
    calls it between two decoding steps (`generate`'s `between`, on the same thread: weight updates
    in flight); then the tokens after the switch record the new version (`token_versions`), and
    `recompute` says whether the rows' keys and values are recomputed under it. With `dtype` bfloat16
    (`model.bf16`) the engine holds and runs the policy in bfloat16; pushes stay float32 (the
    learner's master weights) and are cast as they load."""

    continuous_batching = False  # the server batches calls in its window (batching.py:Batcher)
    partial_updates = True  # a partial version loads over the weights it has
    scores_tokens = True  # ScoreTokens: `score`
    broken: str | None = None  # never: a failed update changes nothing

    def __init__(
        self, model_path: str, device: str = "auto", dtype: torch.dtype = torch.float32, recompute: bool = True
    ):
        self.device = resolve_device(device)
        self.tokenizer = load_tokenizer(model_path)
        self.model = load_causal_lm(model_path, self.device, dtype).eval()
        self._specs = {
            k: (tuple(v.shape), torch.float32 if v.is_floating_point() else v.dtype)
            for k, v in self.model.state_dict().items()
        }
        self.vocab_size = self.model.config.vocab_size
        self.eos_token_id = self.tokenizer.eos_token_id
        self.pad_token_id = self.tokenizer.pad_token_id
        self.policy_version = 0
        self.recompute = recompute  # in-flight updates: the live rows' cache recomputed, or kept
        self._lock = threading.RLock()  # reentrant: an update in flight runs inside `generate`

    def info(self) -> dict:
        """What GetInfo reports: the engine that really serves, and where."""
        import transformers

        dtype = next(self.model.parameters()).dtype
        return {
            "backend": "hf",
            "engine_version": f"transformers {transformers.__version__}",
            "dtype": str(dtype).removeprefix("torch."),
            "device": str(self.device),
        }

    def dead(self) -> str | None:
        return None  # no engine of its own to die

    def parameter_specs(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """The policy's tensors as the learner pushes them: names and shapes, floating ones in float32."""
        return self._specs

    def update_weights(self, state_dict: Mapping[str, torch.Tensor], policy_version: int) -> None:
        """Load a full or partial state dict as `policy_version`. Checks every name, shape and
        dtype first (`weights.check`); on any mismatch nothing changes. Versions only move forward."""
        check_version(state_dict, self.parameter_specs())
        with self._lock:
            check_newer(policy_version, self.policy_version)
            if self.device.type == "cuda":  # through page-locked buffers (hostcopy)
                own = self.model.state_dict()
                copy_to_device((own[k], v) for k, v in state_dict.items())
            else:
                self.model.load_state_dict(dict(state_dict), strict=False)
            self.policy_version = policy_version

    def score(self, sequences: Sequence[Sequence[int]], starts: Sequence[int]) -> TokenScores:
        """The log-prob of each token of `sequences[i][starts[i]:]` given the tokens before it, at
        temperature 1, under the version served (taken under the lock: no swap in between), each
        sequence in an unpadded forward of its own (`token_log_probs`, the learner's too)."""
        with self._lock:
            with torch.no_grad():
                out = [token_log_probs(self.model, ids, start).tolist() for ids, start in zip(sequences, starts)]
            return TokenScores(out, self.policy_version, self.info()["dtype"])

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        stop: Callable[[], bool] | None = None,
        between: Callable[[], None] | None = None,
    ) -> GenerationResult:
        """`stop`, when given, is asked after every decoding step; once it says True the batch ends
        there and `GenerationStopped` is raised (its partial samples are nobody's). `between`, when
        given, runs between two decoding steps: the weight updates it makes apply from the next
        token on (each completion's `token_versions` then says which version sampled which token)."""
        if not prompts:
            return GenerationResult([], self.policy_version, 0, 0.0)
        t0 = time.perf_counter()
        with self._lock:
            versions = [self.policy_version]  # the first, then one per switch

            def switched() -> bool:
                assert between is not None
                between()
                if self.policy_version == versions[-1]:
                    return False
                versions.append(self.policy_version)
                return True

            if params.seed is not None:
                torch.manual_seed(params.seed)
            out = decode(
                self.model,
                prompts,
                params,
                self.pad_token_id,
                [self.eos_token_id, *params.stop_token_ids],
                stop,
                switched if between is not None else None,
                self.recompute,
            )
        if out.stopped:
            raise GenerationStopped(
                f"stopped after {out.steps} of {params.max_new_tokens} tokens: nobody waits for this batch any more"
            )
        completions = grouped(out, len(prompts), params.n, versions)
        return GenerationResult(completions, versions[0], sum(len(t) for t in out.tokens), time.perf_counter() - t0)


def grouped(out: Decoded, n_prompts: int, n: int, versions: list[int]) -> list[list[Completion]]:
    """`out`'s samples as each prompt's `n` completions; `versions` are the policy versions the
    batch decoded under (the first, then one per switch): each completion's `token_versions`."""
    switches = list(zip(out.switches, versions[1:]))
    return [
        [
            Completion(
                out.tokens[i],
                out.logps[i],
                out.finish[i],
                None,
                switched_versions(versions[0], switches, len(out.tokens[i])),
            )
            for i in range(j * n, (j + 1) * n)
        ]
        for j in range(n_prompts)
    ]
