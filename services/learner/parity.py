"""The push parity check: after a push, does every generation server serve the policy the learner
pushed? A push that did not land (a server that missed or refused it), a tensor left out of it or
a LoRA adapter not merged into it is otherwise invisible: the server samples on, from the wrong
weights, and nobody compares log-probs.

Every `rpc.push_parity.every` pushes (the first push of the process always), each server the push
went to scores a fixed probe batch under the version it serves (ScoreTokens: teacher-forced,
between batches, the answer naming its version), while the learner scores the same tokens with the
policy it just pushed (with LoRA the PEFT model, adapters on: the merged weights the servers hold),
in float32 at temperature 1. Per server: the largest and the mean |log-prob difference| per token
and a KL estimate (k3, on the probe's tokens). A server fails the check when it scored with
another version than the one pushed, or its mean difference is beyond the bound of its engine's
dtype (`max_mean_abs` for float32, `max_mean_abs_bf16` for bfloat16 or float16, whose rounding
alone moves log-probs): a warning naming the server and the version, its counter
(`rlhf_push_parity_failures_total`) and, with `on_mismatch: stop`, `PushParityFailed`, which stops
the run. A server that cannot score (a server older than the method) or does not answer is
not checked (the first said once; the second is the push's failure already).

The probe: the first `probe_sequences` held-out prompts (else training prompts), each with the
learner's greedy continuation of `probe_tokens` tokens, made once at the first check.
"""

from __future__ import annotations

import logging
import math
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Sequence

import grpc
import torch

from ..common.modeling import token_log_probs
from ..common.types import TokenScores

if TYPE_CHECKING:
    from ..common.config import Config

log = logging.getLogger(__name__)

# a probe when the run has no prompts of its own (an environment's): plain text, tokenized
FALLBACK_TEXTS = ("The capital of France is", "1, 2, 3, 4,", "Once upon a time", "def add(a, b):")
HALF_PRECISION = ("bfloat16", "float16")


class PushParityFailed(RuntimeError):
    """A generation server does not serve the policy just pushed, with `rpc.push_parity.on_mismatch:
    stop`: the run stops with this sentence (it names the server and the version)."""


@dataclass(frozen=True)
class Probe:
    """The probe batch: token sequences and, per sequence, where its scored tokens start."""

    sequences: list[list[int]]
    starts: list[int]


@dataclass(frozen=True)
class Verdict:
    """One server's check: the version it scored with (and its engine's dtype), the differences
    from the learner's log-probs, the bound it was held to; `why` it fails, None when it passes."""

    address: str
    policy_version: int
    dtype: str
    max_abs: float
    mean_abs: float
    kl: float
    bound: float
    why: str | None


def make_probe(policy, tokenizer, texts: Sequence[str], n: int, tokens: int, prompt_length: int) -> Probe:
    """`n` of `texts` tokenized as a generation server tokenizes a text prompt (at most
    `prompt_length` tokens), each followed by `policy`'s greedy continuation of `tokens` tokens."""
    device = next(policy.parameters()).device
    texts = list(texts[:n]) or list(FALLBACK_TEXTS[:n])
    seqs, starts = [], []
    with torch.no_grad(), _eval(policy):
        for text in texts:
            ids = list(tokenizer(text)["input_ids"])[:prompt_length] or [0]
            out = policy(input_ids=torch.tensor([ids], dtype=torch.long, device=device), use_cache=True)
            answer: list[int] = []
            while True:
                answer.append(int(out.logits[0, -1].argmax()))
                if len(answer) == tokens:
                    break
                nxt = torch.tensor([[answer[-1]]], dtype=torch.long, device=device)
                out = policy(input_ids=nxt, past_key_values=out.past_key_values, use_cache=True)
            seqs.append(ids + answer)
            starts.append(len(ids))
    return Probe(seqs, starts)


class _eval:
    """`model` in eval mode (no dropout) for the block, its mode restored after."""

    def __init__(self, model):
        self.model, self.training = model, model.training

    def __enter__(self):
        self.model.eval()

    def __exit__(self, *exc):
        self.model.train(self.training)


def learner_log_probs(policy, probe: Probe) -> list[torch.Tensor]:
    """The learner's log-probs of the probe's scored tokens: float32, temperature 1, eval mode,
    no autocast (the master weights as pushed)."""
    with _eval(policy):
        return [token_log_probs(policy, ids, start).cpu() for ids, start in zip(probe.sequences, probe.starts)]


def compare(mine: Sequence[torch.Tensor], theirs: Sequence[Sequence[float]]) -> tuple[float, float, float]:
    """(max |Δ|, mean |Δ|, KL estimate) of a server's log-probs `theirs` against the learner's
    `mine`, per token. The KL is k3 of KL(learner || server) on the probe's tokens (the learner's
    own continuations): mean of exp(r) - 1 - r, r = server's - learner's log-prob."""
    if len(theirs) != len(mine) or any(len(t) != len(m) for t, m in zip(theirs, mine)):
        return math.inf, math.inf, math.inf
    r = torch.cat([torch.tensor(list(t), dtype=torch.float32) - m for t, m in zip(theirs, mine)])
    if not torch.isfinite(r).all():
        return math.inf, math.inf, math.inf
    return float(r.abs().max()), float(r.abs().mean()), float((torch.exp(r) - 1 - r).mean())


class PushParity:
    """The check, as `rpc.push_parity` of `cfg` says: `client(address)` reaches a generation
        server (its `score_tokens`); `texts` are the prompts the probe is made from (with `tokenizer`,
    the model's); `gauges` (the
        learner's Prometheus metrics, `LearnerMetrics.parity`), when given, take each server's verdict."""

    def __init__(self, cfg: Config, client: Callable[[str], object], texts: Sequence[str], tokenizer, gauges=None):
        self.cfg, self.settings = cfg, cfg.rpc.push_parity
        self.client, self.texts, self.tokenizer, self.gauges = client, list(texts), tokenizer, gauges
        self.probe: Probe | None = None
        self.pushes = 0
        self._told: set[str] = set()  # servers (and the sharded learner) said once not to be checked

    def due(self) -> bool:
        """Whether this push is checked: the first of the process, then every `every`-th; 0: never."""
        every = self.settings.every
        due = every > 0 and self.pushes % every == 0
        self.pushes += 1
        return due

    def check(self, learner, policy_version: int, addresses: Sequence[str]) -> dict:
        """Every server of `addresses` (those the push of `policy_version` went to) checked against
        `learner`'s policy; the metrics (empty when nothing was checked). Raises `PushParityFailed`
        with `on_mismatch: stop` when a server fails."""
        if not addresses:
            return {}
        if getattr(learner, "sharded", False):
            self._tell("sharded", "push parity: not checked with a sharded learner (model.nproc > 1)")
            return {}
        t0 = time.perf_counter()
        policy = learner.policy
        if self.probe is None:
            s = self.settings
            n_tokens = min(s.probe_tokens, self.cfg.response_length)
            self.probe = make_probe(
                policy, self.tokenizer, self.texts, s.probe_sequences, n_tokens, self.cfg.prompt_length
            )
        probe = self.probe
        with ThreadPoolExecutor(max_workers=min(8, len(addresses)), thread_name_prefix="push-parity") as pool:
            asked = {a: pool.submit(self._score, a, probe) for a in addresses}
            mine = learner_log_probs(policy, probe)  # while the servers score
            scored = {a: f.result() for a, f in asked.items()}
        verdicts = [self.verdict(a, policy_version, mine, s) for a, s in scored.items() if s is not None]
        secs = time.perf_counter() - t0
        return self.report(verdicts, policy_version, secs)

    def _score(self, address: str, probe: Probe) -> TokenScores | None:
        try:
            return self.client(address).score_tokens(probe.sequences, probe.starts)  # type: ignore[attr-defined]
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.UNIMPLEMENTED:
                self._tell(address, "push parity: %s cannot score tokens, not checked (%s)", address, e.details())
            else:
                log.info("push parity: %s did not score the probe (%s): not checked", address, e.code().name)
            return None

    def _tell(self, key: str, msg: str, *args) -> None:
        if key not in self._told:
            self._told.add(key)
            log.warning(msg, *args)

    def verdict(self, address: str, policy_version: int, mine: list[torch.Tensor], got: TokenScores) -> Verdict:
        s = self.settings
        half = got.dtype in HALF_PRECISION
        bound = s.max_mean_abs_bf16 if half else s.max_mean_abs
        max_abs, mean_abs, kl = compare(mine, got.log_probs)
        why = None
        if got.policy_version != policy_version:
            why = f"it scored the probe with version {got.policy_version} (a push it did not take)"
        elif not mean_abs <= bound:
            why = (
                f"its log-probs differ from the learner's by {mean_abs:.3g} per token on average, beyond "
                f"the bound {bound:g} for its {got.dtype or 'unknown-dtype'} engine "
                "(rpc.push_parity.max_mean_abs" + ("_bf16)" if half else ")")
            )
        return Verdict(address, got.policy_version, got.dtype, max_abs, mean_abs, kl, bound, why)

    def report(self, verdicts: list[Verdict], policy_version: int, secs: float) -> dict:
        """Each verdict logged and into the gauges; the metrics; `PushParityFailed` with `stop`."""
        failed = [v for v in verdicts if v.why is not None]
        for v in verdicts:
            if self.gauges is not None:
                self.gauges.parity(v.address, v.max_abs, v.mean_abs, v.kl, failed=v.why is not None)
        for v in failed:
            log.warning(
                "push parity: generation server %s does not serve the pushed policy version %d: %s "
                "(max |d log-prob| %.3g, mean %.3g, KL %.3g)",
                v.address, policy_version, v.why, v.max_abs, v.mean_abs, v.kl,
            )  # fmt: skip
        if not verdicts:
            return {}
        worst = {k: max(getattr(v, k) for v in verdicts) for k in ("max_abs", "mean_abs", "kl")}
        if not failed:
            log.info(
                "push parity v%d: %d server(s) serve it (max |d log-prob| %.2g, mean %.2g, KL %.2g; %.2f s)",
                policy_version, len(verdicts), worst["max_abs"], worst["mean_abs"], worst["kl"], secs,
            )  # fmt: skip
        if failed and self.settings.on_mismatch == "stop":
            v = failed[0]
            raise PushParityFailed(
                f"the run stops (rpc.push_parity.on_mismatch: stop): generation server {v.address} does not "
                f"serve the pushed policy version {policy_version}: {v.why}"
            )
        return {
            "push/parity_servers": len(verdicts),
            "push/parity_failures": len(failed),
            "push/parity_max_abs": worst["max_abs"],
            "push/parity_mean_abs": worst["mean_abs"],
            "push/parity_kl": worst["kl"],
            "push/parity_s": secs,
        }
