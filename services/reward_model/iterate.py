"""`rlhf iterate`: iterated RLHF, the hops in order. The reward model keeps learning on the answers
the policy gives now (Llama 2's reward models refreshed with each batch of comparisons from the
latest policy; Anthropic's iterated online RLHF), where a reward model learned once from the SFT
model's answers is read less well the further PPO moves the policy.

    RUN_DIR/
        iterate.json                 the index: one entry per round, rewritten after every hop
        config.yaml                  the config the rounds run with (-c and --set, resolved)
        round-R/pairs.jsonl          hop 1: pairs from the round's policy on the round's prompts
        round-R/pairs-train.jsonl    hop 2: split by prompt (reward_model.eval_fraction held out)
        round-R/pairs-held-out.jsonl
        round-R/rm-train.jsonl       hop 4: what the round's reward model trains on
        round-R/reward-model/        hop 4: the round's reward model
        round-R/policy/              hop 6: the policy at the round's end (ppo/final/)
        round-R/critic/              iterate.critic reset: the critic set aside before round R's PPO
        ppo/                         hop 5: one PPO run, continued round after round
        probe/pairs.jsonl            after the last round: pairs from the final policy

Per round R (P = iterate.prompts_per_round, K = iterate.iterations_per_round):
1. Pairs (`make_preferences`; in a child process, as every hop that loads a model): the round's
   policy (model.path in round 0, round-(R-1)/policy after)
   samples data.train's prompts [R*P, (R+1)*P), judged by the gold judge (reward.eval_rules);
   the judge's labels (samples and counterfactuals judged) counted.
2. The pairs split by prompt into training and held-out pairs.
3. The previous round's reward model measured on this round's held-out pairs: how well it reads
   the answers the policy now gives, the distribution PPO exploits.
4. The round's reward model trained (`train_reward_model`): from the previous one (iterate.reward_model
   continue) or afresh, on the training pairs of every round so far (iterate.pairs all) or this
   round's, held out on this round's; then measured on every round's held-out pairs.
5. PPO (`rlhf up`, or `rlhf train --local`) in ppo/ to iteration (R+1)*K against the round's reward
   model (reward.model_path), model.path the KL reference throughout; with iterate.critic reset the
   critic is set aside first, so it starts again.
6. ppo/final/ copied to round-R/policy/; the gold and proxy held-out rewards at the round's end
   read from ppo/metrics.jsonl.
After the last round, the probe: pairs from the final policy on iterate.probe_prompts further
prompts, the final reward model measured on them (its accuracy on the final policy's own answers).

A hop whose output is written is not redone: the same command goes on where it stopped.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
import subprocess
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Callable

from ..common.checkpoints import CRITIC_DIR, complete_checkpoints
from ..common.config import Config, config_from_dict, dump_config
from ..common.model_files import check_model_dir, load_tokenizer
from .preferences import PreferenceKeys, load_preferences, split_held_out
from .rlaif import PairPlan, make_preferences

INDEX = "iterate.json"


class Rounds:
    """The rounds of one iterated run in `run_dir` (the hops of the module docstring)."""

    def __init__(self, cfg: Config, run_dir: Path, local: bool, say: Callable[[str], None] = print):
        self.cfg, self.run_dir, self.local, self.say = cfg, Path(run_dir), local, say
        self.it = cfg.iterate
        self.index_path = self.run_dir / INDEX
        self.index = json.loads(self.index_path.read_text()) if self.index_path.exists() else {"rounds": []}

    # ------------------------------------------------------------------ the whole run
    def run(self) -> dict:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "config.yaml").write_text(dump_config(self.cfg))
        for r in range(self.it.rounds):
            self.say(f"== round {r + 1} of {self.it.rounds} ==")
            self.round(r)
        if self.it.probe_prompts:
            self.probe()
        self.index["summary"] = self.summary()
        self.save()
        self.say(summary_line(self.index["summary"]))
        return self.index

    def round(self, r: int) -> None:
        entry = self.entry(r)
        d = self.round_dir(r)
        size = self.it.prompts_per_round
        pairs = self.pairs(d / "pairs.jsonl", self.policy_of(r), r * size, size, self.cfg.run.seed + r, entry)
        self.split(pairs, d)
        if r > 0 and "previous_rm_on_policy_pairs" not in entry:
            m = self.measure(self.round_dir(r - 1) / "reward-model", d / "pairs-held-out.jsonl")
            entry["previous_rm_on_policy_pairs"] = m
            self.save()
            self.say(f"round {r}'s reward model on round {r + 1}'s policy's held-out pairs: {accuracy_text(m)}")
        self.train_rm(r, entry)
        self.ppo(r, entry)

    # ------------------------------------------------------------------ hop 1: pairs
    def pairs(self, out: Path, policy: str, offset: int, limit: int, seed: int, entry: dict) -> Path:
        if "pairs" not in entry or not out.exists():  # written whole, then recorded: recorded is done
            cfg = self.derive({"model.path": policy, "run.seed": seed})
            it = self.it
            plan = PairPlan(
                n=it.samples_per_prompt,
                offset=offset,
                limit=limit,
                more=it.more,
                hard_negatives=it.hard_negatives,
                max_pairs_per_prompt=it.max_pairs_per_prompt,
            )
            self.say(f"pairs from {policy} on training prompts {offset}..{offset + limit - 1} -> {out}")
            stats = in_child(child_make_pairs, cfg, out, plan)
            entry["pairs"] = {**stats, "policy": policy, "judge_labels": stats["samples"] + stats["counterfactuals"]}
            self.save()
        return out

    # ------------------------------------------------------------------ hop 2: the split
    def split(self, pairs: Path, d: Path) -> None:
        train_file, held_file = d / "pairs-train.jsonl", d / "pairs-held-out.jsonl"
        if train_file.exists() and held_file.exists():
            return
        rows = read_jsonl(pairs)
        if not rows:
            raise ValueError(
                f"{pairs}: no pairs (the judge told none of the policy's answers apart); more prompts or samples"
            )
        # the held-out prompts as train-rm chooses them (by prompt, its seed), the rows kept as written
        preferences = load_preferences(str(pairs), "train", PreferenceKeys())
        _, held = split_held_out(preferences, self.cfg.reward_model.eval_fraction, self.cfg.reward_model.seed)
        held_prompts = {p.prompt for p in held}
        write_jsonl(train_file, [r for r in rows if r["prompt"] not in held_prompts])
        write_jsonl(held_file, [r for r in rows if r["prompt"] in held_prompts])

    # ------------------------------------------------------------------ hop 3 and after 4: measures
    def measure(self, rm_dir: Path, pairs_file: Path) -> dict:
        return in_child(child_measure, self.cfg, rm_dir, pairs_file)

    # ------------------------------------------------------------------ hop 4: the reward model
    def train_rm(self, r: int, entry: dict) -> None:
        d = self.round_dir(r)
        out = d / "reward-model"
        if not (out / "reward_stats.json").exists():
            rounds = range(r + 1) if self.it.pairs == "all" else [r]
            write_jsonl(
                d / "rm-train.jsonl",
                [row for q in rounds for row in read_jsonl(self.round_dir(q) / "pairs-train.jsonl")],
            )
            cont = self.it.reward_model == "continue" and r > 0
            base = (
                str(self.round_dir(r - 1) / "reward-model")
                if cont
                else (self.cfg.reward_model.base or self.cfg.model.path)
            )
            self.say(f"reward model of round {r + 1}: from {base} on {d / 'rm-train.jsonl'} -> {out}")
            sets = {"base": base, "train": d / "rm-train.jsonl", "eval": d / "pairs-held-out.jsonl", "out": out}
            cfg = self.derive({f"reward_model.{k}": str(v) for k, v in sets.items()})
            stats = in_child(child_train_rm, cfg)
            entry["reward_model"] = {"base": base, "train_pairs": stats["train_pairs"], "seconds": stats["seconds"]}
            entry.pop("rm_on_held_out", None)
            self.save()
        if "rm_on_held_out" not in entry:
            entry["rm_on_held_out"] = {
                f"round-{q}": self.measure(out, self.round_dir(q) / "pairs-held-out.jsonl") for q in range(r + 1)
            }
            self.save()
            for name, m in entry["rm_on_held_out"].items():
                self.say(f"round {r + 1}'s reward model on {name}'s held-out pairs: {accuracy_text(m)}")

    # ------------------------------------------------------------------ hops 5 and 6: PPO
    def ppo(self, r: int, entry: dict) -> None:
        d = self.round_dir(r)
        if (d / "policy" / "config.json").exists() and "gold" in entry:
            return
        ppo_dir = self.run_dir / "ppo"
        until = (r + 1) * self.it.iterations_per_round
        if self.it.critic == "reset" and r > 0:
            self.set_critic_aside(ppo_dir, r * self.it.iterations_per_round, d / "critic")
        command = [sys.executable, "-m", "services.cli", *(["train", "--local"] if self.local else ["up"]),
                   "-c", str(self.run_dir / "config.yaml"), "--run-dir", str(ppo_dir),
                   "--set", f"reward.model_path={d / 'reward-model'}", "--set", f"run.iterations={until}"]  # fmt: skip
        self.say(f"PPO to iteration {until} against {d / 'reward-model'}: {' '.join(command[1:])}")
        code = subprocess.run(command, env={**os.environ, "PYTHONUNBUFFERED": "1"}).returncode
        if code != 0:
            raise RuntimeError(
                f"PPO of round {r + 1} stopped with exit code {code}; the same command goes on from its checkpoint"
            )
        if (d / "policy").exists():
            shutil.rmtree(d / "policy")
        shutil.copytree(ppo_dir / "final", d / "policy")
        entry.update(held_out_at(ppo_dir / "metrics.jsonl", until), iterations=until)
        self.save()
        self.say(
            f"round {r + 1} done: held-out gold {entry['gold']:.3f}, proxy {fmt(entry.get('proxy'))} "
            f"at iteration {until}"
        )

    def set_critic_aside(self, ppo_dir: Path, at: int, to: Path) -> None:
        """iterate.critic reset: every checkpoint's critic moved out (the newest's to `to`), so the
        run goes on with a critic at its initial weights; only when the run stands at `at`."""
        done = complete_checkpoints(ppo_dir)
        if not done or int(done[-1].name.split("_")[-1]) != at or not (done[-1] / CRITIC_DIR).exists():
            return
        shutil.move(str(done[-1] / CRITIC_DIR), str(to))
        for c in done[:-1]:
            shutil.rmtree(c / CRITIC_DIR, ignore_errors=True)
        self.say(f"critic reset: the critic of iteration {at} set aside in {to}")

    # ------------------------------------------------------------------ the probe
    def probe(self) -> None:
        d = self.run_dir / "probe"
        entry = self.index.setdefault("probe", {})
        last = self.it.rounds - 1
        policy, offset = str(self.round_dir(last) / "policy"), self.it.rounds * self.it.prompts_per_round
        pairs = self.pairs(
            d / "pairs.jsonl", policy, offset, self.it.probe_prompts, self.cfg.run.seed + self.it.rounds, entry
        )
        if "final_rm" not in entry:
            entry["final_rm"] = self.measure(self.round_dir(last) / "reward-model", pairs)
            self.save()
        self.say(
            f"the final reward model on the final policy's own answers (probe): {accuracy_text(entry['final_rm'])}"
        )

    # ------------------------------------------------------------------ the index
    def summary(self) -> dict:
        rounds = self.index["rounds"]
        labels = sum(e["pairs"]["judge_labels"] for e in rounds)
        curve = gold_curve(self.run_dir / "ppo" / "metrics.jsonl")
        base = curve[0][1] if curve and curve[0][0] == 0 else None
        final = rounds[-1]["gold"]
        gain = None if base is None else final - base
        return {
            "rounds": len(rounds),
            "iterations": rounds[-1]["iterations"],
            "gold_base": base,
            "gold_final": final,
            "gold_best": max(g for _, g, _ in curve),
            "gold_max_drop": max_drop([g for _, g, _ in curve]),
            "gold_curve": curve,
            "gold_gain": gain,
            "judge_labels": labels,
            "gold_gain_per_1000_labels": None if gain is None else 1000 * gain / max(1, labels),
            "probe_judge_labels": self.index.get("probe", {}).get("pairs", {}).get("judge_labels"),
            "final_rm_on_final_policy": self.index.get("probe", {}).get("final_rm"),
        }

    def entry(self, r: int) -> dict:
        while len(self.index["rounds"]) <= r:
            self.index["rounds"].append({"round": len(self.index["rounds"])})
        return self.index["rounds"][r]

    def save(self) -> None:
        part = self.index_path.with_suffix(".part")
        part.write_text(json.dumps(self.index, indent=2) + "\n")
        part.replace(self.index_path)

    def round_dir(self, r: int) -> Path:
        return self.run_dir / f"round-{r}"

    def policy_of(self, r: int) -> str:
        return self.cfg.model.path if r == 0 else str(self.round_dir(r - 1) / "policy")

    def derive(self, sets: dict) -> Config:
        return config_from_dict(self.cfg.model_dump(mode="json"), list(sets.items()))


# ---------------------------------------------------------------------- the hops run in a child
def in_child(fn, *args):
    """`fn(*args)` in a fresh process (spawned): the models it loads, and the memory they hold (a
    GPU's included), go with it, so PPO after it finds the device as it was. Its lines print as
    they come; what it raises is raised here."""
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(fn, *args).result()


def say(line: str) -> None:
    print(line, flush=True)


def child_make_pairs(cfg: Config, out: Path, plan: PairPlan) -> dict:
    return make_preferences(cfg, out, plan, say=say)


def child_train_rm(cfg: Config) -> dict:
    from .train import train_reward_model

    return train_reward_model(cfg, say=say)


def child_measure(cfg: Config, rm_dir: Path, pairs_file: Path) -> dict:
    """The reward model in `rm_dir` measured on the pairs of `pairs_file` (measure.py): accuracy,
    on the hard pairs, the AUC across prompts."""
    from ..common.model_files import resolve_device
    from .measure import measure
    from .train import RewardModel, evaluate_pairs

    rc = cfg.reward_model
    rm = RewardModel(str(rm_dir), device=str(resolve_device(cfg.model.device)))
    pairs = load_preferences(str(pairs_file), "eval", PreferenceKeys(), rm.tokenizer, rc.chat_template)
    e = evaluate_pairs(rm, pairs, rc.micro_batch_size * 2)
    m = measure(pairs, e["chosen"].cpu(), e["rejected"].cpu())
    return {k: m[k] for k in ("accuracy", "pairs", "hard_accuracy", "hard_pairs", "auc")}


def iterate_problem(cfg: Config) -> str | None:
    """Why `cfg` cannot run `rlhf iterate`, in a sentence, or None."""
    if cfg.reward.type != "model":
        return (
            f"rlhf iterate trains the reward the policy is paid by: set reward.type: model (it is {cfg.reward.type!r})"
        )
    if not cfg.reward.eval_rules:
        return (
            "rlhf iterate labels its pairs with the gold judge, reward.eval_rules: set it (the policy is never "
            "paid by it)"
        )
    if cfg.reward_model.ensemble != 1:
        return "rlhf iterate trains one reward model a round: set reward_model.ensemble: 1"
    if cfg.reward_model.eval_fraction <= 0:
        return (
            "rlhf iterate measures each round's reward model on held-out pairs: set reward_model.eval_fraction above 0"
        )
    try:
        load_tokenizer(str(check_model_dir(cfg.model.path)))
    except (FileNotFoundError, OSError, ValueError) as e:
        return f"model.path: {e}"
    return None


def held_out_at(metrics: Path, iteration: int) -> dict:
    """The gold (`eval/reward_mean`) and proxy (`eval/proxy_reward_mean`) held-out rewards of the
    newest evaluation at or before `iteration` in a run's metrics.jsonl."""
    curve = [point for point in gold_curve(metrics) if point[0] <= iteration]
    if not curve:
        raise ValueError(f"{metrics}: no held-out evaluation up to iteration {iteration}")
    evaluated_at, gold, proxy = curve[-1]
    return {"gold": gold, "proxy": proxy, "evaluated_at": evaluated_at}


def gold_curve(metrics: Path) -> list[tuple[int, float, float | None]]:
    """(iteration, gold, proxy) of every held-out evaluation of a run's metrics.jsonl, in order."""
    rows = [r for r in read_jsonl(metrics) if "eval/reward_mean" in r]
    return [(r["iteration"], r["eval/reward_mean"], r.get("eval/proxy_reward_mean")) for r in rows]


def max_drop(golds: list[float]) -> float:
    """The most an evaluation fell below the best one before it (0 when none did)."""
    best, drop = float("-inf"), 0.0
    for g in golds:
        best = max(best, g)
        drop = max(drop, best - g)
    return drop


def read_jsonl(path: Path) -> list[dict]:
    return (
        [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
        if Path(path).exists()
        else []
    )


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    part = path.with_suffix(".part")
    part.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    part.replace(path)


def fmt(x) -> str:
    return "-" if x is None else f"{x:.3f}"


def accuracy_text(m: dict) -> str:
    hard = f", hard {m['hard_accuracy']:.3f} ({m['hard_pairs']})" if m.get("hard_accuracy") is not None else ""
    return f"pairwise accuracy {m['accuracy']:.3f} on {m['pairs']} pairs{hard}, AUC {fmt(m.get('auc'))}"


def summary_line(s: dict) -> str:
    line = (
        f"iterated RLHF: {s['rounds']} rounds, {s['iterations']} PPO iterations; "
        f"held-out gold {fmt(s['gold_base'])} -> "
        f"{fmt(s['gold_final'])} (best {fmt(s['gold_best'])}, never more than {s['gold_max_drop']:.3f} below the best "
        f"before it); {s['judge_labels']} judge labels"
    )
    if s["gold_gain_per_1000_labels"] is not None:
        line += f", gold gain {s['gold_gain_per_1000_labels']:+.4f} per 1,000 labels"
    if s["final_rm_on_final_policy"]:
        line += (
            f"; the final reward model on the final policy's answers: {accuracy_text(s['final_rm_on_final_policy'])}"
        )
    return line
