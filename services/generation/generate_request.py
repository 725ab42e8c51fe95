"""A Generate call's request read and checked, in the order the server checks it, and its response:

1. request-level errors first (no prompts, too many, bad sampling params), then what the request
   may cost from what is known before tokenizing (`check_cost`: token prompts' lengths, 1 for text
   and chat);
2. each prompt as token ids (`prompt_ids`), an error about one prompt carrying
   `Reason.PROMPT_INVALID` and its field `prompts[i]` (rollout workers isolate that prompt), then
   the cost again at the prompts' exact width;
3. the work's key (`work_key`: the caller's idempotency key with a digest of the request);
4. the response: each prompt's ids and its completions, their text decoded.

A ScoreTokens call (the push parity check's) is read by `read_scored`, under the same limits.
"""

from __future__ import annotations

import hashlib
import math
from typing import TYPE_CHECKING, cast

from ..common.rpc.errors import BadRequest, Reason, ResourceExhausted
from ..common.rpc.gen import generation_pb2 as gpb
from ..common.types import GenerationResult, SamplingParams, TokenScores
from .client import IDEMPOTENCY_KEY
from .decode import GREEDY_BELOW

if TYPE_CHECKING:
    from typing import Mapping, Protocol, Sequence

    from ..common.config import Config

    class _Tokenizer(Protocol):
        """What the server uses of a backend's tokenizer (a Hugging Face one: `load_tokenizer`)."""

        def __call__(self, text: str, add_special_tokens: bool = True) -> Mapping[str, list[int]]: ...

        def apply_chat_template(
            self, conversation: list[dict[str, str]], *, tokenize: bool, add_generation_prompt: bool
        ) -> str: ...

        def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = False) -> str: ...


def bad_prompt(field: str, why: str) -> BadRequest:
    """An error about one prompt of a request (`field` is `prompts[i]...`): it carries
    `Reason.PROMPT_INVALID` and the field, and the rest of the request is fine."""
    return BadRequest(f"{field}: {why}", Reason.PROMPT_INVALID, field=field)


def work_key(request, context) -> str | None:
    """The caller's idempotency key with a digest of the request: the same key on another
    request (a caller's bug) never gets the first one's answer."""
    key = dict(context.invocation_metadata()).get(IDEMPOTENCY_KEY) if context is not None else None
    if not key:
        return None
    return f"{key}:{hashlib.blake2b(request.SerializeToString(deterministic=True), digest_size=16).hexdigest()}"


class GenerateRequests:
    """Generate requests read in a backend's tokens: `tokenizer` and `vocab_size` are the
    backend's; `cfg` gives the limits (prompt_length, response_length, rpc.*) and the defaults
    (generation.*)."""

    def __init__(self, tokenizer, vocab_size: int, cfg: Config):
        self.tok = cast("_Tokenizer", tokenizer)
        self.vocab_size, self.cfg = vocab_size, cfg

    def read(self, request: gpb.GenerateRequest) -> tuple[list[list[int]], SamplingParams]:
        """The request's prompts as token ids and its sampling params. Request-level errors come
        first; an error about one prompt carries `Reason.PROMPT_INVALID` and the field
        `prompts[i]` (rollout workers isolate that prompt; see `bad_prompt`)."""
        if not request.prompts:
            raise BadRequest("prompts: empty batch (0 prompts)")
        if len(request.prompts) > self.cfg.rpc.max_prompts_per_request:
            raise BadRequest(
                f"prompts: {len(request.prompts)} prompts, more than {self.cfg.rpc.max_prompts_per_request}"
            )
        params = self.params(request.params)
        # a cheap lower bound before tokenizing anything: token prompts' lengths, 1 for text and chat
        known = [len(p.tokens.ids) for p in request.prompts if p.WhichOneof("input") == "tokens"]
        longest = self.cfg.prompt_length + self.cfg.response_length - 1  # a later turn's longest prompt
        width = min(max(known + [1]), longest)  # a longer prompt is refused on its own
        self.check_cost(
            len(request.prompts), width, params, exact=len(known) == len(request.prompts) and width == max(known)
        )
        prompts = [self.prompt_ids(i, p) for i, p in enumerate(request.prompts)]
        self.check_cost(len(prompts), max(len(p) for p in prompts), params, exact=True)
        return prompts, params

    def params(self, m: gpb.SamplingParams) -> SamplingParams:
        rpc, g = self.cfg.rpc, self.cfg.generation
        n = m.n or 1
        if not 1 <= n <= rpc.max_samples_per_prompt:
            raise BadRequest(f"params.n: {n} outside [1, {rpc.max_samples_per_prompt}]")
        temperature = m.temperature if m.HasField("temperature") else g.temperature
        if not math.isfinite(temperature) or not 0 <= temperature <= 10:
            raise BadRequest(f"params.temperature: {temperature} outside [0, 10]")
        if temperature < GREEDY_BELOW:
            temperature = 0.0  # greedy, as the backend treats it (dividing by a denormal overflows)
        top_p = m.top_p if m.HasField("top_p") else g.top_p
        if not math.isfinite(top_p) or not 0 < top_p <= 1:
            raise BadRequest(f"params.top_p: {top_p} outside (0, 1]")
        if m.top_k < 0:
            raise BadRequest(f"params.top_k: {m.top_k} is negative (0 turns top-k off)")
        max_new = m.max_new_tokens or self.cfg.response_length
        if not 1 <= max_new <= self.cfg.response_length:
            raise BadRequest(
                f"params.max_new_tokens: {max_new} outside [1, response_length={self.cfg.response_length}]"
            )
        bad = [t for t in m.stop_token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise BadRequest(f"params.stop_token_ids: {bad[0]} outside the vocabulary [0, {self.vocab_size})")
        return SamplingParams(
            n=n,
            temperature=temperature,
            top_p=top_p,
            top_k=m.top_k,
            max_new_tokens=max_new,
            stop_token_ids=list(m.stop_token_ids),
            seed=m.seed if m.HasField("seed") else None,
        )

    def check_cost(self, n_prompts: int, width: int, params: SamplingParams, exact: bool) -> None:
        """What one request may cost: prompts x n x (prompt width + max_new_tokens) token positions
        (the backend pads every prompt to the longest), at most rpc.max_request_tokens."""
        cost = n_prompts * params.n * (width + params.max_new_tokens)
        limit = self.cfg.rpc.max_request_tokens
        if cost > limit:
            raise ResourceExhausted(
                f"request: {n_prompts} prompts x n={params.n} x ({'' if exact else 'at least '}{width} prompt tokens "
                f"+ max_new_tokens={params.max_new_tokens}) = {cost} token positions, more than "
                f"rpc.max_request_tokens={limit}; send fewer prompts or samples per request",
                Reason.REQUEST_TOO_LARGE,
            )

    def prompt_ids(self, i: int, p: gpb.Prompt) -> list[int]:
        ids = self._tokens(i, p)
        if not ids:
            raise bad_prompt(f"prompts[{i}]", "empty prompt")
        first = p.first_prompt_tokens or len(ids)
        if first > len(ids):
            raise bad_prompt(f"prompts[{i}].first_prompt_tokens", f"{first}, more than the prompt's {len(ids)} tokens")
        if first > self.cfg.prompt_length:
            what = f"{len(ids)} tokens" if first == len(ids) else f"a conversation whose first prompt is {first} tokens"
            raise bad_prompt(f"prompts[{i}]", f"{what}, more than prompt_length={self.cfg.prompt_length}")
        if len(ids) - first >= self.cfg.response_length:
            raise bad_prompt(
                f"prompts[{i}]",
                f"{len(ids) - first} tokens of conversation after its first prompt leave no room for a reply "
                f"in response_length={self.cfg.response_length}",
            )
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise bad_prompt(f"prompts[{i}].tokens", f"token id {bad[0]} outside the vocabulary [0, {self.vocab_size})")
        return ids

    def _tokens(self, i: int, p: gpb.Prompt) -> list[int]:
        """Prompt `i`'s token ids as sent: its tokens, its text tokenized, or its chat through the
        tokenizer's chat template."""
        kind = p.WhichOneof("input")
        if kind == "tokens":
            return list(p.tokens.ids)
        if kind == "text":
            return self.tok(p.text)["input_ids"]
        if kind == "chat":
            if not p.chat.messages:
                raise bad_prompt(f"prompts[{i}].chat.messages", "empty")
            try:
                text = self.tok.apply_chat_template(
                    [{"role": m.role, "content": m.content} for m in p.chat.messages],
                    tokenize=False,
                    add_generation_prompt=True,
                )
            except Exception as e:  # the template refuses the conversation (roles out of order, ...)
                raise bad_prompt(f"prompts[{i}].chat", f"the chat template refused it: {e}") from None
            return self.tok(text, add_special_tokens=False)["input_ids"]
        raise bad_prompt(f"prompts[{i}]", "none of tokens, text, chat is set")

    def response(self, prompts: list[list[int]], res: GenerationResult) -> gpb.GenerateResponse:
        """Each prompt's ids and its completions (tokens, log-probs, finish reason, text, versions)."""
        out = gpb.GenerateResponse(policy_version=res.policy_version)
        for ids, comps in zip(prompts, res.completions):
            out.results.append(
                gpb.PromptResult(
                    prompt_token_ids=ids,
                    completions=[
                        gpb.Completion(
                            token_ids=c.token_ids,
                            log_probs=c.log_probs,
                            finish_reason=c.finish_reason,
                            text=self.tok.decode(c.token_ids, skip_special_tokens=True),
                            token_versions=c.token_versions or [],
                        )
                        for c in comps
                    ],
                )
            )
        return out


def read_scored(request: gpb.ScoreTokensRequest, vocab_size: int, cfg: Config) -> tuple[list[list[int]], list[int]]:
    """A ScoreTokens request's sequences and where each one's scored tokens start, checked under
    Generate's limits: at most rpc.max_prompts_per_request sequences, each at most prompt_length +
    response_length tokens with at least one of context and one scored, every id in the
    vocabulary, and rpc.max_request_tokens token positions in all."""
    seqs = request.sequences
    if not seqs:
        raise BadRequest("sequences: empty batch (0 sequences)")
    if len(seqs) > cfg.rpc.max_prompts_per_request:
        raise BadRequest(f"sequences: {len(seqs)} sequences, more than {cfg.rpc.max_prompts_per_request}")
    longest = cfg.prompt_length + cfg.response_length
    total = sum(len(q.token_ids) for q in seqs)
    if total > cfg.rpc.max_request_tokens:
        raise ResourceExhausted(
            f"request: {total} token positions, more than rpc.max_request_tokens={cfg.rpc.max_request_tokens}; "
            "send fewer or shorter sequences per request",
            Reason.REQUEST_TOO_LARGE,
        )
    out, starts = [], []
    for i, q in enumerate(seqs):
        ids, start, field = list(q.token_ids), q.prompt_tokens, f"sequences[{i}]"
        if not 1 <= start < len(ids):
            raise BadRequest(
                f"{field}.prompt_tokens: {start}, expected in [1, {len(ids)}) (at least one token of "
                "context and one to score)",
                field=f"{field}.prompt_tokens",
            )
        if len(ids) > longest:
            raise BadRequest(
                f"{field}: {len(ids)} tokens, more than prompt_length + response_length = {longest}", field=field
            )
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise BadRequest(
                f"{field}.token_ids: token id {bad[0]} outside the vocabulary [0, {vocab_size})",
                field=f"{field}.token_ids",
            )
        out.append(ids)
        starts.append(start)
    return out, starts


def scored_response(scores: TokenScores) -> gpb.ScoreTokensResponse:
    return gpb.ScoreTokensResponse(
        results=[gpb.TokenLogProbs(log_probs=lp) for lp in scores.log_probs],
        policy_version=scores.policy_version,
        dtype=scores.dtype,
    )
