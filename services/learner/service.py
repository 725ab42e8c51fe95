"""The learner service: feeds prompts, trains on trajectories from the replay buffer with the same
PPO step as the in-process trainer, pushes every new policy to all registered generation servers,
checkpoints, evaluates, and reports status.

    rlhf serve learner -c configs/tiny-cpu.yaml --set replay.url=redis://127.0.0.1:6379/0

One iteration:
    feed prompts up to `max_staleness` batches ahead      (ns:prompts; workers sample them)
    read rollout_batch_size groups                        (ns:trajectories, consumer group "learner")
        a prompt already trained -> dropped as a duplicate
        policy version older than max_staleness -> dropped, its prompt fed again
    PPOLearner.step (critic trained over gRPC)            -> policy version N+1
    push version N+1 to every live generation server
    every checkpoint_interval: checkpoint, then acknowledge the trajectories it includes
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from http.server import ThreadingHTTPServer
from pathlib import Path

import grpc
import torch

from ..common.data import EpochSampler, load_prompts
from ..common.modeling import load_tokenizer
from ..common.replay import ReplayStore
from ..common.rpc.gen import learner_pb2_grpc
from ..common.rpc.server import RPCServer, advertised_address, endpoint_address
from ..common.runlog import RunLog
from ..critic.client import CriticClient, OverlappedCritic
from ..generation.client import GenerationClient
from ..reward.client import RewardClient
from ..rollout.collect import eval_params, groups_to_rollout
from ..rollout.records import group_from_proto, make_task
from .local import evaluate
from .ppo_step import PPOLearner, planned_updates, ptx_examples_for
from .server import LearnerMetrics, LearnerServicer, status_http

log = logging.getLogger(__name__)

CHECKPOINT_KEEP = 2


# ---------------------------------------------------------------------------- checkpoints
def latest_checkpoint(run_dir: Path) -> Path | None:
    """The newest complete checkpoint (a directory with learner.pt; written to a temporary name,
    then renamed, so a crash mid-write leaves no half checkpoint)."""
    root = run_dir / "checkpoints"
    done = sorted(p for p in root.glob("iter_*") if (p / "learner.pt").exists()) if root.exists() else []
    return done[-1] if done else None


class LearnerService:
    def __init__(self, cfg, run_dir: str | Path | None = None):
        self.cfg = cfg
        self.run_dir = Path(run_dir or cfg.run.run_dir).resolve()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.store = ReplayStore.from_config(cfg)
        self.tokenizer = load_tokenizer(cfg.model.path)
        self.train = load_prompts(cfg.data.train, "train", self.tokenizer, cfg.data.prompt_key, cfg.data.label_key,
                                  seed=cfg.run.seed)
        self.held_out = load_prompts(cfg.data.eval, "eval", self.tokenizer, cfg.data.prompt_key,
                                     cfg.data.label_key, limit=cfg.data.eval_size, seed=cfg.run.seed)
        self._check_prompt_lengths()
        self.sampler = EpochSampler(self.train, cfg.run.seed)
        self.learner = PPOLearner(cfg, total_updates=planned_updates(cfg),
                                  ptx_examples=ptx_examples_for(cfg, self.tokenizer, self.train))
        self.critic = None
        if cfg.needs_critic:
            self.critic = CriticClient(endpoint_address(cfg.rpc.critic), cfg.rpc)
            if cfg.critic.overlap_training:
                self.critic = OverlappedCritic(self.critic)
        self.reward = RewardClient(endpoint_address(cfg.rpc.reward), cfg.rpc)
        self.stop_event = threading.Event()
        self.state = "starting"
        self.iteration = 0
        self.fed_batches = 0
        self.dead_cursor = "0-0"
        self.uncommitted: list[tuple[bytes, str]] = []  # (trajectory entry id, prompt uid) trained, not checkpointed
        self._uncommitted_uids: set[str] = set()
        self._gen_rates: list[float] = []  # generation tokens/s of the Generate calls behind a batch
        self._queue: deque = deque()  # (entry id, record, already trained) read, not yet examined
        self.counters = {"trained_groups": 0, "dropped_stale": 0, "duplicates": 0, "dead_letters": 0}
        self.last = {"reward": float("nan"), "eval": float("nan")}
        self.snapshot: tuple[int, dict] = (0, {})
        self._gen_clients: dict[str, GenerationClient] = {}
        self.server: RPCServer | None = None
        self.http: ThreadingHTTPServer | None = None
        self.t_start = time.time()
        self.baseline: float | None = None
        self.resumed_from: int | None = None

    def _check_prompt_lengths(self) -> None:
        too_long = [(r.id, n) for r in self.train if (n := len(self.tokenizer(r.prompt)["input_ids"])) >
                    self.cfg.prompt_length]
        if too_long:
            ex = ", ".join(f"{i!r} ({n} tokens)" for i, n in too_long[:5])
            raise ValueError(f"{len(too_long)} training prompts are longer than prompt_length="
                             f"{self.cfg.prompt_length}: {ex}")

    # ------------------------------------------------------------------ serving
    def address(self) -> str:
        return advertised_address(self.cfg.rpc, self.cfg.rpc.learner.host, self.server.port)

    def start_server(self, port: int | None = None, metrics_port: int | None = -1,
                     http_port: int | None = -1) -> RPCServer:
        ep = self.cfg.rpc.learner
        self.server = RPCServer("learner", self.cfg.rpc, ep.port if port is None else port,
                                ep.metrics_port if metrics_port == -1 else metrics_port, host=ep.host)
        learner_pb2_grpc.add_LearnerServicer_to_server(LearnerServicer(self), self.server.grpc)
        self.metrics = LearnerMetrics(self.server.metrics.registry)
        self.server.start()
        hp = ep.http_port if http_port == -1 else http_port
        if hp is not None:
            self.http = status_http(self, ep.host, hp)
        return self.server

    def status(self) -> dict:
        return {"iteration": self.iteration, "total_iterations": self.cfg.run.iterations,
                "policy_version": self.learner.version, "state": self.state,
                "last_reward": self.last["reward"], "last_eval_reward": self.last["eval"], **self.counters,
                "generation_servers": len(self._live_servers(quiet=True)), "replay_backlog": self._safe_backlog(),
                "uptime_s": round(time.time() - self.t_start, 1), "resumed_from": self.resumed_from}

    def _safe_backlog(self) -> int:
        try:
            return self.store.backlog()
        except Exception:
            return -1

    def _live_servers(self, quiet: bool = False) -> dict:
        try:
            return self.store.live("generation")
        except Exception:
            if quiet:
                return {}
            raise

    # ------------------------------------------------------------------ weights
    def _take_snapshot(self, version: int) -> dict:
        state = self.learner.policy_state_dict()
        if self.learner.device.type == "cpu" and not self.learner.lora:  # views of the live parameters
            state = {k: v.clone() for k, v in state.items()}
        self.snapshot = (version, state)
        return state

    def _gen_client(self, address: str) -> GenerationClient:
        if address not in self._gen_clients:
            self._gen_clients[address] = GenerationClient(address, self.cfg.rpc)
        return self._gen_clients[address]

    def _push_one(self, address: str, state: dict, version: int) -> tuple[str, float | None]:
        client = self._gen_client(address)
        try:
            client.update_weights(state, version)
            self.store.heartbeat("generation", address, version=version)  # workers see it at once
            return address, None
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.INVALID_ARGUMENT and "not newer" in (e.details() or ""):
                return address, None  # it pulled this version itself a moment ago
            log.warning("push of version %d to %s failed: %s %s (it will pull when it sees it is behind)",
                        version, address, e.code().name, e.details())
            return address, float("nan")

    def push(self, version: int) -> dict:
        """Push policy `version` to every live generation server, in parallel; then publish it."""
        t0 = time.perf_counter()
        state = self._take_snapshot(version)
        servers = list(self._live_servers())
        failed = 0
        if servers:
            with ThreadPoolExecutor(max_workers=min(len(servers), 16)) as pool:
                for _, err in pool.map(lambda a: self._push_one(a, state, version), servers):
                    failed += err is not None
        self.store.publish_learner(self.address(), version)
        nbytes = sum(t.numel() * t.element_size() for t in state.values())
        secs = time.perf_counter() - t0
        return {"time/push_s": secs, "push/servers": len(servers), "push/failed": failed,
                "push/mb_per_s": nbytes * max(len(servers), 1) / max(secs, 1e-9) / 1e6}

    # ------------------------------------------------------------------ prompts
    def _feed_batch(self, n: int) -> None:
        v = self.learner.version
        tasks = [make_task(rec, epoch, v, v, self.cfg.num_return_sequences_in_group)
                 for epoch, rec in self.sampler.take_with_epochs(n)]
        self.store.feed(tasks)

    def feed(self, iteration: int) -> None:
        """Keep the prompt stream `max_staleness` batches ahead of training (0: exactly this batch)."""
        target = min(iteration + self.cfg.max_staleness, self.cfg.run.iterations)
        while self.fed_batches < target:
            self._feed_batch(self.cfg.rollout_batch_size)
            self.fed_batches += 1

    def _replace_dead_letters(self) -> None:
        dead = self.store.read_dead(self.dead_cursor)
        for entry_id, task, error in dead:
            log.error("prompt %s was dead-lettered (%s); feeding a replacement", task.uid, error)
            self.dead_cursor = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
            self._feed_batch(1)
            self.counters["dead_letters"] += 1

    # ------------------------------------------------------------------ trajectories
    def _enqueue(self, entries: list) -> None:
        """Queue read entries with whether their prompt is already trained (one round trip)."""
        trained = self.store.trained_among([m.task.uid for _, m in entries])
        self._queue.extend((e, m, t) for (e, m), t in zip(entries, trained))

    def collect(self, pending_first: bool = False) -> list | None:
        """rollout_batch_size fresh, unique groups as [(entry id, SampleGroup)]; None when stopping."""
        cfg = self.cfg
        want = cfg.rollout_batch_size
        if pending_first:
            self._enqueue(self.store.read_trajectories(1 << 20, pending=True))
            if self._queue:
                log.info("re-reading %d trajectory groups read before the restart and not checkpointed",
                         len(self._queue))
        batch, uids = [], set()
        self._gen_rates = []
        t0 = last_report = time.time()
        while len(batch) < want:
            if self.stop_event.is_set():
                return None
            if not self._queue:
                self._replace_dead_letters()
                self._enqueue(self.store.read_trajectories(want - len(batch), cfg.replay.block_ms))
                if not self._queue:
                    if time.time() - last_report > 30:
                        last_report = time.time()
                        log.info("waiting for trajectories: %d/%d groups after %.0fs (prompts queued %d, "
                                 "workers %d, generation servers %d)", len(batch), want, time.time() - t0,
                                 self.store.prompt_backlog(), len(self.store.live("worker")),
                                 len(self._live_servers()))
                    continue
            entry_id, msg, trained = self._queue.popleft()
            uid = msg.task.uid
            if trained or uid in uids or uid in self._uncommitted_uids:
                self.store.discard(entry_id)
                self.counters["duplicates"] += 1
                continue
            staleness = self.learner.version - msg.policy_version
            if staleness > cfg.max_staleness or staleness < 0:
                refeed = type(msg.task)()
                refeed.CopyFrom(msg.task)
                refeed.attempt += 1
                refeed.min_version = refeed.fed_at_version = self.learner.version
                self.store.discard(entry_id, refeed)
                self.counters["dropped_stale"] += 1
                log.info("dropped group %s from policy version %d (learner at %d, max_staleness %d); fed again",
                         uid, msg.policy_version, self.learner.version, cfg.max_staleness)
                continue
            try:
                group = group_from_proto(msg)
            except ValueError as e:
                log.error("malformed trajectory %s dropped: %s", entry_id, e)
                self.store.discard(entry_id)
                continue
            batch.append((entry_id, group))
            if msg.generate_seconds > 0:
                self._gen_rates.append(msg.batch_tokens / msg.generate_seconds)
            uids.add(uid)
        return batch

    # ------------------------------------------------------------------ checkpoint / resume
    def save_checkpoint(self) -> Path:
        root = self.run_dir / "checkpoints"
        final = root / f"iter_{self.iteration:06d}"
        tmp = root / f".tmp_iter_{self.iteration:06d}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        if self.critic is not None:
            self.critic.save(str(final / "critic"))  # the critic server writes it (shared disk)
        torch.save({"learner": self.learner.state_dict(), "sampler": self.sampler.state_dict(),
                    "iteration": self.iteration, "fed_batches": self.fed_batches, "dead_cursor": self.dead_cursor,
                    "commit": [(e.decode() if isinstance(e, bytes) else e, u) for e, u in self.uncommitted],
                    "counters": dict(self.counters), "baseline": self.baseline, "torch_rng": torch.get_rng_state()},
                   tmp / "learner.pt")
        if final.exists():
            for f in tmp.iterdir():
                os.replace(f, final / f.name)
            tmp.rmdir()
        else:
            tmp.rename(final)
        self.store.commit(self.uncommitted)
        if self.uncommitted:  # the ledger of trained prompts: one line per checkpoint
            with (self.run_dir / "trained.jsonl").open("a") as f:
                f.write(json.dumps({"iteration": self.iteration, "uids": [u for _, u in self.uncommitted]}) + "\n")
        self.uncommitted, self._uncommitted_uids = [], set()
        for old in sorted(p for p in root.glob("iter_*") if (p / "learner.pt").exists())[:-CHECKPOINT_KEEP]:
            shutil.rmtree(old, ignore_errors=True)
        log.info("checkpoint %s written; trained trajectories acknowledged", final.name)
        return final

    def resume(self) -> int:
        """Load the newest checkpoint if there is one; otherwise start the namespace afresh.
        Returns the iteration to continue after."""
        ckpt = latest_checkpoint(self.run_dir)
        if ckpt is None:
            prior = self._live_servers(quiet=True)
            n = self.store.reset()
            if n:
                log.info("fresh run: cleared %d keys of replay namespace %r", n, self.store.ns)
            top = max((int(i.get("version", 0)) for i in prior.values()), default=0)
            if top > 0:  # servers left over from an earlier run serve newer-numbered weights
                self.store.r.set(self.store.version_key, top)
                self.learner.version = self.store.next_version()
            return 0
        state = torch.load(ckpt / "learner.pt", weights_only=True)
        self.learner.load_state_dict(state["learner"])
        self.sampler.load_state_dict(state["sampler"])
        torch.set_rng_state(state["torch_rng"])
        self.iteration, self.fed_batches = int(state["iteration"]), int(state["fed_batches"])
        self.dead_cursor, self.baseline = state["dead_cursor"], state["baseline"]
        self.counters.update(state["counters"])
        self.store.commit([(e, u) for e, u in state["commit"]])  # in case the crash came before the commit
        if self.critic is not None and (ckpt / "critic").exists():
            self.critic.load(str(ckpt / "critic"))
        # versions only go forward: the restored weights get a number above anything served
        self.learner.version = self.store.next_version()
        self.resumed_from = self.iteration
        log.info("resumed from checkpoint %s (iteration %d); policy is now version %d", ckpt.name, self.iteration,
                 self.learner.version)
        return self.iteration

    # ------------------------------------------------------------------ the loop
    def run(self) -> dict:
        cfg = self.cfg
        start_it = self.resume()
        resumed = self.resumed_from is not None
        self.state = "pushing"
        if self.learner.version > 0:
            self.push(self.learner.version)
        else:
            self._take_snapshot(0)
            self.store.publish_learner(self.address(), 0)
        runlog = RunLog(self.run_dir, cfg, mode=f"distributed (max_staleness={cfg.max_staleness})",
                        resume_from=start_it if resumed else None)
        ev = eval_params(cfg)
        if self.baseline is None:
            self.state = "evaluating"
            base = self._evaluate(ev)
            self.baseline = base["eval/reward_mean"]
            runlog.log_eval(0, base)
        self.last["eval"] = self.baseline
        it = start_it
        stopped = False
        for it in range(start_it + 1, cfg.run.iterations + 1):
            t0 = time.perf_counter()
            self.feed(it)
            self.state = "waiting"
            batch = self.collect(pending_first=resumed and it == start_it + 1)
            if batch is None:
                stopped, it = True, it - 1
                break
            t1 = time.perf_counter()
            self.state = "training"
            rollout = groups_to_rollout([g for _, g in batch])
            staleness = [self.learner.version - v for v in rollout.versions]
            metrics = self.learner.step(rollout, self.critic)
            self.learner.version = self.store.next_version()
            t2 = time.perf_counter()
            self.state = "pushing"
            metrics.update(self.push(self.learner.version))
            self.iteration = it
            self.uncommitted.extend((e, g.uid) for e, g in batch)
            self._uncommitted_uids.update(g.uid for _, g in batch)
            self.counters["trained_groups"] += len(batch)
            metrics.update({"time/wait_s": t1 - t0, "time/train_s": t2 - t1,
                            "rollout/tokens": sum(len(r) for r in rollout.response_ids),
                            "rollout/tokens_per_s": sum(self._gen_rates) / max(len(self._gen_rates), 1),
                            "replay/staleness_mean": sum(staleness) / len(staleness),
                            "replay/backlog": self._safe_backlog(), "replay/dropped_stale": self.counters["dropped_stale"],
                            "replay/duplicates": self.counters["duplicates"], "data/epoch": self.sampler.epoch,
                            "policy/version": self.learner.version})
            out_of_time = cfg.run.max_wall_s is not None and time.time() - self.t_start > cfg.run.max_wall_s
            last = it == cfg.run.iterations or out_of_time
            if last or (cfg.run.eval_interval and it % cfg.run.eval_interval == 0):
                self.state = "evaluating"
                metrics.update(self._evaluate(ev))
                self.last["eval"] = metrics["eval/reward_mean"]
            self.last["reward"] = metrics.get("reward/score_mean", float("nan"))
            metrics["time/iteration_s"] = time.perf_counter() - t0
            self.metrics.observe(self, metrics)
            if last or (cfg.run.checkpoint_interval and it % cfg.run.checkpoint_interval == 0):
                self.state = "checkpointing"
                self.save_checkpoint()
            runlog.log_iteration(it, metrics)
            if out_of_time:
                log.warning("run.max_wall_s=%s reached after %d iterations", cfg.run.max_wall_s, it)
                break
            if self.stop_event.is_set():
                stopped = True
                break
        if self.uncommitted or stopped:
            self.state = "checkpointing"
            self.save_checkpoint()
        if stopped:
            self.state = "stopped"
            log.info("stopped at iteration %d; `rlhf serve learner` (or `rlhf up`) with this run "
                     "directory resumes from the checkpoint", self.iteration)
            return {"stopped_at": self.iteration}
        self.learner.save_policy(self.run_dir / "final", self.tokenizer)
        if self.critic is not None:
            self.critic.save(str(self.run_dir / "final_critic"))
        self.state = "done"
        return runlog.finish(baseline=self.baseline, final=self.last["eval"], iterations=it,
                             wall_s=time.time() - runlog.t0, resumed_from=self.resumed_from,
                             policy_version=self.learner.version, **self.counters)

    def _evaluate(self, params) -> dict:
        """Held-out eval through a generation server that serves the current version."""
        deadline = time.time() + 60
        while True:
            live = {a: i for a, i in self._live_servers().items() if i.get("version", -1) >= self.learner.version}
            if live:
                break
            if time.time() > deadline or self.stop_event.is_set():
                raise RuntimeError(f"no generation server serves policy version {self.learner.version} for the eval")
            time.sleep(0.2)
        return evaluate(self.held_out, self._gen_client(sorted(live)[0]), self.reward, self.tokenizer, params)

    def stop(self) -> None:
        self.stop_event.set()

    def close(self) -> None:
        if self.http is not None:
            self.http.shutdown()
        if self.server is not None:
            self.server.stop(grace=2)
        for c in self._gen_clients.values():
            c.close()
