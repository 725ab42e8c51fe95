"""Every command the documentation shows works as written (issue 41).

Every fenced block of README.md and docs/*.md is in BLOCKS, the one table below, under the page
and its key (the block's first line, whitespace collapsed, cut at a word near 60 characters; a
repeat within a page gets " #2", " #3"), with how it is checked:

- RUN: executed here on the tiny model, in a scratch directory (the configs copied, `.venv`
  linked, `runs/tiny-model` the session's tiny model) with the virtualenv's `bin` on PATH, as a
  reader who ran `make venv` and `source .venv/bin/activate` would; exit 0 (or the exit code the
  page says) and, where the page shows what it prints, the lines it shows (`...` stands for
  anything). Each RUN block is claimed by one test below (`_runs`). Its commands are parsed too.
- PARSE: needs a GPU, a cluster, Docker, an hour or a real model, so it is not run: every `rlhf`
  line is parsed by the real argument parser (services.cli.build_parser) and the config it names,
  with its `--set`s and flags, loads and validates with the real loader (a reader's own file, such
  as my.yaml, is stood in for by configs/tiny-cpu.yaml, so the overrides are still checked);
  `make X` is dry-run (`make -n X`) and every `rlhf` line that prints is parsed the same way;
  scripts, modules and repository paths named exist and take the flags given; every other command
  is one this file knows (`_check_command`). The client venv's `.venv-tinker/bin/python` (docs/tinker.md):
  a script with its flags, or a tinker-cookbook recipe whose `key=value` settings are its config's
  fields (where `.venv-tinker` exists); `export` of the client's environment (`CLIENT_ENV`).
- PROSE: not a command: what something prints, a diagram, a protocol, a data sample. A PROSE block
  holds no line that looks like a command.
- CONFIG / PARTIAL: a YAML config file as a whole (loaded as written, `base:` and all) / a part of
  one, merged onto configs/tiny-cpu.yaml (by `base:`) and validated against the config schema.
- SOURCE: Python shown as an example: it compiles, and what it imports from `services` exists.

A block that is not in the table fails, and so does an entry whose block is gone. A page whose
command blocks call `rlhf`, `python`, `tensorboard`, ... bare says `source .venv/bin/activate`
before its first such block (the alternative, which needs no note, is `.venv/bin/rlhf`).
"""

from __future__ import annotations

import ast
import contextlib
import importlib
import importlib.util
import io
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
PAGES = ["README.md", *sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").glob("*.md"))]

RUN, PARSE, PROSE, CONFIG, PARTIAL, SOURCE = "run", "parse", "prose", "config", "partial", "source"

# fmt: off
BLOCKS: dict[tuple[str, str], str] = {
    ("README.md", "make run # the main job: PPO on the tiny CPU default"): PARSE,
    # what make run prints: each line against what rlhf up prints, tests/e2e/test_sync_matches_local.py
    ("README.md", "embedded Redis on 127.0.0.1:41234 (data in runs/tiny-cpu/redis)"): PROSE,
    ("README.md", "=== summary (logs in runs/test-logs/) ==="): PROSE,
    ("docs/agents.md", "rlhf serve generation -c configs/tiny-cpu.yaml --set"): RUN,  # test_agents_talk_to_it
    ("docs/agents.md", "... INFO services.gateway.server: gateway: the OpenAI-compatible"): PROSE,  # its output
    ("docs/agents.md", "import httpx, openai"): RUN,  # test_agents_talk_to_it
    ("docs/agents.md", "turn 1: 'daeeaaaa' length policy-v0"): PROSE,  # its output, checked there
    ("docs/agents.md", '{"id": "demo-1", "server": "127.0.0.1:41223", "reward":'): PROSE,
    ("docs/agents.md", '{"model": "policy", "temperature": 0, "max_tokens": 4,'): PROSE,  # a request's body
    ("docs/agents.md", '{"id": "chatcmpl-8744aa36a7bc4b0c934b2a9fbb50ef1d",'): PROSE,  # its answer
    ("docs/agents.md", "import json, httpx, openai"): RUN,  # test_agents_talk_to_it
    ("docs/agents.md", '{"content": "...", "role": "assistant", "prompt_token_ids":'): PROSE,  # checked there
    ("docs/agents.md", "# my_agent.py"): SOURCE,
    ("docs/agents.md", "rollout:"): PARTIAL,
    ("docs/agents.md", "# my_env.py"): SOURCE,
    ("docs/agents.md", '{"base_url": "http://10.1.2.3:41007/v1", "api_key":'): PROSE,
    ("docs/agents.md", "$ rlhf eval -c configs/smollm2-agent.yaml --baseline"): PARSE,  # SmolLM2, minutes
    ("docs/agents.md", '{"id": "arithmetic-eval-29+78", "prompt": "What is'): PROSE,
    ("docs/agents.md", "make run-smollm2-agent # rlhf up -c configs/smollm2-agent.yaml"): PARSE,  # 44 minutes
    ("docs/agents.md", "iter 0/20 eval 0.117"): PROSE,
    ("docs/agents.md", "$ rlhf eval -c configs/smollm2-agent.yaml --baseline #2"): PARSE,
    ("docs/agents.md", "make run-smollm2-calculator # rlhf up -c"): PARSE,  # 38 minutes
    ("docs/agents.md", "iter 0/20 eval 0.094"): PROSE,
    ("docs/agents.md", "$ rlhf eval -c configs/smollm2-calculator.yaml --baseline"): PARSE,
    ("docs/agents.md", "from services.agents.sessions import as_sample"): SOURCE,
    ("docs/agents.md", "$ python benchmarks/bench_gateway.py -c configs/smollm2-cpu.yaml"): PARSE,  # SmolLM2
    ("docs/architecture.md", "learner --XADD prompts--> ns:prompts (Redis stream,"): PROSE,
    ("docs/architecture.md", "learner (feeder.py)"): PROSE,
    ("docs/architecture.md", ".venv/bin/rlhf serve generation -c configs/tiny-cpu.yaml"): PARSE,  # servers, forever
    ("docs/architecture.md", "proto/rlhf/v1/ gRPC and replay contracts: common, generation,"): PROSE,
    ("docs/architecture.md", "svc = serve(cfg) # nothing loaded or bound yet"): SOURCE,
    ("docs/architecture.md", "LISTENING service=generation port=44381 metrics_port=40111"): PROSE,
    ("docs/architecture.md", '@ADV_ESTIMATORS.register("grpo_mean") # now a valid'): SOURCE,
    ("docs/architecture.md", '@KL_ESTIMATORS.register("k3_unclamped", "k3u") # kl_penalty:'): SOURCE,
    ("docs/architecture.md", '@POLICY_LOSSES.register("vanilla_token_mean") # policy_loss:'): SOURCE,
    ("docs/architecture.md", '@register_rule("starts_with_label")'): SOURCE,
    ("docs/architecture.md", "reward:"): PARTIAL,
    ("docs/architecture.md", "rlhf serve learner -c FILE --nproc 4 # or model.nproc:"): PARSE,  # GPUs
    ("docs/algorithms.md", "dynamic sampling: iteration 1 has 1 of 4 groups with"): PROSE,  # what the log says
    ("docs/algorithms.md", ".venv/bin/python benchmarks/bench_arms.py -c"): PARSE,  # SmolLM2, 25 minutes
    ("docs/algorithms.md", ".venv/bin/python benchmarks/bench_arms.py -c #2"): PARSE,  # SmolLM2, 20 minutes
    ("docs/async.md", "generation:"): PARTIAL,
    ("docs/async.md", ".venv/bin/python benchmarks/bench_in_flight.py"): PARSE,  # SmolLM2, minutes
    ("docs/async.md", "8 prompts x n=4, up to 64 new tokens, 8 full pushes, 2 threads"): PROSE,  # what it prints
    ("docs/async.md", "max_staleness: 1 # generation runs ahead of the learner:"): PARTIAL,
    ("docs/async.md", ".venv/bin/python benchmarks/bench_partial.py -c"): PARSE,  # SmolLM2, minutes
    ("docs/cluster.md", "docker build -t rlhf:cpu --build-arg FLAVOUR=cpu ."): PARSE,  # a cluster
    ("docs/distillation.md", "$ rlhf train --local -c configs/tiny-cpu.yaml --run-dir"): RUN,  # test_self_distill
    ("docs/distillation.md", "distill:"): PARTIAL,
    ("docs/distillation.md", ".venv/bin/python benchmarks/bench_arms.py -c"): PARSE,  # SmolLM2, 55 minutes
    ("docs/distillation.md", ".venv/bin/python benchmarks/bench_arms.py -c #2"): PARSE,  # SmolLM2, 30 minutes
    ("docs/distillation.md", ".venv/bin/python benchmarks/bench_arms.py -c #3"): PARSE,  # SmolLM2, 20 minutes
    ("docs/distillation.md", "$ .venv/bin/python benchmarks/bench_teacher.py -c"): PARSE,  # SmolLM2, 2 minutes
    ("docs/distillation.md", ".venv/bin/rlhf serve teacher -c configs/tiny-cpu.yaml"): PARSE,  # a server, forever
    ("docs/distillation.md", "error: the teacher's tokenizer (runs/other-model, 67"): PROSE,  # test_teacher_server
    ("docs/distillation.md", 'RLHF_OVERRIDES="distill.enabled=true" docker compose'): PARSE,  # Docker
    ("docs/iterated-rlhf.md", "rlhf iterate -c configs/smollm2-rlhf-iterated.yaml"): PARSE,  # SmolLM2, an hour
    ("docs/iterated-rlhf.md", "iterate:"): PARTIAL,
    ("docs/iterated-rlhf.md", "== round 2 of 3 =="): PROSE,  # what it prints
    ("docs/iterated-rlhf.md", "pairs from runs/smollm2-rlhf-iterated/round-2/policy"): PROSE,  # ... at the end
    ("docs/iterated-rlhf.md", "RUN_DIR/"): PROSE,  # the layout
    ("docs/iterated-rlhf.md", "rlhf train-rm -c configs/smollm2-rlhf-iterated.yaml \\"): PARSE,  # SmolLM2, 8 minutes
    ("docs/environments.md", "config error in c.yaml: rollout.environment:"): PROSE,  # an unknown kind refused
    ("docs/environments.md", "# gym.yaml"): CONFIG,  # test_reasoning_gym writes it as gym.yaml
    ("docs/environments.md", "$ rlhf config validate bad-gym.yaml"): RUN,  # test_reasoning_gym_mistakes
    ("docs/environments.md", "$ rlhf train --local -c gym.yaml"): RUN,  # test_reasoning_gym
    ("docs/environments.md", '{"id": "spell_backward-1000003-0", "prompt": "Spell'): PROSE,  # its rows
    ("docs/environments.md", "model: {path: runs/smollm2-135m, device: cpu}"): PARTIAL,
    ("docs/environments.md", "$ rlhf up -c configs/smollm2-reasoning-gym.yaml"): PARSE,  # SmolLM2, 49 minutes
    ("docs/environments.md", "# vf_reverse.py"): SOURCE,  # test_verifiers writes it as vf_reverse.py
    ("docs/environments.md", "# vf.yaml"): CONFIG,  # and this as vf.yaml
    ("docs/environments.md", "$ rlhf train --local -c vf.yaml"): RUN,  # test_verifiers
    ("docs/environments.md", '{"id": "verifiers-81", "prompt": "user: daac=\\nassistant:'): PROSE,  # a row
    ("docs/environments.md", "the OpenEnv server at http://127.0.0.1:8012 is full:"): PROSE,  # the error
    ("docs/environments.md", "# my_adapter.py"): SOURCE,
    ("docs/environments.md", "python examples/openenv_reverse_env.py --port 8011"): RUN,  # test_openenv
    ("docs/environments.md", "# openenv.yaml"): CONFIG,  # test_openenv writes it as openenv.yaml
    ("docs/environments.md", "$ rlhf train --local -c openenv.yaml"): RUN,  # test_openenv
    ("docs/environments.md", '{"id": "reverse-eval-dcf", "prompt": "dcf=", "response":'): PROSE,  # its rows
    ("docs/environments.md", "$ python benchmarks/bench_openenv.py -c configs/tiny-cpu.yaml"): PARSE,  # a minute
    ("docs/evaluate.md", "tail -n 3 runs/tiny-cpu/generations/iter_000100.jsonl"): PARSE,  # after make run
    ("docs/evaluate.md", "WARNING services.learner.run: the reward-hacking watch"): PROSE,  # a log line
    ("docs/evaluate.md", "rlhf eval -c FILE [--model DIR] [--baseline DIR] [--data"): PARSE,  # a synopsis
    ("docs/evaluate.md", "16 prompts from synthetic:reverse, 1 sample(s) each (greedy)"): PROSE,
    ("docs/evaluate.md", '{"id": "reverse-eval-dcf", "prompt": "dcf=", "response":'): PROSE,
    ("docs/evaluate.md", "rlhf export runs/my-run/checkpoints/iter_000040 -c"): PARSE,  # your run
    ("docs/failure-model.md", "rpc:"): PARTIAL,  # rpc.push_parity
    ("docs/failure-model.md", "... INFO services.learner.parity: push parity v6: 1"): PROSE,  # what the check logs
    ("docs/gpu-box.md", "cp .env.example .env # set RLHF_AUTH_TOKEN and"): PARSE,  # Docker and GPUs
    ("docs/gpu-box.md", "RLHF_GENERATION_GPUS=0,1 # two generation replicas, one per GPU:"): PARSE,
    ("docs/gpu-box.md", "pip install '.[vllm]' # a GPU box: vLLM with its CUDA torch"): PARSE,
    ("docs/index.md", "make run # the main job: PPO on the tiny CPU default"): PARSE,
    ("docs/quickstart.md", "make run # the main job: PPO on the tiny CPU default"): PARSE,
    ("docs/quickstart.md", "=== summary (logs in runs/test-logs/) ==="): PROSE,
    ("docs/quickstart.md", "embedded Redis on 127.0.0.1:41234 (data in runs/tiny-cpu/redis)"): PROSE,
    ("docs/quickstart.md", ".venv/bin/rlhf config validate configs/tiny-cpu.yaml"): RUN,  # test_grpo_in_one_process
    ("docs/quickstart.md", "make smollm2 # runs/smollm2-135m: config, safetensors"): PARSE,  # SmolLM2, 30 minutes
    ("docs/quickstart.md", "make run-smollm2-rlhf # make-prefs (RLAIF pairs) ->"): PARSE,  # an hour
    ("docs/resume.md", "$ rlhf train --local -c my-run.yaml --run-dir runs/mine"): RUN,  # test_resume
    ("docs/resume.md", "$ rlhf train --local -c my-run.yaml --run-dir runs/long"): RUN,  # test_ctrl_c
    ("docs/resume.md", "$ rlhf up -c my-run.yaml --run-dir runs/mine"): RUN,  # test_resume
    ("docs/resume.md", "rlhf train --local -c my-run.yaml --run-dir runs/branch \\"): PARSE,  # SmolLM2
    ("docs/reward-api.md", 'POST {"query": [prompt+response, ...], "prompts": [prompt,'): PROSE,
    ("docs/reward-functions.md", "reward:"): PARTIAL,
    ("docs/reward-functions.md", "$ rlhf config validate bad.yaml"): RUN,  # test_reward_function_mistakes
    ("docs/reward-functions.md", "$ rlhf train --local -c my-run.yaml"): RUN,  # test_reward_function_that_raises
    ("docs/reward-functions.md", "error: learner stopped the run (the run cannot go on)."): PROSE,
    ("docs/reward-model.md", "rlhf make-prefs -c my.yaml --out pairs.jsonl [--n 4]"): PARSE,  # a synopsis
    ("docs/reward-model.md", "64 prompts from synthetic:reverse, 4 samples each at"): PROSE,
    ("docs/reward-model.md", '{"id": "reverse-train-edhc", "prompt": "edhc=", "chosen":'): PROSE,
    ("docs/reward-model.md", "model: {path: runs/smollm2-135m, device: cpu} # the"): PARTIAL,
    ("docs/reward-model.md", "rlhf train-rm -c my-rm.yaml [--out DIR] [--set"): PARSE,  # a synopsis
    ("docs/reward-model.md", "reward model on runs/tiny-model: 64 training pairs,"): PROSE,
    ("docs/reward-model.md", "reward:"): PARTIAL,
    ("docs/reward-model.md", "rlhf train-rm -c my-rm.yaml --set reward_model.ensemble=3"): PARSE,  # needs pairs
    ("docs/rlhf-smollm2.md", '{"prompt": "...What is 16 + 43? ...", "chosen": "16'): PROSE,
    ("docs/rlhf-smollm2.md", "held-out before training: pairwise accuracy 0.394 on"): PROSE,
    ("docs/rlhf-smollm2.md", '44 + 59 "44 + 59 = 223" -0.76'): PROSE,
    ("docs/rlhf-smollm2.md", "WARNING services.learner.run: reward hacking suspected:"): PROSE,
    ("docs/rlhf-smollm2.md", '84 + 56? "The answer is 17." 0.0 1.29'): PROSE,
    ("docs/rlhf-smollm2.md", "make run-smollm2-rlhf RLHF_CONFIG=my-rlhf.yaml RLHF_PROMPTS=64"): PARSE,  # an hour
    ("docs/rlhf-smollm2.md", "rlhf up -c configs/smollm2-rlhf.yaml --run-dir"): PARSE,  # SmolLM2, an hour
    ("docs/speed.md", "python benchmarks/bench_iteration.py -c configs/smollm2-cpu.yaml"): PARSE,  # SmolLM2
    ("docs/speed.md", "[23:14:32] local: 3 iterations of configs/smollm2-cpu.yaml"): PROSE,
    ("docs/speed.md", "mode s/it samples/s generate wait train push tok/s peak MB"): PROSE,
    ("docs/speed.md", "median 37.5 s per iteration, 0.293 s per sample (10"): PROSE,
    ("docs/speed.md", "rlhf train --local -c configs/smollm2-cpu.yaml --set"): PARSE,  # SmolLM2
    ("docs/speed.md", "16 prompts x 8 samples, 24 new tokens, T 0.7, runs/smollm2-135m,"): PROSE,
    ("docs/speed.md", "way s tokens tok/s vs generate (run 1: --vllm float32)"): PROSE,
    ("docs/speed.md", "$ python benchmarks/bench_steps.py -c configs/gpu.yaml"): PARSE,  # a GPU
    ("docs/speed.md", "python benchmarks/bench_delta_push.py --repeats 3"): PARSE,  # SmolLM2, minutes
    ("docs/tinker.md", "docker compose --profile tinker up -d tinker"): PARSE,  # Docker
    ("docs/tinker.md", "$ RLHF_AUTH_TOKEN=s3cret .venv/bin/rlhf serve tinker"): PARSE,  # a server, forever
    ("docs/tinker.md", "... INFO services.tinker.server: tinker: the Tinker"): PROSE,  # its output
    ("docs/tinker.md", "$ RLHF_AUTH_TOKEN=s3cret .venv/bin/rlhf serve generation"): PARSE,  # two servers, forever
    ("docs/tinker.md", "... INFO services.tinker.decoders: tinker: samples"): PROSE,  # their logs
    ("docs/tinker.md", "$ RLHF_AUTH_TOKEN=s3cret .venv/bin/rlhf serve tinker-trainer"): PARSE,  # two servers, forever
    ("docs/tinker.md", "... INFO services.tinker.trainers: tinker: training"): PROSE,  # their logs: tests/tinker
    ("docs/tinker.md", "$ .venv/bin/rlhf up -c configs/tiny-cpu.yaml --run-dir"): PARSE,  # tests/e2e/test_up_tinker.py
    ("docs/tinker.md", "generation-0 ready on port 43441"): PROSE,  # rlhf up --tinker-generation: tests/e2e
    ("docs/tinker.md", "$ .venv/bin/python benchmarks/bench_tinker_sampling.py"): PARSE,  # SmolLM2, a minute
    ("docs/tinker.md", "$ .venv/bin/python benchmarks/bench_tinker_overhead.py"): PARSE,  # SmolLM2, a minute
    ("docs/tinker.md", "$ .venv/bin/python benchmarks/bench_tinker_overhead.py #2"): PARSE,  # --trainer, SmolLM2
    ("docs/tinker.md", "$ .venv/bin/rlhf eval -c configs/smollm2-cpu.yaml --model"): PARSE,  # needs the run's weights
    ("docs/tinker.md", "import tinker"): SOURCE,  # the SDK's calls: tests/tinker/test_tinker_api.py
    ("docs/tinker.md", "$ make tinker-venv"): PARSE,  # pip, minutes
    ("docs/tinker.md", "$ RLHF_AUTH_TOKEN=local .venv/bin/rlhf serve tinker"): PARSE,  # SmolLM2, a server
    ("docs/tinker.md", "$ export TINKER_API_KEY=tml-local TINKER_TELEMETRY=0"): PARSE,  # the client's env
    ("docs/tinker.md", "$ .venv-tinker/bin/python -m"): PARSE,  # chat_sl on SmolLM2, minutes
    ("docs/tinker.md", "Training for 16 batches x 1 epochs = 16 steps"): PROSE,  # its output
    ("docs/tinker.md", "$ .venv-tinker/bin/python -m #2"): PARSE,  # math_rl on SmolLM2, minutes
    ("docs/tinker.md", "step env/all/correct env/all/format env/all/reward/total"): PROSE,  # its output
    ("docs/tinker.md", "$ .venv-tinker/bin/python examples/tinker_arithmetic_eval.py"): PARSE,  # SmolLM2
    ("docs/tinker.md", "base model: What is 41 + 34? -> '41 + 34 = 125<|im_end|>' (wrong)"): PROSE,  # its output
    ("docs/your-model.md", ".venv/bin/rlhf config validate configs/tiny-cpu.yaml"): RUN,  # test_grpo_in_one_process
    ("docs/your-model.md", "# mine.yaml"): CONFIG,
    ("docs/your-model.md", "data: {train:"): PARTIAL,  # a reasoning-gym task
    ("docs/your-model.md", 'data: {train: "hf:openai/gsm8k:main", eval:'): PARTIAL,
    ("docs/your-model.md", '{"prompt": "abc=", "answer": "cba"}'): PROSE,  # p.jsonl, which test_data_checked writes
    ("docs/your-model.md", "$ rlhf config validate my.yaml"): RUN,  # test_data_checked
}
# fmt: on

# config files a page names that are the reader's own (written on the page, or to be written):
# their commands are checked on configs/tiny-cpu.yaml with the same overrides
READERS_CONFIGS = {
    "FILE",
    "my.yaml",
    "my-run.yaml",
    "my-rm.yaml",
    "bad.yaml",
    "mine.yaml",
    "gym.yaml",
    "bad-gym.yaml",
    "vf.yaml",
    "openenv.yaml",
}
STAND_IN = "configs/tiny-cpu.yaml"
# what a synopsis's placeholders stand for when it is parsed ([...] marks an optional part)
SYNOPSIS = {"N": "2", "T": "1.0", "R": "1.0", "SOURCE": "synthetic:reverse", "NAME": "exact_match"}
# commands that are on the PATH only in the project's virtualenv (`source .venv/bin/activate`)
VENV_COMMANDS = {"rlhf", "python", "tensorboard", "mkdocs", "pytest", "torchrun", "ruff", "mypy"}
ACTIVATE = "source .venv/bin/activate"
RLHF = {"rlhf", ".venv/bin/rlhf", ".venv-vllm/bin/rlhf"}
PYTHON = {"python", "python3", ".venv/bin/python", ".venv-vllm/bin/python"}
# the client venv of `rlhf serve tinker` (`make tinker-venv`: the tinker SDK and tinker-cookbook),
# and the environment its commands take (not the services': in no docker-compose file)
TINKER_VENV, TINKER_PYTHON = ROOT / ".venv-tinker", ".venv-tinker/bin/python"
CLIENT_ENV = {"TINKER_API_KEY", "TINKER_TELEMETRY", "HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "HTTPS_PROXY", "NO_PROXY"}
# commands a PARSE block may hold whose only check is the paths they name (no Docker, no cluster)
UNCHECKED = {"kind", "curl", "tail", "head", "mkdir", "cat", "ls", "grep"}
# the top directories of this repository: a path under one that a command names must exist
REPO_DIRS = ("configs/", "deploy/", "docker/", "examples/", "benchmarks/", "tests/", "services/", "proto/", "docs/")
COMMAND_LINE = re.compile(
    r"^\s*(\$ |(rlhf|make|python3?|pip|docker|kubectl|kind|curl|cp|tail|torchrun|tensorboard|mkdocs|"
    r"pytest|bash)\s|\.venv)"
)


@dataclass
class Block:
    page: str
    line: int  # of the opening fence, from 1
    lang: str
    text: str  # dedented by the fence's indent

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"


FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})[ \t]*(?P<lang>[\w+-]*)[^`]*$")


def _key(text: str) -> str:
    """The block's first non-blank line, whitespace collapsed, cut after the word that reaches 50
    characters (at most 65)."""
    first = " ".join(next((line for line in text.splitlines() if line.strip()), "").split())
    if len(first) <= 65:
        return first
    words, out = first.split(" "), ""
    for word in words:
        if out and (len(out) >= 50 or len(out) + 1 + len(word) > 65):
            break
        out = f"{out} {word}" if out else word
    return out


def page_blocks(page: str) -> dict[str, Block]:
    """The fenced blocks of `page` by key, in order."""
    lines = (ROOT / page).read_text().splitlines()
    out: dict[str, Block] = {}
    seen: dict[str, int] = {}
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence = len(m["indent"]), m["fence"]
        j = i + 1
        while j < len(lines) and not re.fullmatch(rf"[ \t]*{re.escape(fence[0])}{{{len(fence)},}}[ \t]*", lines[j]):
            j += 1
        body = "\n".join(line[indent:] if not line[:indent].strip() else line for line in lines[i + 1 : j])
        key = _key(body)
        seen[key] = seen.get(key, 0) + 1
        out[f"{key} #{seen[key]}" if seen[key] > 1 else key] = Block(page, i + 1, m["lang"], body + "\n")
        i = j + 1
    return out


def doc_blocks() -> dict[tuple[str, str], Block]:
    return {(page, key): block for page in PAGES for key, block in page_blocks(page).items()}


def block(page: str, key: str) -> Block:
    got = page_blocks(page).get(key)
    assert got is not None, f"{page} has no block {key!r} any more: update BLOCKS and this test"
    return got


def _entries(*kinds: str) -> list:
    return [pytest.param(page, key, id=f"{page}:{key[:40]}") for (page, key), kind in BLOCKS.items() if kind in kinds]


# ---------------------------------------------------------------------------------------------
# the table


def test_every_block_is_in_the_table_and_every_entry_is_a_block():
    blocks = doc_blocks()
    missing = [
        f"{b.where} ```{b.lang or ''} block {key!r}: add ({page!r}, {key!r}): RUN/PARSE/PROSE/... to BLOCKS "
        "in tests/docs/test_doc_commands.py"
        for (page, key), b in blocks.items()
        if (page, key) not in BLOCKS
    ]
    assert missing == [], "blocks of the docs that BLOCKS does not say how to check:\n" + "\n".join(missing)
    gone = [f"{page}: {key!r}" for page, key in BLOCKS if (page, key) not in blocks]
    assert gone == [], "BLOCKS entries whose block is no longer in the docs (remove or re-key them):\n" + "\n".join(
        gone
    )
    assert set(BLOCKS.values()) <= {RUN, PARSE, PROSE, CONFIG, PARTIAL, SOURCE}


def test_blocks_are_checked_by_what_they_hold():
    """A shell block is RUN, PARSE or PROSE; YAML is a config (or PROSE); Python SOURCE or RUN; a
    language this file does not know fails, so that someone decides how to check it."""
    allowed = {
        "bash": {RUN, PARSE},
        "sh": {RUN, PARSE},
        "shell": {RUN, PARSE},
        "console": {RUN, PARSE},
        "": {RUN, PARSE, PROSE},
        "text": {PROSE},
        "yaml": {CONFIG, PARTIAL, PROSE},
        "python": {SOURCE, RUN},
        "json": {PROSE},
    }
    wrong = [
        f"{b.where} ```{b.lang}: {BLOCKS[k]} (allowed: {sorted(allowed.get(b.lang, []))})"
        for k, b in doc_blocks().items()
        if k in BLOCKS and BLOCKS[k] not in allowed.get(b.lang, set())
    ]
    assert wrong == []


def test_prose_blocks_hold_no_commands():
    """A block marked PROSE that holds a command line (`$ ...`, `rlhf ...`, `make ...`) would
    escape every check: it is RUN or PARSE instead."""
    found = [
        f"{b.where}: {line.strip()!r}"
        for k, b in doc_blocks().items()
        if BLOCKS.get(k) == PROSE
        for line in b.text.splitlines()
        if COMMAND_LINE.match(line)
    ]
    assert found == [], "PROSE blocks with command lines (make them RUN or PARSE):\n" + "\n".join(found)


# ---------------------------------------------------------------------------------------------
# shell: the commands of a block


def _logical_lines(text: str) -> list[str]:
    """The block's commands: in a console transcript (lines starting with `$ `) those lines only,
    else every line; a trailing backslash joins the next line."""
    lines = text.splitlines()
    console = any(line.startswith("$ ") for line in lines)
    out, cont = [], False
    for line in lines:
        if cont:
            out[-1] = out[-1][:-1] + " " + line.strip()
        elif console and not line.startswith("$ "):
            continue
        else:
            out.append(line[2:] if console else line)
        cont = out[-1].rstrip().endswith("\\") if out else False
        if cont:
            out[-1] = out[-1].rstrip()
    return [line for line in out if line.strip()]


def commands(text: str) -> list[list[str]]:
    """Every simple command of a shell block as its words (comments dropped; split at |, &&, ;, &)."""
    out = []
    for line in _logical_lines(text):
        lex = shlex.shlex(line, posix=True, punctuation_chars=True)
        lex.whitespace_split = True
        words: list[str] = []
        for token in [*lex, ";"]:
            if token in {"|", "||", "&&", ";", "&"}:
                if words:
                    out.append(words)
                words = []
            else:
                words.append(token)
    return out


def _without_assignments(words: list[str]) -> tuple[dict[str, str], list[str]]:
    env = {}
    while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", words[0]):
        name, _, value = words[0].partition("=")
        env[name] = value
        words = words[1:]
    return env, words


def _synopsis(words: list[str]) -> list[str]:
    """A synopsis's words as a command: brackets of optional parts dropped (not those of a value,
    as in `key=[a,b]`), `...` dropped, placeholders of numbers and sources given a value."""
    out = []
    for w in words:
        w = w.lstrip("[")
        while w.endswith("]") and w.count("]") > w.count("["):
            w = w[:-1]
        if w and w not in ("...", "|"):
            out.append(SYNOPSIS.get(w, w))
    return out


def check_rlhf(argv: list[str], where: str) -> None:
    """`rlhf ARGV` parses with the real parser, and its config (with its --set and flags) loads
    and validates with the real loader."""
    from services.cli import build_parser, flag_overrides
    from services.common.config import ConfigError, config_data, config_from_dict

    argv = _synopsis(argv)
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            args = build_parser().parse_args(argv)
    except SystemExit as e:
        raise AssertionError(f"{where}: `rlhf {shlex.join(argv)}` does not parse ({e.code}): {err.getvalue()}")
    config = getattr(args, "config", None)
    if config is None:
        return
    if config in READERS_CONFIGS:
        config = STAND_IN
    path = ROOT / config if (ROOT / config).is_file() else ROOT / "configs" / config
    assert path.is_file(), f"{where}: `rlhf {shlex.join(argv)}` names the config {config}, which is no file here"
    try:
        config_from_dict(config_data(path, [*args.overrides, *flag_overrides(args)]))
    except ConfigError as e:
        raise AssertionError(f"{where}: `rlhf {shlex.join(argv)}`: config errors: {e.errors}") from None


def _check_flags(source_file: Path, flags: list[str], what: str, where: str) -> None:
    text = source_file.read_text()
    unknown = [f for f in flags if f'"{f}"' not in text and f"'{f}'" not in text]
    assert unknown == [], f"{where}: {what} takes no {unknown}"


def check_make(targets: list[str], where: str) -> None:
    """`make -n TARGETS` (a dry run: nothing is built) knows each target, and every `rlhf` line it
    would run parses, with its config."""
    proc = subprocess.run(["make", "-n", *targets], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"{where}: `make -n {' '.join(targets)}` failed:\n{proc.stderr}"
    for words in commands(proc.stdout.replace("\\\n\t", " ")):
        if words and words[0] in RLHF:
            check_rlhf(words[1:], f"{where} (make {' '.join(targets)})")


def _compose_services() -> tuple[set[str], set[str]]:
    services, profiles = set(), set()
    for f in ROOT.glob("docker-compose*.yml"):
        for name, svc in (yaml.safe_load(f.read_text()).get("services") or {}).items():
            services.add(name)
            profiles.update(svc.get("profiles") or [])
    return services, profiles


def _check_client(args: list[str], where: str) -> None:
    """A command of the client venv (`.venv-tinker/bin/python`): a script of this repository with
    its flags; a module (tinker-cookbook's recipes) found in the client venv, its `key=value`
    settings fields of its config (checked where the venv is; CI has none)."""
    if "-m" not in args:
        script = ROOT / args[0]
        assert script.is_file(), f"{where}: no script {args[0]}"
        _check_flags(script, [a for a in args if a.startswith("--")], args[0], where)
        return
    module = args[args.index("-m") + 1]
    found = sorted(TINKER_VENV.glob(f"lib/python3*/site-packages/{module.replace('.', '/')}.py"))
    if not TINKER_VENV.is_dir():
        return
    assert found, f"{where}: no module {module} in {TINKER_VENV.name}"
    text = found[0].read_text()
    keys = [a.split("=")[0] for a in args[args.index("-m") + 2 :] if "=" in a]
    unknown = [k for k in keys if not re.search(rf"^    {re.escape(k)}: ", text, re.M)]
    assert unknown == [], f"{where}: {module} has no setting {unknown}"


def _check_command(words: list[str], where: str) -> None:
    env, words = _without_assignments(words)
    if words[:1] == ["export"]:
        env, words = _without_assignments(words[1:])
        assert not words, f"{where}: export takes NAME=VALUE only"
    compose_text = "".join(p.read_text() for p in [ROOT / ".env.example", *ROOT.glob("docker-compose*.yml")])
    client = words[:1] == [TINKER_PYTHON] or not words
    for name, value in env.items():
        if client and name in CLIENT_ENV:
            continue
        assert name in compose_text, f"{where}: {name} is in no docker-compose file and not in .env.example"
        if name == "RLHF_CONFIG":
            check_rlhf(["config", "validate", value], where)
    if not words:
        return
    cmd, args = words[0], words[1:]
    if cmd == TINKER_PYTHON:
        _check_client(args, where)
        return
    paths = args[:-1] if cmd == "cp" else args
    for p in paths:
        if p.startswith(REPO_DIRS) or p in (".env.example", "Dockerfile"):
            assert (ROOT / p).exists(), f"{where}: `{shlex.join(words)}` names {p}, which does not exist"
    if cmd in RLHF:
        check_rlhf(args, where)
    elif cmd in PYTHON or cmd == "torchrun":
        if "-m" in args:
            module = args[args.index("-m") + 1]
            rest = args[args.index("-m") + 2 :]
            if module == "services.cli":
                check_rlhf(rest, where)
                return
            spec = importlib.util.find_spec(module)
            assert spec is not None and spec.origin, f"{where}: no module {module}"
            _check_flags(Path(spec.origin), [a for a in rest if a.startswith("--")], f"python -m {module}", where)
        else:
            assert cmd != "torchrun", f"{where}: torchrun without -m"
            script = ROOT / args[0]
            assert script.is_file(), f"{where}: no script {args[0]}"
            _check_flags(script, [a.lstrip("[") for a in args if a.lstrip("[").startswith("--")], args[0], where)
    elif cmd == "make":
        check_make([a for a in args if not a.startswith("-") and "=" not in a], where)
    elif cmd == "cp":
        for src in args[:-1]:
            assert (ROOT / src).exists(), f"{where}: cp {src}: no such file"
    elif cmd == "pip":
        for spec in args[1:]:
            extra = re.fullmatch(r"\.\[(\w+)\]", spec)
            if extra:
                optional = __import__("tomllib").loads((ROOT / "pyproject.toml").read_text())["project"]
                assert extra[1] in optional["optional-dependencies"], f"{where}: no extra {extra[1]}"
    elif cmd == "docker" and args[:1] == ["build"]:
        dockerfile = (ROOT / "Dockerfile").read_text()
        for i, a in enumerate(args):
            if a == "--build-arg":
                name = args[i + 1].split("=")[0]
                assert re.search(rf"^ARG {name}\b", dockerfile, re.M), f"{where}: the Dockerfile has no ARG {name}"
    elif cmd == "docker" and args[:1] == ["compose"]:
        services, profiles = _compose_services()
        for i, a in enumerate(args):
            if a == "--profile":
                assert args[i + 1] in profiles, f"{where}: no compose profile {args[i + 1]}"
        if len(args) > 1 and args[1] in ("logs", "exec", "restart", "stop", "start"):
            assert args[-1] in services, f"{where}: no compose service {args[-1]}"
    elif cmd == "kubectl":
        if "-k" in args:
            overlay = ROOT / args[args.index("-k") + 1]
            assert (overlay / "kustomization.yaml").is_file(), f"{where}: {overlay} is no kustomization"
    else:
        assert cmd in UNCHECKED, f"{where}: `{cmd}` is a command this test does not know: add a check for it"


@pytest.mark.parametrize("page,key", _entries(RUN, PARSE))
def test_commands_parse(page, key):
    b = block(page, key)
    if b.lang == "python":
        return  # the Python a RUN test runs
    cmds = commands(b.text)
    assert cmds, f"{b.where}: no command in a {BLOCKS[page, key]} block"
    for words in cmds:
        _check_command(words, b.where)


def test_pages_that_call_venv_commands_bare_say_to_activate_the_venv():
    """`make venv` puts `rlhf` in .venv/bin, not on the PATH: a page whose command blocks call it
    (or python, tensorboard, ...) bare says `source .venv/bin/activate` near its top (before its
    first section, `## `, and before the first such block)."""
    bare = []
    for (page, key), kind in BLOCKS.items():
        b = page_blocks(page).get(key)
        if kind not in (RUN, PARSE) or b is None or b.lang == "python":
            continue
        used = sorted({words[0] for c in commands(b.text) if (words := _without_assignments(c)[1])} & VENV_COMMANDS)
        text = (ROOT / page).read_text()
        top = "\n".join(text.splitlines()[: b.line - 1]).split("\n## ")[0]
        if used and ACTIVATE not in top:
            bare.append(f"{b.where}: {', '.join(used)}")
    assert bare == [], (
        f"blocks that call virtualenv commands bare on pages that do not say `{ACTIVATE}` near their top "
        "(before the first `## ` and the block; or write .venv/bin/rlhf):\n" + "\n".join(bare)
    )


# ---------------------------------------------------------------------------------------------
# YAML and Python


@pytest.mark.parametrize("page,key", _entries(CONFIG, PARTIAL))
def test_config_blocks_validate(page, key, tmp_path):
    from services.common.config import ConfigError, load_config

    b = block(page, key)
    data = yaml.safe_load(b.text)
    assert isinstance(data, dict), f"{b.where}: not a mapping"
    if BLOCKS[page, key] == PARTIAL:
        assert "base" not in data, f"{b.where}: names a base: it is a CONFIG"
        data = {"base": str(ROOT / STAND_IN), **data}
        text = yaml.safe_dump(data)
    else:
        text = b.text
    name = re.match(r"#\s*(\S+\.ya?ml)", b.text)
    path = tmp_path / (name[1] if name else "config.yaml")
    path.write_text(text)
    try:
        load_config(path)
    except ConfigError as e:
        raise AssertionError(f"{b.where}: the config does not validate: {e.errors}") from None


@pytest.mark.parametrize("page,key", _entries(SOURCE, RUN))
def test_python_blocks_compile_and_import_what_exists(page, key):
    b = block(page, key)
    if b.lang != "python":
        return
    tree = compile(b.text, b.where, "exec", ast.PyCF_ONLY_AST)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("services"):
            module = importlib.import_module(node.module)
            for alias in node.names:
                assert hasattr(module, alias.name), f"{b.where}: {node.module} has no {alias.name}"


# ---------------------------------------------------------------------------------------------
# RUN: the blocks executed here

RUNNERS: dict[str, list[tuple[str, str]]] = {}


def _runs(*keys: tuple[str, str]):
    """Declare the blocks a test runs (and the output blocks it compares with)."""

    def deco(fn):
        RUNNERS[fn.__name__] = list(keys)
        return fn

    return deco


def test_every_run_block_has_a_test_that_runs_it():
    claimed = [k for keys in RUNNERS.values() for k in keys]
    assert len(claimed) == len(set(claimed)), "a block claimed by two tests"
    wrong = [k for k in claimed if BLOCKS.get(k) not in (RUN, PROSE)]
    assert wrong == [], f"claimed by a run test, but not RUN (or PROSE output) blocks of BLOCKS: {wrong}"
    unclaimed = [k for k, kind in BLOCKS.items() if kind == RUN and k not in claimed]
    assert unclaimed == [], f"RUN blocks no test runs: {unclaimed}"


@pytest.fixture
def scratch(tmp_path, tiny_model_dir):
    """A directory to run the docs' commands in, as a reader's clone after `make venv` and `make
    model`: configs/, examples/, .venv (linked) and runs/tiny-model (the session's tiny model)."""
    work = tmp_path.resolve() / "work"
    work.mkdir()
    shutil.copytree(ROOT / "configs", work / "configs")
    shutil.copytree(ROOT / "examples", work / "examples")
    (work / ".venv").symlink_to(sys.prefix)
    (work / "runs").mkdir()
    (work / "runs" / "tiny-model").symlink_to(tiny_model_dir)
    return work


def _env(**extra: str) -> dict[str, str]:
    """The environment of a shell whose user sourced .venv/bin/activate; no RLHF_* of ours."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RLHF_")}
    env.update(
        PATH=f"{Path(sys.prefix) / 'bin'}{os.pathsep}{env.get('PATH', '')}",
        VIRTUAL_ENV=sys.prefix,
        PYTHONUNBUFFERED="1",
        **extra,
    )
    env.setdefault("OMP_NUM_THREADS", "1")  # the tiny model gains nothing from more; a busy machine loses
    env.pop("PYTHONPATH", None)
    return env


def _bash(script: str, cwd: Path, env: dict, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", "-e", "-c", script],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=timeout,
    )


def _pattern(doc_line: str, loose_quotes: bool = False) -> re.Pattern:
    """A line the docs show as a pattern: `...` is anything; with `loose_quotes`, a quoted string
    ('...') is any (what a model samples)."""
    parts = [re.escape(p) for p in doc_line.rstrip().split("...")]
    pattern = ".*".join(parts)
    if loose_quotes:
        pattern = re.sub(r"'(?:[^'\\]|\\.)*'", "'[^']*'", pattern)
    return re.compile(pattern)


def assert_shows(doc_lines: list[str], output: str, where: str, loose_quotes: bool = False) -> None:
    """Each line the docs show (but a bare `...`) is a line of `output`, in the same order."""
    got = output.splitlines()
    i = 0
    for doc_line in doc_lines:
        if doc_line.strip() in ("", "..."):
            continue
        pattern = _pattern(doc_line, loose_quotes)
        while i < len(got) and not pattern.fullmatch(got[i].rstrip()):
            i += 1
        assert i < len(got), f"{where}: the docs show {doc_line!r}, which it did not print (in order):\n{output}"
        i += 1


def run_console(b: Block, cwd: Path, env: dict, rcs: list[int], subst: dict | None = None) -> list[str]:
    """Run each `$ ` command of a console block in turn; each exits with its code in `rcs` and
    prints the lines the block shows after it (with `subst` applied to them)."""
    steps: list[tuple[str, list[str]]] = []
    for line in b.text.splitlines():
        if line.startswith("$ "):
            steps.append((line[2:], []))
        elif steps and steps[-1][0].endswith("\\"):
            steps[-1] = (steps[-1][0][:-1] + line, steps[-1][1])
        elif steps:
            shown = line
            for old, new in (subst or {}).items():
                shown = shown.replace(old, new)
            steps[-1][1].append(shown)
    assert len(steps) == len(rcs), f"{b.where}: {len(steps)} commands"
    outputs = []
    for (command, shown), rc in zip(steps, rcs):
        proc = subprocess.run(
            ["bash", "-c", command],
            cwd=cwd,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=600,
        )
        assert proc.returncode == rc, f"{b.where}: `{command}` exited {proc.returncode}, not {rc}:\n{proc.stdout}"
        assert_shows(shown, proc.stdout, f"{b.where}: `{command}`")
        outputs.append(proc.stdout)
    return outputs


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


QUICKSTART_GRPO = ("docs/quickstart.md", ".venv/bin/rlhf config validate configs/tiny-cpu.yaml")
YOUR_MODEL_GRPO = ("docs/your-model.md", ".venv/bin/rlhf config validate configs/tiny-cpu.yaml")


@_runs(QUICKSTART_GRPO, YOUR_MODEL_GRPO)
def test_grpo_in_one_process(scratch):
    """Quickstart's (and Your model's) GRPO command pair, as written; $RLHF_SET (which the
    command's --set override, and which sets no key they set) cuts the run to 2 iterations."""
    text = block(*QUICKSTART_GRPO).text
    assert block(*YOUR_MODEL_GRPO).text == text, "the two pages' blocks differ: run both"
    proc = _bash(text, scratch, _env(RLHF_SET="run.iterations=2"))
    assert proc.returncode == 0, proc.stdout
    assert "adv_estimator: grpo" in proc.stdout and "num_return_sequences_in_group: 4" in proc.stdout
    assert_shows(["iter    2/2  reward ...", "done: held-out reward ... in 2 iterations, ...; results in runs/grpo"],
                 proc.stdout, QUICKSTART_GRPO[0])  # fmt: skip
    assert (scratch / "runs" / "grpo" / "summary.json").is_file()


AGENTS_SERVE = ("docs/agents.md", "rlhf serve generation -c configs/tiny-cpu.yaml --set")
AGENTS_LISTENING = ("docs/agents.md", "... INFO services.gateway.server: gateway: the OpenAI-compatible")
AGENTS_TALK = ("docs/agents.md", "import httpx, openai")
AGENTS_PRINTS = ("docs/agents.md", "turn 1: 'daeeaaaa' length policy-v0")
AGENTS_TOKENS = ("docs/agents.md", "import json, httpx, openai")
AGENTS_TOKENS_PRINTS = ("docs/agents.md", '{"content": "...", "role": "assistant", "prompt_token_ids":')


@_runs(AGENTS_SERVE, AGENTS_LISTENING, AGENTS_TALK, AGENTS_PRINTS, AGENTS_TOKENS, AGENTS_TOKENS_PRINTS)
def test_agents_talk_to_it(scratch):
    """Agents' "Run it" and "Talk to it": the generation server and the gateway as written, then
    the Python as written; it prints what the page shows, but for what the model sampled; then
    the Python of "NeMo Gym's token fields" the same way. The gateway's port 8090 is replaced by
    a free one in all four blocks, and the generation server
    gets free ports through $RLHF_SET (the page's commands set neither), so that a port in use on a
    shared machine fails nothing."""
    port, gen_port = str(_free_port()), _free_port()
    serve, talk, shown, listening, tokens, tokens_shown = (block(*k).text.replace("8090", port) for k in (
        AGENTS_SERVE, AGENTS_TALK, AGENTS_PRINTS, AGENTS_LISTENING, AGENTS_TOKENS, AGENTS_TOKENS_PRINTS))  # fmt: skip
    env = _env(RLHF_SET=f"rpc.generation.port={gen_port} rpc.generation.metrics_port=0")
    proc = subprocess.Popen(
        ["bash", "-c", serve],
        cwd=scratch,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(proc.stdout.readline, "")), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 300
        while not all(any(f"LISTENING service={s}" in line for line in lines) for s in ("generation", "gateway")):
            assert proc.poll() is None, f"{AGENTS_SERVE[0]}: the servers stopped:\n{''.join(lines)}"
            assert time.monotonic() < deadline, f"the servers never listened:\n{''.join(lines)}"
            time.sleep(0.1)
        (scratch / "talk.py").write_text(talk)
        out = subprocess.run(
            ["python", "talk.py"], cwd=scratch, env=env, capture_output=True, text=True, timeout=300
        )  # fmt: skip
        assert out.returncode == 0, f"{AGENTS_TALK[0]} Talk to it:\n{out.stdout}\n{out.stderr}\n{''.join(lines)}"
        assert_shows(shown.splitlines(), out.stdout, f"{AGENTS_TALK[0]} Talk to it", loose_quotes=True)
        assert_shows(listening.splitlines(), "".join(lines), f"{AGENTS_SERVE[0]} Run it")
        (scratch / "tokens.py").write_text(tokens)
        out = subprocess.run(
            ["python", "tokens.py"], cwd=scratch, env=env, capture_output=True, text=True, timeout=300
        )  # fmt: skip
        assert out.returncode == 0, f"{AGENTS_TOKENS[0]} token fields:\n{out.stdout}\n{out.stderr}\n{''.join(lines)}"
        assert_shows(tokens_shown.splitlines(), out.stdout, f"{AGENTS_TOKENS[0]} token fields")
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


RESUME = ("docs/resume.md", "$ rlhf train --local -c my-run.yaml --run-dir runs/mine")
ONE_RUN = ("docs/resume.md", "$ rlhf up -c my-run.yaml --run-dir runs/mine")


@_runs(RESUME, ONE_RUN)
def test_resume(scratch):
    """Resume's transcript, with my-run.yaml the tiny default: 3 iterations, then the same command
    with 5 goes on from iteration 3's checkpoint; then "A run directory holds one run": `rlhf up`,
    and another LoRA rank, on that directory are refused (exit code 2)."""
    (scratch / "my-run.yaml").write_text("base: tiny-cpu\n")
    run_console(block(*RESUME), scratch, _env(), rcs=[0, 0])
    run_console(block(*ONE_RUN), scratch, _env(), rcs=[2, 2])


CTRL_C = ("docs/resume.md", "$ rlhf train --local -c my-run.yaml --run-dir runs/long")


@_runs(CTRL_C)
def test_ctrl_c(scratch):
    """Resume's "Stop with Ctrl-C": the command as written, SIGINT to its process group (as a
    terminal's Ctrl-C) once it prints iteration 2's line; exit code 130 and the lines the page shows.
    The run may stop after another iteration than the page's 2 (the one under way when the signal
    came): the page's numbers stand for the one it names. The checkpoint it names is there."""
    b = block(*CTRL_C)
    (scratch / "my-run.yaml").write_text("base: tiny-cpu\n")
    command = next(line[2:] for line in b.text.splitlines() if line.startswith("$ "))
    proc = subprocess.Popen(
        ["bash", "-c", command],
        cwd=scratch,
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )

    def kill() -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)

    watchdog = threading.Timer(300, kill)  # a run that never stops fails, not hangs
    watchdog.start()
    lines: list[str] = []
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("iter    2/"):
                os.killpg(proc.pid, signal.SIGINT)
                break
        lines += proc.stdout.readlines()
        rc = proc.wait()
    finally:
        watchdog.cancel()
        kill()  # nothing of the run left behind
        proc.wait()
    output = "".join(lines)
    assert rc == 130, f"{b.where}: exited {rc}, not 130:\n{output}"
    m = re.search(r"^interrupted at iteration (\d+):", output, re.M)
    assert m, f"{b.where}: no 'interrupted at iteration N' line:\n{output}"
    n = int(m[1])
    shown = b.text.splitlines()[1:]
    for old, new in {"^C": "", "iteration 2:": f"iteration {n}:", "iter_000002": f"iter_{n:06d}"}.items():
        shown = [line.replace(old, new) for line in shown]
    assert_shows(shown, output, b.where)
    assert (scratch / "runs" / "long" / "checkpoints" / f"iter_{n:06d}" / "learner.pt").is_file()


DATA_CHECKED = ("docs/your-model.md", "$ rlhf config validate my.yaml")
P_JSONL = ("docs/your-model.md", '{"prompt": "abc=", "answer": "cba"}')


@_runs(DATA_CHECKED, P_JSONL)
def test_data_checked(scratch):
    """Your model's "Checked before the run starts": p.jsonl as the page shows it, my.yaml as it
    says (`base: tiny-cpu`, `data: {train: p.jsonl}`); both errors as shown, exit code 2."""
    (scratch / "p.jsonl").write_text(block(*P_JSONL).text)
    (scratch / "my.yaml").write_text("base: tiny-cpu\ndata: {train: p.jsonl}\n")
    run_console(block(*DATA_CHECKED), scratch, _env(), rcs=[2])


MISTAKES = ("docs/reward-functions.md", "$ rlhf config validate bad.yaml")
BAD_YAML = """\
gama: 1.5
data: {train: nothere.jsonl}
reward:
  rules:
    - {name: exact_matc}
    - {name: "no_such_module:score"}
    - {name: math_answer, kwargs: {mode: flexibel}}
    - {name: exact_match, kwargs: {lowercse: true}}
    - {name: "./my_reward.py:missing"}
"""


@_runs(MISTAKES)
def test_reward_function_mistakes(scratch):
    """Your reward function's bad.yaml (the one its errors describe, with a my_reward.py that has a
    `score`): every error as the page shows it, exit code 2."""
    (scratch / "bad.yaml").write_text(BAD_YAML)
    (scratch / "my_reward.py").write_text("def score(prompt, response, label, metadata, **kwargs):\n    return 0.0\n")
    run_console(block(*MISTAKES), scratch, _env(), rcs=[2], subst={"/home/me/run": str(scratch)})


RAISES = ("docs/reward-functions.md", "$ rlhf train --local -c my-run.yaml")
# rewards.py and helper.py laid out as the page's traceback shows them (boom's return on line 15)
REWARDS_PY = "\n".join(
    ['"""Rewards of my run."""', *[""] * 9, "import helper", "", "", "def boom(prompt, response, label, metadata):"]
    + ["    return helper.divide(1, 0)", ""]
)


@_runs(RAISES)
def test_reward_function_that_raises(scratch):
    """Your reward function's "When it raises": the run stops at the first call with the function's
    own traceback (the page's /home/me/run is the directory it ran in), exit code 1."""
    (scratch / "rewards.py").write_text(REWARDS_PY)
    assert REWARDS_PY.splitlines()[14].strip() == "return helper.divide(1, 0)"
    (scratch / "helper.py").write_text("def divide(a, b):\n    return a / b\n")
    (scratch / "my-run.yaml").write_text("base: tiny-cpu\nreward: {rules: [{name: rewards.py:boom}]}\n")
    run_console(block(*RAISES), scratch, _env(), rcs=[1], subst={"/home/me/run": str(scratch)})


GYM_YAML = ("docs/environments.md", "# gym.yaml")
GYM_RUN = ("docs/environments.md", "$ rlhf train --local -c gym.yaml")
GYM_MISTAKES = ("docs/environments.md", "$ rlhf config validate bad-gym.yaml")


@_runs(GYM_RUN)
def test_reasoning_gym(scratch):
    """Environments' reasoning-gym run: gym.yaml as the page shows it, 2 iterations of `train --local`
    on a reasoning-gym task with its own scorer, then `rlhf eval` of its final policy; both print
    what the page shows (the numbers aside)."""
    pytest.importorskip("reasoning_gym")
    (scratch / "gym.yaml").write_text(block(*GYM_YAML).text)
    run_console(block(*GYM_RUN), scratch, _env(), rcs=[0, 0])
    assert (scratch / "runs" / "gym" / "eval" / "model.jsonl").is_file()


@_runs(GYM_MISTAKES)
def test_reasoning_gym_mistakes(scratch):
    """Environments' bad-gym.yaml, as its prose says: both errors as shown, exit code 2."""
    pytest.importorskip("reasoning_gym")
    (scratch / "bad-gym.yaml").write_text(
        'base: tiny-cpu\ndata: {train: "reasoning-gym:spell_backwards", eval: "reasoning-gym:leg_counting?legs=3"}\n'
    )
    assert '`data: {train: "reasoning-gym:spell_backwards", eval: "reasoning-gym:leg_counting?legs=3"}`' in (
        (ROOT / "docs" / "environments.md").read_text()
    )
    run_console(block(*GYM_MISTAKES), scratch, _env(), rcs=[2])


SELF_DISTILL = ("docs/distillation.md", "$ rlhf train --local -c configs/tiny-cpu.yaml --run-dir")


@_runs(SELF_DISTILL)
def test_self_distill(scratch):
    """Distillation's tiny run: two iterations of self-distillation with a hint, then its metrics,
    as the page shows them (the numbers aside)."""
    run_console(block(*SELF_DISTILL), scratch, _env(), rcs=[0, 0])


OPENENV_SERVE = ("docs/environments.md", "python examples/openenv_reverse_env.py --port 8011")
OPENENV_YAML = ("docs/environments.md", "# openenv.yaml")
OPENENV_RUN = ("docs/environments.md", "$ rlhf train --local -c openenv.yaml")


@_runs(OPENENV_SERVE, OPENENV_RUN)
def test_openenv(scratch):
    """Environments' OpenEnv run: the example's server started as written (in the background, on a
    free port instead of 8011, also in openenv.yaml), then 2 iterations of `train --local` whose
    samples are its episodes; it prints what the page shows (the numbers aside)."""
    pytest.importorskip("openenv.core")
    port = str(_free_port())
    (scratch / "openenv.yaml").write_text(block(*OPENENV_YAML).text.replace("8011", port))
    serve = block(*OPENENV_SERVE).text.replace("8011", port).strip().removesuffix("&")
    proc = subprocess.Popen(
        ["bash", "-c", f"exec {serve}"], cwd=scratch, env=_env(), stdout=subprocess.DEVNULL, start_new_session=True
    )
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, f"{OPENENV_SERVE[0]}: the OpenEnv server stopped"
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", int(port)), timeout=1):
                break
            assert time.monotonic() < deadline, f"{OPENENV_SERVE[0]}: the OpenEnv server never listened"
            time.sleep(0.1)
        run_console(block(*OPENENV_RUN), scratch, _env(), rcs=[0])
        rows = (scratch / "runs" / "openenv" / "metrics.jsonl").read_text().splitlines()
        assert len(rows) == 3 and '"rollout/samples": 32' in rows[-1]
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)


VF_SOURCE = ("docs/environments.md", "# vf_reverse.py")
VF_YAML = ("docs/environments.md", "# vf.yaml")
VF_RUN = ("docs/environments.md", "$ rlhf train --local -c vf.yaml")


@_runs(VF_RUN)
def test_verifiers(scratch):
    """Environments' verifiers run: vf_reverse.py and vf.yaml as the page shows them, 2 iterations
    of `train --local` on the environment's dataset; it prints what the page shows (the numbers
    aside), and the rubric's reward functions are in metrics.jsonl."""
    pytest.importorskip("verifiers")
    (scratch / "vf_reverse.py").write_text(block(*VF_SOURCE).text)
    (scratch / "vf.yaml").write_text(block(*VF_YAML).text)
    run_console(block(*VF_RUN), scratch, _env(), rcs=[0])
    last = yaml.safe_load((scratch / "runs" / "vf" / "metrics.jsonl").read_text().splitlines()[-1])
    assert {"reward/exact", "reward/in_place", "reward/agent", "eval/exact", "eval/in_place"} <= set(last)
