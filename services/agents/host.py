"""Agent functions (`rollout.agent`) run against an OpenAI-compatible endpoint of their own: the
rollout workers' samples, the learner's held-out eval and `rlhf eval` all run them through here.

    def run(client: openai.OpenAI, sample: PromptRecord) -> float          # or
    async def run(client: openai.AsyncOpenAI, sample: PromptRecord) -> float

`client` is bound to one session (its requests carry the session's id); `sample` is the prompt's
record (`prompt`, `label`, `metadata`); the return value is the session's reward. `AgentHost`
hosts the agents' endpoint (routes.py) on a free loopback port over a pool of generation servers and runs the
sessions, many at once (a thread each, or one event loop for async agents).

A session whose agent raises, runs past its timeout, returns what is not a finite number, or made
no request ends as `AgentFailed` (the worker dead-letters its prompt with that reason, never a
reward of 0); one whose reward could not be had (None, NaN, inf, not a number; an agent service
that gave none) as `Unscored`, an AgentFailed that says so. One that failed because no
generation server answered (`openai.APIConnectionError`, HTTP 429 or 503) ends as `Outage`: an
outage, not its input.

The hops of one session:
    AgentHost.run                 the sessions opened (the endpoint serves only those), run at once
      agent(client, sample)       the user's code: chat completions through the endpoint (routes.py)
      Session.record              the token-exact trajectory the endpoint recorded (sessions.py)
      Episode                     the reward or the failure, and the trajectory
A batch of sessions as training groups and eval rows is sampler.py (`AgentSampler`).
"""

from __future__ import annotations

import asyncio
import hashlib
import inspect
import logging
import math
import secrets
import socket
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

from ..common import environments
from ..common.lifecycle import HTTPServerThread
from ..common.rpc.client import reachable_host
from ..common.types import PromptRecord, SampleGroup, SamplingParams, ScoreResult
from ..common.userfn import load_function
from .errors import AgentFailed, AgentServiceDown, Outage, Unscored  # noqa: F401 (others import them from here)
from .handler import TurnHandler
from .protocol import SESSION_HEADER
from .routes import build_app, session_key
from .scores import Reward
from .session_store import Sessions
from .sessions import as_sample
from .turns import TurnSampler

if TYPE_CHECKING:
    from ..common.config import Config, RolloutConfig

log = logging.getLogger(__name__)

AGENT_TAKES = ("client", "sample")


def load_agent(rc: RolloutConfig) -> Callable:
    """The agent function of a session, from whichever of `rollout.agent` (your function),
    `rollout.environment` (an environment of any kind the registry knows, common/environments.py:
    your reset/step class, an OpenEnv environment, a verifiers Environment) or `rollout.agent_url`
    (your agent service, called by `http_agent`) is set; ValueError saying why not (it does not
    load, or takes other arguments)."""
    if rc.agent:
        return load_function(rc.agent, takes=AGENT_TAKES)
    if rc.environment:
        return environments.agent(rc.environment, rc)
    if rc.agent_url:
        return http_agent(rc.agent_url, rc.agent_timeout_s)
    raise ValueError("rollout: none of agent, environment, agent_url is set")


def http_agent(url: str, timeout_s: float) -> Callable:
    """An agent that is a service of yours over HTTP. For each session it is POSTed JSON
    `{"base_url", "api_key", "session_id", "headers", "reward_url", "sample": {"id", "prompt",
    "label", "metadata"}}`; it talks to `base_url` (OpenAI's API; every request with `headers`, the
    session's id) and answers 2xx when done, with `{"reward": r}` or after POSTing
    `{"reward": r}` to `reward_url`. A non-2xx answer fails the session (dead letter), as does
    an answer later than the session's timeout (a hung agent); none at all (the connection
    refused) is an outage of the service (the prompt stays pending)."""
    import httpx

    def run(client, sample) -> float:
        sid = client.default_headers[SESSION_HEADER]
        base = str(client.base_url).rstrip("/")
        task = {
            "base_url": base,
            "api_key": client.api_key,
            "session_id": sid,
            "headers": {SESSION_HEADER: sid},
            "reward_url": f"{base}/sessions/{sid}/reward",
            "sample": {"id": sample.id, "prompt": sample.prompt, "label": sample.label, "metadata": sample.metadata},
        }
        try:  # the session's own deadline ends it first when the service answers too late
            answer = httpx.post(url, json=task, timeout=httpx.Timeout(timeout_s + 5.0, connect=10.0))
        except httpx.TransportError as e:
            raise AgentServiceDown(f"the agent service at {url} did not answer: {type(e).__name__}: {e}") from None
        if not answer.is_success:
            raise AgentFailed(f"the agent service at {url} answered {answer.status_code}: {answer.text[:500]}")
        body = answer.json() if answer.content else {}
        if isinstance(body, dict) and "reward" in body:
            return body["reward"]
        auth = {"Authorization": f"Bearer {client.api_key}"}
        posted = httpx.get(f"{base}/sessions/{sid}", headers=auth, timeout=30).json().get("reward")
        if posted is None:
            raise Unscored(f"the agent service at {url} gave session {sid} no reward (none answered, none posted)")
        return posted

    return run


def session_name(uid: str, j: int, prefix: str = "") -> str:
    """A fresh session id for the `j`th session of prompt `uid`: `<uid>/<j>/<8 hex>`, the uid as
    it is when it is short printable ASCII, else its first 48 such characters and a digest of it
    (a session id goes in a header and is bounded: rpc.gateway.max_session_id_bytes >= 128)."""
    if len(uid) > 64 or not uid.isascii() or not uid.isprintable():
        shown = "".join(c for c in uid if c.isascii() and c.isprintable())[:48]
        uid = f"{shown}~{hashlib.sha256(uid.encode()).hexdigest()[:12]}"
    return f"{prefix}{uid}/{j}/{uuid.uuid4().hex[:8]}"


@dataclass
class Episode:
    """One session's end: its reward, or why it failed (`error`: AgentFailed or Outage),
    and the trajectory the endpoint recorded (None when it made no request); `components`: the
    reward's parts when the agent gave them (`Reward`)."""

    session_id: str
    reward: float | None
    error: Exception | None
    trajectory: dict | None
    components: dict[str, float] = field(default_factory=dict)


class AgentHost:
    """An agent function and the endpoint it talks to: the gateway's app over `servers` (a
    common/servers.py:ServerPool), on a free loopback port. Every request samples with
    `params` (the training distribution for rollouts, the eval's for an eval: whatever the agent
    asks, the learner's log-probs are of that distribution), one choice a request (a sample is one
    conversation), and only in a session opened here (a request of an ended session: 404)."""

    def __init__(
        self,
        agent: Callable,
        tokenizer,
        servers,
        params: SamplingParams,
        *,
        model_name: str,
        max_tokens: int,
        token: str | None,
        generate_timeout_s: float,
        timeout_s: float,
        max_turns: int | None = None,
        bind: tuple[str, int] = ("127.0.0.1", 0),
        advertise: str | None = None,
        per_token_s: float = 0.0,
        prompt_length: int | None = None,
        max_request_bytes: int = 8 << 20,
        max_session_id_bytes: int = 256,
        max_session_bytes: int | None = 16 << 20,
    ):
        """`bind`: the endpoint's host and port (0: a free one); `advertise`: the host the agents'
        URL names (an agent service elsewhere reaches it there; default the bound one, on
        loopback for a wildcard). A turn's deadline: `generate_timeout_s` plus `per_token_s` per
        token of every session in flight here (their turns share the servers' batches).
        `prompt_length` and the `max_*` bounds: as `rlhf serve gateway`'s (rpc.gateway); the
        sessions here are the worker's own, so they are bounded one by one, not together."""
        self.agent, self.timeout_s = agent, timeout_s
        self.secret = secrets.token_hex(32)  # this endpoint's: the session keys agents are given
        self.active = 0  # sessions in flight (runs may overlap: a worker's loops)
        self._active_lock = threading.Lock()
        self.generate_timeout_s, self.per_token_s, self.max_tokens = generate_timeout_s, per_token_s, max_tokens
        self.is_async = inspect.iscoroutinefunction(agent)
        self.sessions = Sessions(create_unknown=False, max_session_bytes=max_session_bytes)
        handler = TurnHandler(
            tokenizer,
            TurnSampler(servers, self.turn_deadline),
            self.sessions,
            model_name,
            max_tokens,
            max_n=1,
            pinned=params,
            max_turns=max_turns,
            prompt_length=prompt_length,
            max_session_id_bytes=max_session_id_bytes,
        )
        self.http = HTTPServerThread(
            build_app(handler, token, session_secret=self.secret, max_request_bytes=max_request_bytes),
            bind[0],
            bind[1],
            name="agent-endpoint",
        )
        port = self.http.start()
        self.base_url = f"http://{advertise or reachable_host(bind[0])}:{port}/v1"

    def turn_deadline(self) -> float:
        return self.generate_timeout_s + self.per_token_s * self.max_tokens * max(1, self.active)

    def close(self) -> None:
        self.http.stop()

    # ------------------------------------------------------------------ sessions
    def run(self, work: list[tuple[PromptRecord, str]], min_version: int = 0) -> list[Episode]:
        """One session per (record, session id), all at once, each ended (failed or not: a late
        request of its agent is refused, nothing more is kept); their episodes in order. Their
        turns go to a generation server at `min_version` or newer if there is one."""
        ids = [sid for _, sid in work]
        for sid in ids:  # the endpoint serves only sessions opened here
            self.sessions.open(sid, min_version)
        with self._active_lock:
            self.active += len(work)
        try:
            outcomes = asyncio.run(self._run_async(work)) if self.is_async else self._run_threads(work)
        finally:
            with self._active_lock:
                self.active -= len(work)
            sessions = [self.sessions.end(sid) for sid in ids]
        episodes = []
        for sid, outcome, session in zip(ids, outcomes, sessions):
            if isinstance(outcome, Exception):
                if isinstance(outcome, AgentFailed) and session is not None and session.unavailable:
                    # the agent failed after the endpoint found no generation server for it (an
                    # agent service answering 500 then, a wrapped 503): an outage, not its input
                    outcome = Outage(f"agent session {sid}: no generation server answered one of its turns ({outcome})")
                # not read: a late agent's turn may still hold the session
                episodes.append(Episode(sid, None, outcome, None))
                continue
            trajectories = session.record()["trajectories"] if session is not None else []
            trajectory = trajectories[-1] if trajectories and trajectories[-1]["turns"] else None
            if trajectory is None:
                episodes.append(
                    Episode(sid, None, AgentFailed(f"agent session {sid}: it made no chat completion request"), None)
                )
            elif len(trajectories) > 1:
                why = AgentFailed(
                    f"agent session {sid}: {len(trajectories)} trajectories (it rewrote its conversation "
                    "or sent n > 1); a sample is one conversation that extends itself"
                )
                episodes.append(Episode(sid, None, why, trajectory))
            else:
                episodes.append(Episode(sid, float(outcome), None, trajectory, getattr(outcome, "components", {})))
        return episodes

    def groups(
        self, items: list[tuple[PromptRecord, str, int]], min_version: int = 0
    ) -> list[SampleGroup | AgentFailed]:
        """The groups of several prompts (record, uid, group size), every session of them at once
        (`groups_of` their episodes)."""
        return groups_of(items, self.run(session_work(items), min_version))

    def _run_threads(self, work: list[tuple[PromptRecord, str]]) -> list:
        # not `with`: its exit waits for every thread, and a hung agent's never ends (it is left
        # to finish on its own; its session is ended, so the endpoint refuses what it asks next)
        pool = ThreadPoolExecutor(max_workers=max(1, len(work)), thread_name_prefix="agent")
        futures = [pool.submit(self._run_sync, record, sid) for record, sid in work]
        deadline = time.monotonic() + self.timeout_s
        out: list = []
        try:
            for (record, sid), f in zip(work, futures):
                try:
                    out.append(self._checked(sid, f.result(timeout=max(0.0, deadline - time.monotonic()))))
                except FutureTimeout:
                    out.append(self._late(record, sid))
                except (AgentFailed, Outage) as e:
                    out.append(e)
            return out
        finally:
            pool.shutdown(wait=False, cancel_futures=True)

    def _run_sync(self, record: PromptRecord, sid: str):
        import openai

        client = openai.OpenAI(
            base_url=self.base_url,
            api_key=session_key(self.secret, sid),
            default_headers={SESSION_HEADER: sid},
            max_retries=0,
        )
        try:
            return self.agent(client, record)
        except Exception as e:
            raise self._failure(sid, e) from None
        finally:
            client.close()

    async def _run_async(self, work: list[tuple[PromptRecord, str]]) -> list:
        import openai

        async def one(record: PromptRecord, sid: str):
            client = openai.AsyncOpenAI(
                base_url=self.base_url,
                api_key=session_key(self.secret, sid),
                default_headers={SESSION_HEADER: sid},
                max_retries=0,
            )
            try:
                return self._checked(sid, await asyncio.wait_for(self.agent(client, record), self.timeout_s))
            except asyncio.TimeoutError:
                return self._late(record, sid)
            except (AgentFailed, Outage) as e:
                return e
            except Exception as e:
                return self._failure(sid, e)
            finally:
                await client.close()

        return list(await asyncio.gather(*(one(r, s) for r, s in work)))

    def _late(self, record: PromptRecord, sid: str) -> AgentFailed:
        return AgentFailed(
            f"agent: session {sid} of prompt {record.id!r} ran past rollout.agent_timeout_s={self.timeout_s:g}"
        )

    @staticmethod
    def _failure(sid: str, e: Exception) -> Exception:
        import openai

        if isinstance(e, openai.APIConnectionError) or (
            isinstance(e, openai.APIStatusError) and e.status_code in (429, 503)
        ):
            return Outage(f"agent session {sid}: the endpoint could not sample ({e})")
        if isinstance(e, (AgentFailed, Outage)):  # an adapter's own verdict (http_agent)
            return e
        return AgentFailed(f"agent session {sid} raised {type(e).__name__}: {e}")

    @staticmethod
    def _checked(sid: str, reward):
        if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
            return Unscored(f"agent session {sid} returned {reward!r}, not a finite number")
        parts = getattr(reward, "components", {})
        if not all(isinstance(v, (int, float)) and math.isfinite(v) for v in parts.values()):
            return Unscored(f"agent session {sid} returned components {parts!r}, not all finite numbers")
        return reward if isinstance(reward, Reward) else float(reward)


def agent_host(cfg: Config, tokenizer, servers, params: SamplingParams, port: int | None = None) -> AgentHost:
    """The agent of `rollout` (`load_agent`) on an endpoint over `servers`, every turn sampled
    with `params` (a worker's: the training distribution; an eval's: eval_temperature). A turn's
    deadline like a worker's Generate: `rollout.generate_timeout_s` (default `rpc.timeout_s`) plus
    the budget per token of every session in flight. The endpoint binds `rollout.endpoint_host`
    and `port` (default `rollout.endpoint_port`; an eval's: 0); an agent service
    (`rollout.agent_url`) is handed it at `rpc.advertise_host`, or for a wildcard bind this host's
    own address, else the bound host."""
    rc = cfg.rollout
    base = rc.generate_timeout_s if rc.generate_timeout_s is not None else cfg.rpc.timeout_s
    advertise = None
    if rc.agent_url:
        wildcard = rc.endpoint_host in ("0.0.0.0", "::", "")
        advertise = cfg.rpc.advertise_host or (socket.gethostbyname(socket.gethostname()) if wildcard else None)
    return AgentHost(
        load_agent(rc),
        tokenizer,
        servers,
        params,
        model_name=cfg.model.path,
        max_tokens=cfg.response_length,
        token=cfg.rpc.resolved_auth_token(),
        generate_timeout_s=base,
        per_token_s=rc.generate_timeout_per_token_s,
        timeout_s=rc.agent_timeout_s,
        max_turns=rc.max_turns,
        bind=(rc.endpoint_host, rc.endpoint_port if port is None else port),
        advertise=advertise,
        prompt_length=cfg.prompt_length,
        max_request_bytes=cfg.rpc.gateway.max_request_bytes,
        max_session_id_bytes=cfg.rpc.gateway.max_session_id_bytes,
        max_session_bytes=cfg.rpc.gateway.max_session_bytes,
    )


def session_work(items: list[tuple[PromptRecord, str, int]]) -> list[tuple[PromptRecord, str]]:
    """The sessions of several prompts (record, uid, group size): (record, session id) each."""
    return [(record, session_name(uid, j)) for record, uid, n in items for j in range(n)]


def groups_of(items: list[tuple[PromptRecord, str, int]], episodes: list[Episode]) -> list[SampleGroup | AgentFailed]:
    """The groups of several prompts (record, uid, group size) from their sessions' episodes (in
    `session_work`'s order): per prompt its group (its version: the oldest policy version that
    sampled any of its turns) or why it failed (the first AgentFailed of its sessions). Raises
    Outage when any session met an outage (every prompt stays pending: the others may have met it
    too)."""
    it = iter(episodes)
    chunks = [[next(it) for _ in range(n)] for _, _, n in items]
    down = [e.error for chunk in chunks for e in chunk if isinstance(e.error, Outage)]
    if down:
        raise down[0]
    out: list[SampleGroup | AgentFailed] = []
    for (record, uid, _), chunk in zip(items, chunks):
        failed = [e.error for e in chunk if isinstance(e.error, AgentFailed)]
        samples = [as_sample(e.trajectory) for e in chunk if e.trajectory is not None]
        if failed:
            out.append(failed[0])
        elif len({tuple(p) for p, _ in samples}) != 1:
            out.append(
                AgentFailed(f"prompt {uid}: its sessions began with different prompts; a group shares its prompt")
            )
        else:
            versions = [v for e in chunk if e.trajectory is not None for v in e.trajectory["policy_versions"]]
            rewards = [float(e.reward) for e in chunk if e.reward is not None and math.isfinite(e.reward)]
            if len(rewards) < len(chunk):  # `run` gives none such (`_checked`): never read as 0
                out.append(Unscored(f"prompt {uid}: a session of it has no reward"))
                continue
            scores = [ScoreResult(r, {**e.components, "agent": r}) for r, e in zip(rewards, chunk)]
            out.append(SampleGroup(uid, record, samples[0][0], [c for _, c in samples], scores, None, min(versions)))
    return out
