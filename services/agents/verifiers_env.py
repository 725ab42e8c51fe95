"""A verifiers environment as the agent of a session (`rollout.environment: verifiers:REF`;
verifiers_data.py loads it and makes its dataset the prompts).

Each session is one rollout of the environment, as prime-rl runs one, against the session's
endpoint, then the environment's rubric scores it:

    input  = the prompt's dataset row                 (metadata["verifiers"], else one made of it)
    state  = await env.rollout(input, client, model, sampling_args)   every turn through the endpoint
    await env.rubric.score_rollout(state)            each reward function, weighted and summed
    -> Reward(state["reward"], components=state["metrics"])

`client` is verifiers' OpenAIChatCompletionsClient over the session's AsyncOpenAI client; `model`
the name the endpoint serves (/v1/models); `sampling_args` the environment's own but `n` (the
endpoint samples with the training distribution whatever a request asks, and bounds max_tokens by
what is left of response_length). The reward's components are the rubric's per-function scores
(and its metrics, such as num_turns): each sample's score components, and `reward/<name>` in the
metrics.

A rollout that fails ends the session as AgentFailed (a dead letter, never a reward of 0): the
environment raised, or the rollout stopped on an error (`state["error"]`: a reply the environment
refused, a tool that failed, ...). A reward function that raised (verifiers would log it and score
0.0) or a reward that is not a finite number ends it as Unscored. A turn the endpoint refused
because the session's budget is spent (response_length, rollout.max_turns) ends the episode there,
truncated, and it is scored as it stands; so does an empty reply (verifiers' EmptyModelResponseError,
which it would retry: the policy sampled it, the endpoint recorded it, and a sample is one
conversation); a turn that found no generation server is an outage.
"""

from __future__ import annotations

import contextvars
import logging
import math
from typing import Callable

from .errors import AgentFailed, Unscored
from .protocol import budget_spent
from .scores import Reward
from .verifiers_data import load_env, ref_problem, rollout_input
from .verifiers_data import records as dataset_records

# the reward functions that raised during the scoring of the session in this context (verifiers'
# Rubric logs such a failure and scores the function 0.0)
_raised: contextvars.ContextVar[list[str] | None] = contextvars.ContextVar("verifiers_reward_raised", default=None)
RUBRIC_LOGGER = "verifiers.legacy.rubrics.rubric"  # the loggers of every Rubric (its __init__: module.Class)


class _RaisedReward(logging.Handler):
    """Records, for the session being scored in this context, a reward function's failure that
    verifiers' Rubric logs (and scores 0.0)."""

    def emit(self, record: logging.LogRecord) -> None:
        raised = _raised.get()
        if raised is not None and record.levelno >= logging.ERROR:
            raised.append(record.getMessage())


_handler = _RaisedReward(logging.ERROR)


# ------------------------------------------------ the kind's parts (common/environments.py asks them)
def check(ref: str) -> None:
    """The reference's syntax (verifiers_data.py); nothing imported."""
    problem = ref_problem(ref)
    if problem:
        raise ValueError(problem)


def agent(ref: str, rc) -> Callable:
    """The agent of a session of `ref`'s environment (built once in this process)."""
    return verifiers_agent(load_env(ref))


def records(ref: str, split: str, tokenizer, limit: int | None = None) -> list[dict] | None:
    """The environment's dataset ("train") or eval_dataset ("eval"; None when it has none) as rows
    of prompt records: data.train / data.eval `verifiers` take them."""
    return dataset_records(load_env(ref), split, tokenizer, limit)


def verifiers_agent(env) -> Callable:
    """The async agent of sessions of `env` (a vf.Environment)."""
    from verifiers.clients import OpenAIChatCompletionsClient

    rubric_logger = logging.getLogger(RUBRIC_LOGGER)
    if _handler not in rubric_logger.handlers:
        rubric_logger.addHandler(_handler)
    if rubric_logger.getEffectiveLevel() > logging.ERROR:  # VF_LOG_LEVEL=CRITICAL: still heard here
        rubric_logger.setLevel(logging.ERROR)  # (what verifiers' own handlers print keeps their level)
    sampling_args = {k: v for k, v in (env.sampling_args or {}).items() if k != "n"}
    served: list[str] = []

    async def run(client, sample) -> float:
        if not served:
            served.append((await client.models.list()).data[0].id)
        state = None
        raised: list[str] = []
        token = _raised.set(raised)
        try:
            state = await env.rollout(
                rollout_input(sample), OpenAIChatCompletionsClient(client), served[0], sampling_args
            )
            _check_rollout(state)
            await env.rubric.score_rollout(state)
        finally:
            _raised.reset(token)
            if state is not None:
                await env.rubric.cleanup(state)
        if raised:
            raise Unscored(f"verifiers: a reward function raised: {'; '.join(raised)}")
        reward, metrics = state.get("reward"), state.get("metrics") or {}
        if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
            raise Unscored(f"verifiers: the rubric gave reward {reward!r}, not a finite number")
        parts = {
            str(k): float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)
        }
        bad = {k: v for k, v in parts.items() if not math.isfinite(v)}
        if bad:
            raise Unscored(f"verifiers: the rubric gave {bad}, not finite numbers")
        return Reward(float(reward), parts)

    return run


def _check_rollout(state) -> None:
    """Raise what the rollout's error (`state["error"]`, if any) means: the endpoint's own error
    when no generation server answered (an outage, as AgentHost tells), AgentFailed for any other;
    nothing when the endpoint refused a turn because the session's budget was spent (the episode
    ends there, truncated) or the policy's reply was empty (the episode ends there)."""
    import openai
    from verifiers.errors import EmptyModelResponseError

    error = state.get("error")
    if error is None or isinstance(error, EmptyModelResponseError):  # the policy replied nothing
        return
    cause = _cause(error)
    if isinstance(cause, openai.BadRequestError) and budget_spent(cause):
        state["is_truncated"] = True
        return
    if isinstance(cause, openai.APIConnectionError) or (
        isinstance(cause, openai.APIStatusError) and cause.status_code in (429, 503)
    ):
        raise cause
    chain = " <- ".join(f"{type(e).__name__}: {e}" if str(e) else type(e).__name__ for e in _chain(error))
    raise AgentFailed(f"verifiers: the rollout stopped on an error: {chain}")


def _chain(error: BaseException) -> list[BaseException]:
    out: list[BaseException] = []
    e: BaseException | None = error
    while e is not None and e not in out:
        out.append(e)
        e = e.__cause__ or e.__context__
    return out


def _cause(error: BaseException) -> BaseException:
    """The first openai error of the chain, else the error itself."""
    import openai

    return next((e for e in _chain(error) if isinstance(e, openai.OpenAIError)), error)
