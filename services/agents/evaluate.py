"""The held-out eval as each caller opens it: `held_out_evaluator` makes the one choice of how a
prompt is sampled (training/evaluate.py:`how_sampled`) and gives the `Evaluator` over that sampler
(the one sampling seam, training/sampling.py): one completion per sample (`ReplySampler`), or the
sessions of an agent (`rollout.agent`, `environment` or `agent_url`) through an `AgentHost`
(host.py) over the generation servers the caller opens (sampler.py:`AgentSampler`: each session an
eval row with its conversation). The learner's eval (`rlhf up`), `train --local` and `rlhf eval`
open it here.
"""

from __future__ import annotations

import contextlib
import threading
from typing import TYPE_CHECKING, Callable, ContextManager, Iterator

from ..common.servers import ServerPool
from ..common.types import SamplingParams
from ..training.evaluate import Evaluator, HowSampled, how_sampled
from ..training.sampling import ReplySampler
from .host import agent_host
from .sampler import AgentSampler

if TYPE_CHECKING:
    from ..common.config import Config


@contextlib.contextmanager
def held_out_evaluator(
    cfg: Config,
    tokenizer,
    params: SamplingParams,
    *,
    backend,
    scorer,
    servers: Callable[[], ContextManager[ServerPool]],
    proxy=None,
    batch: int | None = None,
    turn_params: SamplingParams | None = None,
    rule: str | None = None,
) -> Iterator[Evaluator]:
    """The held-out eval of the policy, sampled as `how_sampled(cfg, rule)` says:
    - one reply: `params.n` completions of each prompt by `backend` (a `GenerationBackend`), scored
      by `scorer` (and `proxy`), `batch` prompts per generate call (None: all at once);
    - an agent's sessions: `servers()` opens the pool of generation servers the agent's endpoint
      samples from (closed after), every turn with `turn_params` (default `params`), `params.n`
      sessions per prompt, generation.max_batch_size prompts' sessions at once."""
    if how_sampled(cfg, rule) is HowSampled.REPLY:
        yield Evaluator(ReplySampler(backend, scorer, tokenizer, params, proxy=proxy), batch)
        return
    with servers() as pool:
        host = agent_host(cfg, tokenizer, pool, turn_params or params, port=0)
        try:
            sessions = AgentSampler(cfg, host, tokenizer, None, threading.Event(), group_size=params.n, backoff_s=0)
            yield Evaluator(sessions, cfg.generation.max_batch_size)
        finally:
            host.close()
