"""The training loop's sections (the learner, `rlhf train --local`): the prompts (`data`) and the run (`run`)."""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import Field, field_validator, model_validator

from ..reasoning_gym_tasks import is_task_source
from ..reasoning_gym_tasks import source_problem as task_source_problem
from .base import Strict


# ------------------------------------------ the training loop (learner, rlhf train --local)
class DataConfig(Strict):
    train: str = Field(
        default="synthetic:reverse",
        description="training prompts: synthetic:TASK (reverse, arithmetic, multiply), a "
        ".jsonl, .parquet, .csv or .json file, hf:DATASET[:CONFIG][@SPLIT] (a hub name or a local "
        "directory), or reasoning-gym:TASK[?size=N&seed=S&OPTION=VALUE...] (a reasoning-gym task "
        "generated offline: N items, default 1000, from seed S, default 0, with the task's config options), "
        "or verifiers (the dataset of rollout.environment's verifiers environment)",
    )
    eval: Optional[str] = Field(
        default=None,
        description="held-out prompts, in the forms of data.train; an hf: source "
        "without @split reads its eval, test or validation split; null = a split of "
        "data.train held out of training (a synthetic task: its own held-out prompts; a "
        "reasoning-gym task: its first data.eval_size items from the training seed + 1000003 whose "
        "question no training item asks; verifiers: the environment's eval_dataset, less its training "
        "prompts, else a split of its dataset)",
    )
    eval_size: int = Field(default=128, ge=1, description="held-out prompts evaluated (the first N)")
    prompt_key: str = Field(
        default="prompt",
        description="record field with the prompt: a string, or a list of chat "
        "messages (verl) rendered through the chat template, as are records with 'messages'; "
        "GSM8K rows without it (question, answer) use 'question'",
    )
    label_key: str = Field(
        default="label",
        description="record field with the reference answer (else verl's "
        "reward_model.ground_truth, else 'solution'; GSM8K rows: the number after '####')",
    )
    chat_template: bool = Field(
        default=False,
        description="wrap each string prompt as one user message and render it "
        "through the tokenizer's chat template; records whose prompt is a list of "
        "messages always use it",
    )
    system_prompt: Optional[str] = Field(
        default=None,
        description="with chat_template: a system message put before each string prompt's user message; null = none",
    )
    instruction: Optional[str] = Field(
        default=None,
        description="text appended (after a space) to each string prompt, "
        "before the chat template: e.g. GSM8K's 'Let's think step by step and "
        'output the final answer after "####".\'; null = none',
    )
    overlong: Literal["filter", "error"] = Field(
        default="filter",
        description="prompts longer than prompt_length tokens: "
        "'filter' drops them with a warning, 'error' stops the run",
    )

    @field_validator("train", "eval")
    @classmethod
    def _task_source(cls, source: Optional[str]) -> Optional[str]:
        # a reasoning-gym source: its syntax, task and config options, when the package is here
        # (without it, the commands that read the data say to install it)
        if is_task_source(source):
            problem = task_source_problem(source, need_package=False)
            if problem:
                raise ValueError(problem)
        return source

    @model_validator(mode="after")
    def _system_prompt_needs_template(self) -> "DataConfig":
        if self.system_prompt is not None and not self.chat_template:
            raise ValueError("data.system_prompt is only used with data.chat_template: true")
        return self


class RunConfig(Strict):
    run_dir: str = Field(
        default="runs/default", description="directory for metrics, checkpoints, logs and the final model"
    )
    iterations: int = Field(default=100, ge=1, description="PPO iterations: one rollout batch and its updates each")
    eval_interval: int = Field(default=10, ge=0, description="evaluate every N iterations; 0 = only first/last")
    checkpoint_interval: int = Field(
        default=10,
        ge=0,
        description="checkpoint every N iterations (and at the end and "
        "on SIGTERM); the learner service acknowledges trained trajectories "
        "at each checkpoint; 0 = only at the end",
    )
    resume_from: Optional[str] = Field(
        default=None,
        description="`rlhf train --local`: go on from this checkpoint "
        "(RUN_DIR/checkpoints/iter_N) instead of the run directory's newest; null = "
        "the newest, or a fresh start when there is none",
    )
    keep_checkpoints: int = Field(
        default=2,
        ge=1,
        description="checkpoints kept under checkpoints/ (the newest); older ones are deleted as new ones are written",
    )
    save_best: bool = Field(
        default=True,
        description="keep the policy of the best held-out evaluation so far as a Hugging "
        "Face directory in best/ (best/best.json: its iteration and held-out reward)",
    )
    gold_drop: Optional[float] = Field(
        default=None,
        gt=0,
        description="how far (in reward units) a held-out evaluation may fall below the best one "
        "so far before run.on_gold_drop acts: the held-out reward is the gold one when "
        "reward.eval_rules is set; null = off",
    )
    max_rollbacks: int = Field(
        default=3,
        ge=0,
        description="rollbacks of run.on_gold_drop a run may make; a fall past run.gold_drop after them stops the run",
    )
    on_gold_drop: Literal["rollback", "stop"] = Field(
        default="rollback",
        description="past run.gold_drop: 'rollback' loads the best policy so far back (best/, or "
        "model.path when the start was the best), drops the optimiser's moments, pushes it to the "
        "generation servers and goes on; 'stop' ends the run there (final/ is that policy)",
    )
    save_generations: bool = Field(
        default=True,
        description="write each held-out evaluation's prompts, responses, labels "
        "and rewards to generations/iter_N.jsonl",
    )
    seed: int = Field(default=0, description="random seed of sampling, data order and initialisation")
    log_every: int = Field(default=1, ge=1, description="print a progress line every N iterations (and at each eval)")
    max_wall_s: Optional[float] = Field(default=None, gt=0, description="stop after this many seconds; null = no limit")
    liveness_s: Optional[float] = Field(
        default=None,
        gt=0,
        description="learner service: its liveness (/healthz, gRPC "
        "health '') fails once the training loop has not advanced (a phase, a "
        "wait's tick, a call answered, an update step) for this many seconds; "
        "null = max(600, 3 x rpc.timeout_s, the longest Redis command with its "
        "retries)",
    )
    hacking_window: int = Field(
        default=3,
        ge=0,
        description="reward-hacking watch: held-out evaluations compared (>= 2); "
        "it warns while across them the held-out reward falls and the train reward rises, "
        "or, once this many - 1 have followed the baseline, the held-out reward is below the "
        "baseline's while the train reward is above its first interval's; 0 = off",
    )
    hacking_min_change: float = Field(
        default=0.05,
        ge=0,
        description="reward-hacking watch: least fall of the held-out "
        "reward and least rise of the train reward across the window (their "
        "least-squares trends, in reward units) that count",
    )
    tensorboard: bool = Field(
        default=True,
        description="write every metric of metrics.jsonl as TensorBoard scalars "
        "into DIR/tensorboard (when the tensorboard package is installed)",
    )
    wandb_project: Optional[str] = Field(
        default=None,
        description="log every metric of metrics.jsonl to this Weights & "
        "Biases project (needs `pip install wandb`); null = off",
    )
    wandb_entity: Optional[str] = Field(default=None, description="W&B entity (user or team); null = your default")
    wandb_mode: Optional[Literal["online", "offline", "disabled"]] = Field(
        default=None, description="W&B mode; null = wandb's default ($WANDB_MODE, else online)"
    )

    @field_validator("hacking_window")
    @classmethod
    def _window(cls, v: int) -> int:
        if v == 1:
            raise ValueError("1 evaluation shows no trend; use 0 (off) or >= 2")
        return v
