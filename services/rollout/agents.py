"""Agent rollouts (`rollout.agent`): each sample of a group is a session a user's agent function
runs against this worker's OpenAI-compatible endpoint, and its token-exact trajectory (the
environment's tokens masked out of the loss) is the sample.

    def run(client: openai.OpenAI, sample: PromptRecord) -> float          # or
    async def run(client: openai.AsyncOpenAI, sample: PromptRecord) -> float

`client` is bound to the sample's session (its requests carry the session's id); `sample` is the
prompt's record (`prompt`, `label`, `metadata`); the return value is the sample's reward. The
worker hosts the endpoint itself (`services.gateway`, on a free loopback port, over the worker's
own pool of generation servers), so a session's turns go to one server while it lives.

A session whose agent raises, runs past `rollout.agent_timeout_s`, returns what is not a finite
number, or made no request ends as `AgentFailed`: the worker dead-letters its prompt with that
reason (never a reward of 0). An agent that failed because no generation server answered
(`openai.APIConnectionError`, HTTP 503) leaves the prompt pending instead: an outage, not its input.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Callable

from ..common.lifecycle import HTTPServerThread
from ..common.types import PromptRecord, SampleGroup, ScoreResult
from ..common.userfn import load_function
from ..gateway.app import SESSION_HEADER, Gateway, Sampler, build_app
from ..gateway.sessions import Sessions, as_sample

log = logging.getLogger(__name__)


class AgentFailed(ValueError):
    """The agent of a session failed in a way that is its input's (or its code's): the prompt
    is dead-lettered with this message."""


class GenerationDown(RuntimeError):
    """The agent's requests found no generation server: the prompt stays pending."""


class AgentRunner:
    """Runs `agent` for every sample of a prompt's group, the sessions at once, each against the
    endpoint at `base_url` with the run's `token`; `sessions` is that endpoint's session table."""

    def __init__(self, agent: Callable, base_url: str, token: str | None, sessions: Sessions, timeout_s: float):
        self.agent, self.base_url, self.token = agent, base_url, token or "unused"
        self.sessions, self.timeout_s = sessions, timeout_s
        self.is_async = inspect.iscoroutinefunction(agent)

    def group(self, record: PromptRecord, uid: str, n: int) -> SampleGroup:
        """`n` sessions of the agent on `record`, as one group (its version: the oldest policy
        version that sampled any of its turns)."""
        ids = [f"{uid}/{j}/{uuid.uuid4().hex[:8]}" for j in range(n)]
        for sid in ids:  # the endpoint serves only sessions opened here
            self.sessions.open(sid)
        try:
            rewards = self._run_all(record, ids)
            records = [self.sessions.find(sid) for sid in ids]
        finally:  # ended, failed or not: a late request of its agent is refused, nothing kept
            for sid in ids:
                self.sessions.end(sid)
        prompts, completions, versions = [], [], []
        for sid, reward, session in zip(ids, rewards, records):
            trajectories = session.record()["trajectories"] if session is not None else []
            if not trajectories or trajectories[-1]["turns"] == 0:
                raise AgentFailed(f"agent session {sid}: it made no chat completion request")
            if len(trajectories) > 1:
                raise AgentFailed(
                    f"agent session {sid}: {len(trajectories)} trajectories (it rewrote its conversation "
                    "or sent n > 1); a sample is one conversation that extends itself"
                )
            prompt, completion = as_sample(trajectories[0])
            prompts.append(prompt)
            completions.append(completion)
            versions.extend(trajectories[0]["versions"])
        if len({tuple(p) for p in prompts}) != 1:
            raise AgentFailed(f"prompt {uid}: its sessions began with different prompts; a group shares its prompt")
        scores = [ScoreResult(r, {"agent": r}) for r in rewards]
        return SampleGroup(uid, record, prompts[0], completions, scores, None, min(versions))

    def _run_all(self, record: PromptRecord, ids: list[str]) -> list[float]:
        if self.is_async:
            return asyncio.run(self._run_async(record, ids))
        # not `with`: its exit waits for every thread, and a hung agent's never ends (it is left
        # to finish on its own; its session is ended, so the endpoint refuses what it asks next)
        pool = ThreadPoolExecutor(max_workers=len(ids), thread_name_prefix="agent")
        futures = [pool.submit(self._run_sync, record, sid) for sid in ids]
        deadline = time.monotonic() + self.timeout_s
        try:
            return [
                self._checked(sid, f.result(timeout=max(0.0, deadline - time.monotonic())))
                for sid, f in zip(ids, futures)
            ]
        except FutureTimeout:
            raise AgentFailed(
                f"agent: a session of prompt {record.id!r} ran past rollout.agent_timeout_s={self.timeout_s:g}"
            ) from None
        finally:
            pool.shutdown(wait=False, cancel_futures=True)

    def _run_sync(self, record: PromptRecord, sid: str):
        import openai

        client = openai.OpenAI(
            base_url=self.base_url, api_key=self.token, default_headers={SESSION_HEADER: sid}, max_retries=0
        )
        try:
            return self._call(lambda: self.agent(client, record), sid)
        finally:
            client.close()

    async def _run_async(self, record: PromptRecord, ids: list[str]) -> list[float]:
        import openai

        async def one(sid: str):
            client = openai.AsyncOpenAI(
                base_url=self.base_url, api_key=self.token, default_headers={SESSION_HEADER: sid}, max_retries=0
            )
            try:
                return self._checked(sid, await self._acall(client, record, sid))
            finally:
                await client.close()

        try:
            return list(await asyncio.wait_for(asyncio.gather(*(one(s) for s in ids)), self.timeout_s))
        except asyncio.TimeoutError:
            raise AgentFailed(
                f"agent: a session of prompt {record.id!r} ran past rollout.agent_timeout_s={self.timeout_s:g}"
            ) from None

    async def _acall(self, client, record: PromptRecord, sid: str):
        try:
            return await self.agent(client, record)
        except Exception as e:
            raise self._failure(sid, e) from None

    def _call(self, fn: Callable, sid: str):
        try:
            return fn()
        except Exception as e:
            raise self._failure(sid, e) from None

    @staticmethod
    def _failure(sid: str, e: Exception) -> Exception:
        import openai

        if isinstance(e, openai.APIConnectionError) or (
            isinstance(e, openai.APIStatusError) and e.status_code in (429, 503)
        ):
            return GenerationDown(f"agent session {sid}: the endpoint could not sample ({e})")
        return AgentFailed(f"agent session {sid} raised {type(e).__name__}: {e}")

    @staticmethod
    def _checked(sid: str, reward) -> float:
        if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
            raise AgentFailed(f"agent session {sid} returned {reward!r}, not a finite number")
        return float(reward)


class WorkerEndpoint:
    """The OpenAI-compatible endpoint a rollout worker hosts for its agents: the gateway's app
    over the worker's pool of generation servers, on a free loopback port. Every request samples
    with the training distribution (`pinned`: the learner's log-probs are of it), one choice at a
    time (a sample is one conversation), and only in a session the worker opened."""

    def __init__(self, tokenizer, servers, model_name: str, max_tokens: int, pinned, token: str | None, timeout_s):
        self.sessions = Sessions(create_unknown=False)
        gateway = Gateway(
            tokenizer, Sampler(servers, timeout_s), self.sessions, model_name, max_tokens, max_n=1, pinned=pinned
        )
        self.http = HTTPServerThread(build_app(gateway, token), "127.0.0.1", 0, name="agent-endpoint")
        self.base_url = f"http://127.0.0.1:{self.http.start()}/v1"

    def close(self) -> None:
        self.http.stop()


AGENT_TAKES = ("client", "sample")


def load_agent(ref: str) -> Callable:
    """The agent function `ref` names (`rollout.agent`); ValueError saying why not."""
    return load_function(ref, takes=AGENT_TAKES)
