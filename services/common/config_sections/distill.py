"""On-policy distillation's section: the teacher, the objective's weights, the self-distillation hint."""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import Field

from .base import Strict


class DistillConfig(Strict):
    enabled: bool = Field(
        default=False,
        description="on-policy distillation: a teacher scores every sampled token and each token's "
        "advantage gains kl_coef x (teacher log-prob - student log-prob), the per-token reverse KL "
        "(discount 0); docs/distillation.md",
    )
    teacher: Literal["model", "policy"] = Field(
        default="model",
        description="model: the teacher service (`rlhf serve teacher`, or in the process with "
        "`train --local`) with the model at teacher_path; policy: the current policy, scored by the "
        "generation server that sampled (self-distillation with a hint)",
    )
    teacher_path: Optional[str] = Field(
        default=None,
        description="the teacher's model directory (a transformers directory, a run's final/); null = "
        "model.path: the frozen initial model (self-distillation, with hint)",
    )
    kl_coef: float = Field(default=1.0, ge=0, description="weight of the reverse-KL advantage")
    reward_weight: float = Field(
        default=0.0,
        ge=0,
        description="weight of the task reward's advantage added to it (0: pure distillation; the "
        "reward is still scored and logged)",
    )
    hint: Optional[str] = Field(
        default=None,
        description="a privileged hint in the teacher's context only, a template of the record: "
        "{label} (the reference answer) and any of its metadata fields, e.g. 'The correct answer is "
        "{label}.'; put inside the last user message; null = the teacher sees the student's prompt",
    )
    top_k: int = Field(
        default=0,
        ge=0,
        le=64,
        description="the teacher also returns its top-k log-probs per token (0 = none; k >= 1 "
        "gives the distill/teacher_top1_agree metric, and what forward_kl_coef's loss reads)",
    )
    forward_kl_coef: float = Field(
        default=0.0,
        ge=0,
        description="weight of the top-k forward KL loss beside the reverse-KL advantage: per token, "
        "sum over the teacher's top_k tokens of q log(q / student), q the teacher's probabilities "
        "renormalised over them (GKD's forward KL on the student's samples); needs top_k >= 1 and "
        "teacher: model; 0 = none",
    )
    dtype: Literal["float32", "bfloat16"] = Field(default="float32", description="the teacher's weights")
    micro_batch_size: int = Field(default=16, ge=1, description="sequences per teacher forward")
    share_prompts: bool = Field(
        default=True,
        description="the teacher reads a prompt once for all the samples of it in a batch (its keys and values "
        "reused for each response) instead of once per sample; false = every sequence read whole",
    )

    @property
    def needs_server(self) -> bool:
        """Whether a teacher model is loaded (the teacher service, or in the process)."""
        return self.enabled and self.teacher == "model"
