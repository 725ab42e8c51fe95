"""A generation backend in this process behind the generation client's `generate`: what an
agent's endpoint samples through when the policy is in the same process (`rlhf eval`), with no
generation server. Its calls are batched as a server batches them (`Batcher`, or the backend's
own continuous batching), so many sessions' turns share a forward."""

from __future__ import annotations

from concurrent.futures import CancelledError
from typing import TYPE_CHECKING, Sequence

from ..common.rpc.client import Abandoned, Cancel
from ..common.servers import ServerPool
from .backend import GenerationStopped
from .batching import make_batcher

if TYPE_CHECKING:
    from ..common.config import Config
    from ..common.types import GenerationBackend, GenerationResult, SamplingParams

IN_PROCESS = "in-process"  # the one address of the pool: no host, no port


class InProcessClient:
    def __init__(self, backend: GenerationBackend, cfg: Config):
        self.batcher = make_batcher(backend, cfg)

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        timeout: float | None = None,
        key: str | None = None,
        first_prompt_tokens: Sequence[int] | None = None,
        cancel: Cancel | None = None,
    ) -> GenerationResult:
        """As `GenerationClient.generate`; `key` and `first_prompt_tokens` (a server's idempotency
        and prefix-cache hints) mean nothing in one process. `cancel` set: the work stops at its
        next decoding step (or never starts), `Abandoned`."""
        if cancel is None:
            return self.batcher.start([list(p) for p in prompts], params).result(timeout)
        cancel.check()
        future = self.batcher.start([list(p) for p in prompts], params, lambda: cancel.is_set)
        cancel.bind(future.cancel)
        try:
            return future.result(timeout)
        except (CancelledError, GenerationStopped):
            if cancel.is_set:
                raise Abandoned("the caller went away; its generation was stopped") from None
            raise

    def close(self) -> None:
        self.batcher.close()


def in_process_pool(backend: GenerationBackend, cfg: Config) -> ServerPool:
    """A pool of the one in-process 'server': `backend`, batched."""
    client = InProcessClient(backend, cfg)
    return ServerPool.fixed(IN_PROCESS, lambda _address: client)
