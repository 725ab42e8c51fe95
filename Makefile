# Two commands on a fresh machine:  `make run`  (the main job on the tiny CPU default)
#                                   `make test` (every test)
PYTHON ?= python3
VENV   ?= .venv
BIN     = $(VENV)/bin
TORCH  ?= torch==2.13.0
RUN_DIR ?= runs/tiny-cpu
MODEL_DIR ?= runs/tiny-model
CONFIG ?= configs/tiny-cpu.yaml

.PHONY: venv run run-local test bench model clean

$(BIN)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet "$(TORCH)"
	$(BIN)/pip install --quiet -e ".[dev]"
	touch $@

venv: $(BIN)/.installed

$(MODEL_DIR)/config.json: | $(BIN)/.installed
	$(BIN)/rlhf init-model --out $(MODEL_DIR)

model: $(MODEL_DIR)/config.json

# the main job: PPO on the tiny default, every service its own process on localhost (embedded Redis)
run: $(BIN)/.installed $(MODEL_DIR)/config.json
	$(BIN)/rlhf up -c $(CONFIG) --run-dir $(RUN_DIR)

# the same job in one process (no Redis, no gRPC): the reference the distributed run is measured against
run-local: $(BIN)/.installed $(MODEL_DIR)/config.json
	$(BIN)/rlhf train --local -c $(CONFIG) --run-dir $(RUN_DIR)-local

test: $(BIN)/.installed
	$(BIN)/python -m pytest tests

clean:
	rm -rf runs .pytest_cache

bench: $(BIN)/.installed $(MODEL_DIR)/config.json
	$(BIN)/python benchmarks/bench_services.py --model $(MODEL_DIR) --out runs/bench/services.json
	$(BIN)/python benchmarks/bench_distributed.py --model $(MODEL_DIR) --out runs/bench/distributed.json
