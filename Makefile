# Two commands on a fresh machine:  `make train` (main job)  and  `make test` (test suite).
# Both set up .venv first. The venv sees the system's packages, so a GPU machine keeps the CUDA
# torch it already has; a machine with no torch gets the CPU build pinned below (on this
# workplace's machines it is a wheel already on disk; elsewhere point pip at a CPU index with
# PIP_EXTRA_INDEX_URL). Nothing here pulls CUDA wheels onto a CPU machine.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
TORCH_CPU ?= torch==2.13.0
PYTEST_ARGS ?=

.PHONY: setup train test bench-quant clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv --system-site-packages $(VENV)
	@if $(BIN)/python -c "import torch" 2>/dev/null; then \
		echo "setup: keeping the installed torch $$($(BIN)/python -c 'import torch; print(torch.__version__)')"; \
	else \
		echo "setup: no torch found, installing the CPU build $(TORCH_CPU)"; \
		$(BIN)/python -m pip install -q "$(TORCH_CPU)"; \
	fi
	$(BIN)/python -m pip install -q -e ".[dev]"
	@touch $@

# Main job: MoE pretraining (README "Training"). On a CPU the tiny model trains 150 steps (~80 s on
# 2 cores); on a GPU the small model. Hydra overrides go in ARGS, e.g.
# `make train ARGS="recipe=bf16 train.steps=50"`. Outputs: outputs/runs/<model>-<recipe>/
# (checkpoints, metrics.jsonl, wandb offline run); running it again resumes from the latest
# checkpoint there (and stops at once if that run already reached train.steps).
ARGS ?=
train: setup
	$(BIN)/python -m moefp8.train $(ARGS)

# On a machine without a GPU (CI: 2 cores) the tests run in two pytest-xdist workers, a test file each
# (~21 min instead of ~27-31); with a GPU one at a time (the GPU tests share the cards).
test: setup
	$(BIN)/python -m pytest -q $$($(BIN)/python -c "import torch; print('' if torch.cuda.is_available() else '-n 2 --dist loadfile')") $(PYTEST_ARGS)

bench-quant: setup
	$(BIN)/python tools/bench_quant.py

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache
