"""`rlhf train-rm`: a scalar reward head on a causal LM backbone, trained on preference pairs
with the pairwise (Bradley-Terry) loss -log sigmoid(r_chosen - r_rejected - margin).

The model is the backbone's `AutoModelForSequenceClassification` with one label: its new linear
head reads the last hidden state at the last non-padding token. That is the class
`reward.type: model` serves (`services/reward/scorer.py`), so the written directory loads there as
it is and scores what the trainer's forward gave.

What a run writes in `reward_model.out`:

    config.json, model.safetensors, tokenizer files   the reward model (LoRA adapters merged)
    reward_stats.json    mean and std of its reward on the answers of the training pairs (each
                         once; of at most 1,024 pairs, drawn; reward.model_normalize), held-out
                         pairwise accuracy before and after (and on the hard pairs, the AUC
                         across prompts, the calibration bins: measure.py), pairs, steps, seconds
    calibration.png      the judge's mean score by reward-model score, on the held-out answers
    metrics.jsonl        one row per optimiser step (loss, accuracy, lr) and per held-out evaluation
    curves.png           training loss and accuracy per step, held-out accuracy per epoch

It prints one line per step and one per held-out evaluation (what it prints and draws: report.py):

    step   12/120  epoch 1  loss 0.5512  acc 0.719  lr 9.8e-06  41 texts  2.31 s/step  eta 4m09s
    held-out (epoch 1): pairwise accuracy 0.812 on 96 pairs (before training 0.479), loss 0.4410
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import random
import time
from pathlib import Path
from typing import Callable, Sequence

import torch
import torch.nn.functional as F

from ..common.config import Config
from ..common.model_files import check_model_dir, load_tokenizer, resolve_device, save_model_dir
from ..common.modeling import bf16_autocast
from ..common.reward_model_dir import reward_logits, reward_stats, write_ensemble
from .measure import describe, measure
from .preferences import Preference, PreferenceKeys, load_preferences, split_held_out
from .report import MetricsLog, fmt_s, held_out_line, held_out_stats, plan_line, report, report_ensemble, step_line

log = logging.getLogger(__name__)
# training pairs (drawn) the written model's mean, std and training accuracy are read on: on
# SmolLM2 on 2 cores, 256 pairs take 58 s and 872 took 196 s (a third of a round's reward model)
# for a mean 0.02 and a std 0.02 apart (the std is 0.49)
STATS_PAIRS = 256


def pairwise_loss(chosen: torch.Tensor, rejected: torch.Tensor, margin: torch.Tensor | float = 0.0) -> torch.Tensor:
    """-log sigmoid(r_chosen - r_rejected - margin), the mean over pairs (Bradley-Terry, with
    InstructGPT's / Llama 2's margin)."""
    return -F.logsigmoid(chosen - rejected - margin).mean()


@contextlib.contextmanager
def _quiet_transformers():
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)


class RewardModel:
    """The sequence-classification model and its tokenizer; `scores(texts)` is the forward the
    reward server runs (one tokenizer call, padded, the logit of the single label)."""

    def __init__(self, base: str, seed: int = 0, lora=None, gradient_checkpointing: bool = False, device: str = "cpu"):
        from transformers import AutoModelForSequenceClassification

        path = str(check_model_dir(base))
        self.tokenizer = load_tokenizer(path)
        torch.manual_seed(seed)  # the new head's initialisation
        with _quiet_transformers():  # its load report calls the new head "MISSING": it is meant to be new
            self.model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=1, dtype=torch.float32)
        self.model.config.pad_token_id = self.tokenizer.pad_token_id
        self.head_names = {n for n, _ in self.model.named_parameters() if n.split(".")[0] in ("score", "classifier")}
        if not self.head_names:
            raise ValueError(
                f"{base}: its sequence-classification model has no 'score' head; this architecture is "
                "not supported for reward models"
            )
        self.lora = lora is not None and lora.rank > 0
        if self.lora:
            from peft import LoraConfig, TaskType, get_peft_model

            self.model = get_peft_model(
                self.model,
                LoraConfig(
                    task_type=TaskType.SEQ_CLS,
                    r=lora.rank,
                    lora_alpha=lora.alpha,
                    lora_dropout=lora.dropout,
                    target_modules=list(lora.target_modules),
                ),
            )
        if gradient_checkpointing:
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            self.model.config.use_cache = False
        self.device = torch.device(device)
        self.model.to(self.device)

    def scores(self, texts: Sequence[str], bf16: bool = False) -> torch.Tensor:
        with bf16_autocast(self.device, bf16):
            return reward_logits(self.model, self.tokenizer, list(texts), self.device)

    def param_groups(self, lr: float, head_lr: float | None, weight_decay: float) -> list[dict]:
        head: list[torch.nn.Parameter] = []
        body: list[torch.nn.Parameter] = []
        for name, p in self.model.named_parameters():
            if p.requires_grad:
                (head if any(h in name for h in self.head_names) else body).append(p)
        return [
            {"params": body, "lr": lr, "weight_decay": weight_decay},
            {"params": head, "lr": head_lr or lr, "weight_decay": 0.0},
        ]

    def save(self, out: Path) -> None:
        """The model (LoRA adapters merged into it: from here on this is the plain model) and tokenizer."""
        if self.lora:
            self.model, self.lora = self.model.merge_and_unload(), False
        self.model.config.use_cache = True
        save_model_dir(self.model, out, self.tokenizer)


def token_length(tokenizer, text: str) -> int:
    return len(tokenizer(text)["input_ids"])


def drop_long(pairs: list[Preference], tokenizer, max_length: int, what: str) -> list[Preference]:
    kept = [p for p in pairs if max(token_length(tokenizer, t) for t in p.texts) <= max_length]
    if len(kept) < len(pairs):
        log.warning(
            "%d of %d %s pairs are longer than reward_model.max_length=%d tokens; dropped them",
            len(pairs) - len(kept),
            len(pairs),
            what,
            max_length,
        )
    if not kept:
        raise ValueError(f"every {what} pair is longer than reward_model.max_length={max_length} tokens; raise it")
    return kept


def distinct_texts(pairs: Sequence[Preference]) -> tuple[list[str], torch.Tensor]:
    """The distinct texts of `pairs` (prompt + answer; an answer on several pairs once) and, per
    pair, the places of its (chosen, rejected) among them: a (len(pairs), 2) index."""
    place: dict[str, int] = {}
    index = [[place.setdefault(t, len(place)) for t in p.texts] for p in pairs]
    return list(place), torch.tensor(index, dtype=torch.long).reshape(len(pairs), 2)


def pair_scores(rm: RewardModel, pairs: Sequence[Preference], bf16: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(r_chosen, r_rejected) of each pair, each distinct text scored once in one forward: the
    k(n - k) pairs of a prompt's n answers cost n sequences, not 2k(n - k)."""
    texts, index = distinct_texts(pairs)
    scores = rm.scores(texts, bf16)
    index = index.to(scores.device)
    return scores[index[:, 0]], scores[index[:, 1]]


def micro_batches(pairs: Sequence[Preference], texts: int) -> list[list[Preference]]:
    """`pairs` in order, cut where a micro-batch would hold more than `texts` distinct texts (a
    pair alone may hold 2)."""
    out: list[list[Preference]] = []
    seen: set[str] = set()
    for p in pairs:
        new = [t for t in dict.fromkeys(p.texts) if t not in seen]
        if out and len(seen) + len(new) <= max(2, texts):
            out[-1].append(p)
        else:
            out.append([p])
            seen = set()
            new = list(dict.fromkeys(p.texts))
        seen.update(new)
    return out


def epoch_order(train: Sequence[Preference], rng: random.Random, by_prompt: bool) -> list[int]:
    """One epoch's order of the training pairs: shuffled one by one, or (`by_prompt`) prompt by
    prompt, each prompt's pairs together (shuffled among themselves)."""
    order = list(range(len(train)))
    rng.shuffle(order)
    if not by_prompt:
        return order
    groups: dict[str, list[int]] = {}
    for i in order:  # the prompts in the order their first pair was drawn
        groups.setdefault(train[i].prompt, []).append(i)
    return [i for g in groups.values() for i in g]


@torch.no_grad()
def evaluate_pairs(rm: RewardModel, pairs: list[Preference], batch: int, bf16: bool = False) -> dict:
    """Pairwise accuracy (r_chosen > r_rejected), loss and mean margin over `pairs` (at most
    2 x `batch` distinct texts a forward)."""
    rm.model.eval()
    chosen, rejected, margins = [], [], []
    for chunk in micro_batches(pairs, 2 * batch):
        c, r = pair_scores(rm, chunk, bf16)
        chosen.append(c)
        rejected.append(r)
        margins += [p.margin for p in chunk]
    c, r = torch.cat(chosen), torch.cat(rejected)
    return {
        "accuracy": (c > r).float().mean().item(),
        "loss": pairwise_loss(c, r, torch.tensor(margins, device=c.device)).item(),
        "reward_gap": (c - r).mean().item(),
        "pairs": len(pairs),
        "chosen": c,
        "rejected": r,
    }


def _schedule(optimizer, warmup: int, total: int):
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / (warmup + 1)
        progress = (step - warmup) / max(1, total - warmup)
        return 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def train_reward_model(cfg: Config, say: Callable[[str], None] = print) -> dict:
    """Train the reward model `cfg.reward_model` describes (or its ensemble); returns what
    reward_stats.json holds."""
    rc = cfg.reward_model
    if rc.train is None:
        raise ValueError("reward_model.train is not set: give the preference pairs (a .jsonl file, say)")
    base = rc.base or cfg.model.path
    out = Path(rc.out)
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.monotonic()
    train, held_out = training_pairs(rc, base)
    if rc.ensemble == 1:
        write_ensemble(out, None)  # an ensemble written here before would go on being served
        stats, _ = train_one(cfg, base, rc.seed, out, train, held_out, say)
        return stats
    return train_ensemble(cfg, base, out, train, held_out, say, t_start)


def training_pairs(rc, base: str) -> tuple[list[Preference], list[Preference]]:
    """The training and held-out pairs (`reward_model.eval`, else a share of the training ones),
    those longer than `max_length` dropped, `reward_model.margin` added to each pair's margin."""
    tokenizer = load_tokenizer(str(check_model_dir(base)))
    keys = PreferenceKeys(rc.prompt_key, rc.chosen_key, rc.rejected_key, rc.margin_key)
    pairs = load_preferences(rc.train, "train", keys, tokenizer, rc.chat_template)
    if rc.eval is not None:
        train, held_out = pairs, load_preferences(rc.eval, "eval", keys, tokenizer, rc.chat_template)
    else:
        train, held_out = split_held_out(pairs, rc.eval_fraction, rc.seed)
    train = drop_long(train, tokenizer, rc.max_length, "training")
    held_out = drop_long(held_out, tokenizer, rc.max_length, "held-out") if held_out else []
    for p in train + held_out:
        p.margin += rc.margin
    return train, held_out


def train_ensemble(
    cfg: Config,
    base: str,
    out: Path,
    train: list[Preference],
    held_out: list[Preference],
    say: Callable[[str], None],
    t_start: float,
) -> dict:
    """`reward_model.ensemble` reward models, member i trained with seed + i into out/member-i,
    then measured together on the held-out pairs as the reward server combines them; returns what
    reward_stats.json holds (`t_start`: when the run began)."""
    rc = cfg.reward_model
    scores, names = [], []
    for i in range(rc.ensemble):
        names.append(f"member-{i}")
        say(f"ensemble member {i + 1} of {rc.ensemble} (seed {rc.seed + i}) -> {out / names[-1]}")
        _, held = train_one(cfg, base, rc.seed + i, out / names[-1], train, held_out, say)
        if held is not None:  # its held-out scores, normalised as the reward server normalises them
            mean, std = reward_stats(out / names[-1])
            scores.append(((held["chosen"] - mean) / std, (held["rejected"] - mean) / std))
    write_ensemble(out, names)
    stats: dict = {"members": names, "train_pairs": len(train), "held_out_pairs": len(held_out), "base": base}
    if scores:
        penalty = cfg.reward.ensemble_penalty
        chosen, rejected = (torch.stack([s[k] for s in scores]) for k in (0, 1))
        combined = [x.mean(0) - penalty * x.std(0, unbiased=False) for x in (chosen, rejected)]
        measured = measure(held_out, *combined)
        stats.update(held_out_stats(measured), ensemble_penalty=penalty)
        report_ensemble(measured, penalty, out, say)
    stats["seconds"] = round(time.monotonic() - t_start, 1)
    (out / "reward_stats.json").write_text(json.dumps(stats, indent=2) + "\n")
    say(
        f"ensemble of {rc.ensemble} reward models written to {out} in {fmt_s(stats['seconds'])}; serve it with "
        f"reward.type: model, reward.model_path: {out} (reward.ensemble_penalty: {cfg.reward.ensemble_penalty:g})"
    )
    return stats


def train_one(
    cfg: Config,
    base: str,
    seed: int,
    out: Path,
    train: list[Preference],
    held_out: list[Preference],
    say: Callable[[str], None],
) -> tuple[dict, dict | None]:
    """One reward model trained on `train`, written to `out`: (what its reward_stats.json holds,
    its last held-out evaluation or None)."""
    rc = cfg.reward_model
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.monotonic()
    rm = RewardModel(base, seed, rc.lora, rc.gradient_checkpointing, str(resolve_device(cfg.model.device)))
    steps_per_epoch = max(1, len(train) // rc.batch_size)
    say(plan_line(base, train, held_out, rc, steps_per_epoch, rm.lora))
    metrics = MetricsLog(out / "metrics.jsonl")

    def held_out_eval(epoch: int, step: int) -> dict:
        e, row = _held_out_eval(rm, held_out, rc, epoch, step)
        metrics.record(row)
        return e

    before = None
    if held_out:
        before = held_out_eval(0, 0)
        say(f"held-out before training: {describe(before['measured'])[0]}, loss {before['loss']:.4f}")
    evaluate = held_out_eval if held_out else None
    step, last = _epochs(rm, train, rc, seed, steps_per_epoch, metrics.record, evaluate, before, say)
    metrics.close()
    rm.save(out)  # the statistics below are the written model's
    stats = {
        **answer_stats(rm, train, seed, rc.micro_batch_size * 2),
        "held_out_accuracy_before": before["accuracy"] if before else None,
        **(held_out_stats(last["measured"]) if last else {"held_out_accuracy": None}),
        "train_pairs": len(train),
        "held_out_pairs": len(held_out),
        "steps": step,
        "base": base,
        "seed": seed,
        "seconds": round(time.monotonic() - t_start, 1),
    }
    (out / "reward_stats.json").write_text(json.dumps(stats, indent=2) + "\n")
    report(out, metrics.rows, last, stats, say)
    return stats, last


def _epochs(
    rm: RewardModel,
    train: list[Preference],
    rc,
    seed: int,
    steps_per_epoch: int,
    record: Callable[[dict], None],
    held_out_eval: Callable[[int, int], dict] | None,
    before: dict | None,
    say: Callable[[str], None],
) -> tuple[int, dict | None]:
    """The training: each epoch a pass over `train` shuffled (by `seed`), in steps of
    `rc.batch_size` pairs (the rest left out), each step's row `record`ed; after each epoch the
    held-out evaluation (when there are held-out pairs). The steps taken and the last evaluation."""
    total = steps_per_epoch * rc.epochs
    optimizer = torch.optim.AdamW(rm.param_groups(rc.lr, rc.head_lr, rc.weight_decay), lr=rc.lr)
    scheduler = _schedule(optimizer, rc.warmup_steps, total)
    rng = random.Random(seed)
    step, t0, last = 0, time.monotonic(), None
    for epoch in range(1, rc.epochs + 1):
        order = epoch_order(train, rng, rc.batch_by_prompt)
        for s in range(steps_per_epoch):
            batch = [train[i] for i in order[s * rc.batch_size : (s + 1) * rc.batch_size]]
            row = _step(rm, batch, optimizer, rc)
            scheduler.step()
            step += 1
            per_step = (time.monotonic() - t0) / step
            row.update(step=step, epoch=epoch, lr=optimizer.param_groups[0]["lr"])
            record(row)
            say(step_line(row, total, per_step))
        if held_out_eval is not None:
            last = held_out_eval(epoch, step)
            say(held_out_line(epoch, last, before))
    return step, last


def _held_out_eval(rm: RewardModel, held_out: list[Preference], rc, epoch: int, step: int) -> tuple[dict, dict]:
    """The held-out pairs scored and measured, and the metrics row of that."""
    e = evaluate_pairs(rm, held_out, rc.micro_batch_size * 2, rc.bf16)
    e["measured"] = measure(held_out, e["chosen"], e["rejected"])
    row = {"step": step, "epoch": epoch, "eval/accuracy": e["accuracy"], "eval/loss": e["loss"]}
    if e["measured"]["hard_accuracy"] is not None:
        row["eval/hard_accuracy"] = e["measured"]["hard_accuracy"]
    return e, row


def answer_stats(rm: RewardModel, train: list[Preference], seed: int, batch: int) -> dict:
    """The mean and std of the written model's scores over the answers of at most STATS_PAIRS
    training pairs, each answer once (with every pair of a prompt, a right answer is on n - k
    pairs), in float32 as the reward server scores; and its accuracy on those pairs."""
    sample = random.Random(seed).sample(train, min(len(train), STATS_PAIRS))  # enough for a mean and a std
    on_train = evaluate_pairs(rm, sample, batch)
    answers = {}
    for p, c, r in zip(sample, on_train["chosen"].tolist(), on_train["rejected"].tolist()):
        answers[(p.prompt, p.chosen)], answers[(p.prompt, p.rejected)] = c, r
    both = torch.tensor(list(answers.values()))
    return {
        "mean": both.mean().item(),
        "std": both.std().item() if len(both) > 1 else 1.0,
        "train_accuracy": on_train["accuracy"],
    }


def _step(rm: RewardModel, batch: list[Preference], optimizer, rc) -> dict:
    """One optimiser step on `batch` (micro-batches of at most 2 x micro_batch_size distinct texts
    accumulate): its loss, accuracy, gradient norm, and the texts it scored."""
    rm.model.train()
    optimizer.zero_grad(set_to_none=True)
    loss_sum, right, scored = 0.0, 0, 0
    for micro in micro_batches(batch, 2 * rc.micro_batch_size):
        c, r = pair_scores(rm, micro, rc.bf16)
        loss = pairwise_loss(c, r, torch.tensor([p.margin for p in micro], device=c.device))
        (loss * len(micro) / len(batch)).backward()
        loss_sum += loss.item() * len(micro)
        right += int((c > r).sum())
        scored += len(distinct_texts(micro)[0])
    grad_norm = torch.nn.utils.clip_grad_norm_(rm.model.parameters(), 1.0).item()
    optimizer.step()
    return {"loss": loss_sum / len(batch), "accuracy": right / len(batch), "grad_norm": grad_norm, "texts": scored}
