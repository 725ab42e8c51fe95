"""Greedy accuracy on tinker-cookbook's arithmetic task (`math_rl` with `env=arithmetic`) of a model
that `rlhf serve tinker` serves: the base model, or a checkpoint's sampler weights
(`tinker://.../sampler_weights/final`, what the recipe printed and wrote to checkpoints.jsonl).

The recipe's own pieces: its environment (`ArithmeticEnv`: the few-shot prefix, the renderer's
prompt and stop sequence, and its `step`, which scores a reply as the recipe's `env/all/correct`
does), on `--n` problems drawn from `--seed` (the recipe draws batch `i` from seed `i`, i < 100,
so the default seed gives problems that are drawn independently of the training batches).
It runs in the client venv (`make tinker-venv`):

    .venv-tinker/bin/python examples/tinker_arithmetic_eval.py --model-name runs/smollm2-135m \
        --renderer qwen3_instruct [--model-path tinker://.../sampler_weights/final]
"""

from __future__ import annotations

import argparse
import asyncio

import numpy as np
import tinker
from tinker import types
from tinker_cookbook import renderers
from tinker_cookbook.recipes.math_rl.arithmetic_env import ArithmeticEnv
from tinker_cookbook.tokenizer_utils import get_tokenizer


async def evaluate(service: tinker.ServiceClient, args: argparse.Namespace) -> tuple[float, float]:
    renderer = renderers.get_renderer(args.renderer, tokenizer=get_tokenizer(args.model_name))
    if args.model_path:
        sampler = await service.create_sampling_client(model_path=args.model_path)
    else:
        sampler = await service.create_sampling_client(base_model=args.model_name)
    rng = np.random.RandomState(args.seed)
    envs = [
        ArithmeticEnv(
            int(rng.randint(0, 101)),
            int(rng.randint(0, 101)),
            renderer,
            convo_prefix=ArithmeticEnv.standard_fewshot_prefix(),
        )
        for _ in range(args.n)
    ]

    async def one(env: ArithmeticEnv) -> tuple[float, float, str]:
        prompt, stop = await env.initial_observation()
        params = types.SamplingParams(max_tokens=args.max_tokens, temperature=0.0, stop=stop)
        result = await sampler.sample(prompt, num_samples=1, sampling_params=params)
        tokens = result.sequences[0].tokens
        step = await env.step(tokens)
        return step.metrics["correct"], step.metrics["format"], renderer.tokenizer.decode(tokens)

    scores = await asyncio.gather(*(one(env) for env in envs))
    for env, (correct, _, reply) in list(zip(envs, scores))[: args.show]:
        print(f"{env.get_question()} -> {reply!r} ({'right' if correct else 'wrong'})")
    return float(np.mean([s[0] for s in scores])), float(np.mean([s[1] for s in scores]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-url", default=None, help="the server (default: $TINKER_BASE_URL)")
    parser.add_argument("--model-name", required=True, help="what the recipe got as model_name")
    parser.add_argument("--renderer", required=True, help="what the recipe got as renderer_name")
    parser.add_argument("--model-path", default=None, help="tinker://.../sampler_weights/NAME (none: the base)")
    parser.add_argument("--n", type=int, default=100, help="problems")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--seed", type=int, default=12345)
    parser.add_argument("--show", type=int, default=3, help="replies to print")
    args = parser.parse_args()
    with tinker.ServiceClient(base_url=args.base_url) as service:
        correct, form = asyncio.run(evaluate(service, args))
    print(f"{args.model_path or 'base'}: correct {correct:.3f}, format {form:.3f} on {args.n} problems")


if __name__ == "__main__":
    main()
