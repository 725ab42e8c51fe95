"""Sampling from a transformers causal LM step by step, for the `hf` backend.

What `model.generate` would do, with three differences that matter for RLHF rollouts:
  1. each distinct prompt is prefilled once and its KV cache copied to its `n` samples (a group of
     8 samples per prompt no longer computes the prompt's forward 8 times);
  2. the sampled token's log-prob under the sampling distribution is kept at each step, so only one
     (rows, vocabulary) block of logits is alive at a time: memory does not grow with samples x
     steps x vocabulary as `output_scores=True` does;
  3. rows that have finished leave the batch (their cache rows dropped) once a quarter of it has,
     so a long tail of one sample does not make every finished one pay for its steps;
  4. new weights may come in between two steps (`between`, generation.weight_update: in_flight):
     the rows still decoding go on from their tokens so far, their keys and values recomputed
     under the new weights (one prefill of prompt + tokens so far: the tokens after the switch are
     what the new policy samples from that prefix) or kept as the old weights computed them
     (cheaper; the new policy then reads a context the old one encoded). `Decoded.switches` says
     from which token on each switch applies.

The sampling distribution is the one `generate` uses: logits / temperature, then top-k, then top-p;
greedy (temperature below `GREEDY_BELOW`) takes the argmax and records log-probs of the unscaled
distribution. For a fixed seed the draws are the same `torch.multinomial` calls on the same
probabilities (up to the float rounding of a different batch shape in the prefill).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
import torch.nn.functional as F
from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

from ..common.modeling import last_logits_kwargs
from ..common.padding import pad_left
from ..common.types import SamplingParams

# Temperatures below this sample greedily, exactly as temperature 0 does (log-probs then are of the
# unscaled distribution): dividing logits by a tiny or denormal temperature overflows to inf/NaN.
GREEDY_BELOW = 1e-5
# Finished rows are dropped from the batch once they are this share of it (each drop copies the cache)
COMPACT_AT = 0.25


@dataclass
class Decoded:
    """Per sample (prompt-major, `n` per prompt): its tokens up to and including the stop token,
    their log-probs, "stop" or "length"; `stopped` when `stop()` ended the batch early."""

    tokens: list[list[int]]
    logps: list[list[float]]
    finish: list[str]
    steps: int
    stopped: bool = False
    switches: list[int] = field(default_factory=list)  # token positions from which new weights sampled


def sampling_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The logits of the distribution a sample is drawn from (float32): / temperature, then top-k
    (0 = off), then top-p (1 = off), the removed tokens at -inf."""
    scores = logits.float() / params.temperature
    if params.top_k and params.top_k > 0:
        scores = TopKLogitsWarper(params.top_k)(None, scores)
    if params.top_p < 1.0:
        scores = TopPLogitsWarper(params.top_p)(None, scores)
    return scores


def pick(logits: torch.Tensor, params: SamplingParams) -> tuple[torch.Tensor, torch.Tensor]:
    """One decoding step for every row: the next tokens and their log-probs."""
    if params.temperature < GREEDY_BELOW:
        logp = F.log_softmax(logits.float(), dim=-1)
        tok = logp.argmax(-1)
    else:
        logp = F.log_softmax(sampling_logits(logits, params), dim=-1)
        tok = torch.multinomial(logp.exp(), num_samples=1).squeeze(1)
    return tok, logp.gather(-1, tok.unsqueeze(-1)).squeeze(-1)


def prefill(model, ids: torch.Tensor, attn: torch.Tensor):
    """A forward over left-padded `ids` (their `attn` mask): its cache, the last position's logits
    (the only ones computed) and each row's next position."""
    pos = (attn.cumsum(-1) - 1).clamp(min=0)
    out = model(input_ids=ids, attention_mask=attn, position_ids=pos, use_cache=True, **last_logits_kwargs(model))
    return out.past_key_values, out.logits[:, -1], pos[:, -1:] + 1


def step_forward(model, tok: torch.Tensor, attn: torch.Tensor, pos: torch.Tensor, cache) -> torch.Tensor:
    """One decoding step's forward over `cache`: each row's last token in, the logits of its next
    position out."""
    out = model(
        input_ids=tok.unsqueeze(1), attention_mask=attn, position_ids=pos, past_key_values=cache, use_cache=True
    )
    return out.logits[:, -1]


class Samples:
    """What each sample has drawn so far (on the CPU, one row per sample, prompt-major): its tokens
    and their log-probs, how many it keeps and whether a stop token ended it."""

    def __init__(self, N: int, T: int, pad_token_id: int):
        self.tokens = torch.full((N, T), pad_token_id, dtype=torch.long)
        self.logps = torch.zeros(N, T)
        self.length = torch.full((N,), T, dtype=torch.long)  # tokens kept per sample; T = cut at the limit
        self.ended = torch.zeros(N, dtype=torch.bool)

    def record(
        self, step: int, tok: torch.Tensor, lp: torch.Tensor, rows: torch.Tensor, live: torch.Tensor, stops
    ) -> None:
        """Step `step`'s token and log-prob of each live row of the batch into its sample (`rows`);
        a row that drew one of `stops` ends its sample there and leaves `live` (in place)."""
        tok_cpu, lp_cpu = tok.cpu(), lp.float().cpu()
        mine = rows[live]
        self.tokens[mine, step], self.logps[mine, step] = tok_cpu[live], lp_cpu[live]
        hit = torch.isin(tok, stops).cpu() & live
        self.length[rows[hit]] = step + 1
        self.ended[rows[hit]] = True
        live &= ~hit

    def decoded(self, steps: int, switches: list[int]) -> Decoded:
        N = len(self.length)
        return Decoded(
            [self.tokens[i, : self.length[i]].tolist() for i in range(N)],
            [self.logps[i, : self.length[i]].tolist() for i in range(N)],
            ["stop" if e else "length" for e in self.ended.tolist()],
            steps,
            switches=switches,
        )


def prefill_samples(model, prompts: Sequence[Sequence[int]], n: int, pad_token_id: int, device):
    """The prefill, once per prompt (only the last position's logits are computed), its cache,
    logits, mask and next positions then repeated for each prompt's `n` samples; and each sample's
    left-padded prompt ids (for a recomputed cache)."""
    ids, attn = pad_left(prompts, pad_token_id)
    ids, attn = ids.to(device), attn.to(device)
    cache, logits, next_pos = prefill(model, ids, attn)
    if n > 1:
        cache.batch_repeat_interleave(n)
        logits, attn = logits.repeat_interleave(n, 0), attn.repeat_interleave(n, 0)
        next_pos = next_pos.repeat_interleave(n, 0)
    return cache, logits, attn, next_pos, ids


def drop_finished(cache, live: torch.Tensor, device, tok, attn, next_pos, rows):
    """The batch without its finished rows: the cache's rows dropped (in place), the rows' last
    tokens, masks, next positions, samples and live flags kept for the others."""
    keep = live.nonzero().squeeze(1)
    keep_d = keep.to(device)
    cache.batch_select_indices(keep_d)
    return tok[keep_d], attn[keep_d], next_pos[keep_d], rows[keep], live[keep]


@torch.no_grad()
def decode(
    model,
    prompts: Sequence[Sequence[int]],
    params: SamplingParams,
    pad_token_id: int,
    stop_token_ids: Sequence[int],
    stop: Callable[[], bool] | None = None,
    between: Callable[[], bool] | None = None,
    recompute: bool = True,
) -> Decoded:
    """`params.n` samples of each prompt, at most `params.max_new_tokens` tokens each. `stop`,
    when given, is asked after every step; once it says True the batch ends (`stopped`).
    `between`, when given, runs between two steps and says whether it changed the model's
    weights; then the live rows' cache is recomputed (`recompute`) or kept."""
    device = next(model.parameters()).device
    n, T = params.n, params.max_new_tokens
    # 1. the prefill, once per prompt; only the last position's logits are computed
    cache, logits, attn, next_pos, ids = prefill_samples(model, prompts, n, pad_token_id, device)
    N = len(prompts) * n
    stops = torch.tensor(sorted(set(stop_token_ids)), device=device)
    out = Samples(N, T, pad_token_id)
    rows = torch.arange(N)  # the sample each row of the batch decodes
    live = torch.ones(N, dtype=torch.bool)  # rows of the batch still decoding
    steps = 0
    switches: list[int] = []
    prompt_ids = ids.repeat_interleave(n, 0) if n > 1 else ids  # per sample, for a recomputed cache
    for step in range(T):
        # 2. one token per row, its log-prob kept; the logits of this step are dropped after it
        tok, lp = pick(logits, params)
        out.record(step, tok, lp, rows, live, stops)
        steps = step + 1
        if stop is not None and stop():
            return Decoded([], [], [], steps, stopped=True)
        if not live.any() or step == T - 1:
            break
        # 3. finished rows leave once they are a quarter of the batch
        if (~live).sum() >= max(1, COMPACT_AT * len(live)):
            tok, attn, next_pos, rows, live = drop_finished(cache, live, device, tok, attn, next_pos, rows)
        tok = torch.where(live.to(device), tok, torch.full_like(tok, pad_token_id))
        attn = torch.cat([attn, attn.new_ones(attn.shape[0], 1)], dim=1)
        if between is not None and between():  # new weights, from the next token on
            switches.append(step + 1)
            if recompute:  # the whole context again, under them
                context = torch.cat([prompt_ids[rows.to(device)], out.tokens[rows, : step + 1].to(device)], dim=1)
                cache, logits, next_pos = prefill(model, context, attn)
                continue
        logits, next_pos = step_forward(model, tok, attn, next_pos, cache), next_pos + 1
    return out.decoded(steps, switches)
