"""The reference to beat: TRL's GRPOTrainer on the `configs/smollm2-cpu.yaml` recipe, configured the
same way (16 prompts x 8 samples at temperature 0.7, 24 new tokens, one optimiser step of 128
samples per iteration, lr 2e-5 constant, grad norm 1.0, no KL, per-sequence mean of token means,
rewards normalised by their group's std), on the same prompts and the same answer rule; then the
same greedy held-out eval as the recipe's (the first 128 prompts of the arithmetic eval split).

    pip install trl==1.12.0      (not a project dependency: a yardstick)
    python benchmarks/bench_trl.py --model runs/smollm2-135m --iterations 10 [--device cuda] [--bf16]

Prints the median seconds per iteration (iteration 1, the warm-up, left out), samples/s and the
held-out accuracy before and after; `--out` writes them as JSON. Compare with
`benchmarks/bench_iteration.py -c configs/smollm2-cpu.yaml` run on the same machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from services.reward.rules import math_answer
from services.training.sources.synthetic import arithmetic_task

SAMPLES_PER_ITERATION = 128  # 16 prompts x 8 samples


def reward(prompts, completions, label, **_) -> list[float]:
    """The recipe's rule: math_answer (flexible: the last number in the reply) against the label."""
    texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
    return [math_answer(None, t, lab, None, mode="flexible") for t, lab in zip(texts, label)]


@torch.no_grad()
def held_out(model, tokenizer, device: str, n: int = 128, new_tokens: int = 24) -> float:
    """Greedy accuracy on the first `n` prompts of the eval split, through the chat template."""
    records = arithmetic_task("eval", n)
    tokenizer.padding_side = "left"
    model.eval()
    correct = 0.0
    for start in range(0, len(records), 32):
        chunk = records[start : start + 32]
        texts = [
            tokenizer.apply_chat_template(
                [{"role": "user", "content": r.prompt}], tokenize=False, add_generation_prompt=True
            )
            for r in chunk
        ]
        enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(device)
        out = model.generate(**enc, max_new_tokens=new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id)
        replies = tokenizer.batch_decode(out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
        correct += sum(reward(None, replies, [r.label for r in chunk]))
    return correct / len(records)


class StepTimer:
    """Seconds of each optimiser step (TRL generates inside the step that consumes the samples)."""

    def __init__(self):
        self.times: list[float] = []
        self._t = None

    def callback(self):
        from transformers import TrainerCallback

        timer = self

        class _Callback(TrainerCallback):
            def on_step_begin(self, args, state, control, **kw):
                timer._t = time.perf_counter()

            def on_step_end(self, args, state, control, **kw):
                if torch.cuda.is_available():
                    torch.cuda.synchronize()
                timer.times.append(time.perf_counter() - timer._t)

        return _Callback()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="runs/smollm2-135m")
    ap.add_argument("--iterations", type=int, default=10)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--bf16", action="store_true")
    ap.add_argument("--out")
    args = ap.parse_args()

    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).to(args.device)
    before = held_out(model, tokenizer, args.device)
    train = Dataset.from_list(
        [
            {"prompt": [{"role": "user", "content": r.prompt}], "label": r.label}
            for r in arithmetic_task("train", SAMPLES_PER_ITERATION // 8 * args.iterations)
        ]
    )
    config = GRPOConfig(
        output_dir="/tmp/bench-trl",
        max_steps=args.iterations,
        per_device_train_batch_size=SAMPLES_PER_ITERATION,
        gradient_accumulation_steps=1,
        num_generations=8,
        max_completion_length=24,
        temperature=0.7,
        learning_rate=2e-5,
        lr_scheduler_type="constant",
        warmup_steps=0,
        max_grad_norm=1.0,
        beta=0.0,
        loss_type="grpo",
        scale_rewards="group",
        num_iterations=1,
        bf16=args.bf16,
        use_cpu=args.device == "cpu",
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        seed=0,
        shuffle_dataset=False,
    )
    timer = StepTimer()
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=reward,
        args=config,
        train_dataset=train,
        processing_class=tokenizer,
        callbacks=[timer.callback()],
    )
    t0 = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - t0
    after = held_out(trainer.model, tokenizer, args.device)
    steps = timer.times[1:] or timer.times
    per_it = statistics.median(steps)
    result = {
        "system": f"trl {__import__('trl').__version__} GRPOTrainer",
        "device": args.device,
        "bf16": args.bf16,
        "iterations": args.iterations,
        "s_per_iteration": per_it,
        "samples_per_s": SAMPLES_PER_ITERATION / per_it,
        "wall_s": wall,
        "held_out_before": before,
        "held_out_after": after,
        "step_seconds": timer.times,
    }
    print(
        f"TRL GRPOTrainer ({args.device}{', bf16' if args.bf16 else ''}): {per_it:.2f} s/iteration "
        f"(median of iterations 2-{args.iterations}), {result['samples_per_s']:.2f} samples/s; "
        f"held-out {before:.3f} -> {after:.3f} after {args.iterations * SAMPLES_PER_ITERATION} samples"
    )
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
