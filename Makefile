# precision-bench. Every target sets up its own virtual environment when it is missing.
# CPU installs pin torch (TORCH=2.13.0); on a CUDA machine PyPI's build of the same pin is the CUDA one.
PYTHON  ?= python3
VENV    ?= .venv
TORCH   ?= 2.13.0
RESULTS ?= results/runs
# Tables go to an ignored directory: `make sweep` never rewrites committed files (`make default-tables` does).
TABLES  ?= results/local/tables
# Where `make committed-tables` commits a folder: results/tables/<experiment>, or a device's subfolder (results/tables/h100).
COMMITTED ?= results/tables
SEEDS   ?= 0,1,2
FORMATS ?= fp32,tf32,fp16,bf16,fp8
SCALINGS ?= none,static,dynamic,per_tensor,unit
EXPERIMENT ?=
ARGS    ?=
LAUNCHER ?= parallel
PY      := $(VENV)/bin/python
# PY given on the command line would have every target install into it (setup's pip, as root, into a system Python)
ifeq ($(origin PY),command line)
$(error PY is the environment's own interpreter ($$(VENV)/bin/python), not a setting: choose VENV=<dir> (the virtual environment) or PYTHON=<interpreter> (the one that creates it))
endif
STAMP   := $(VENV)/.installed-torch-$(TORCH)

.PHONY: help setup test test-slow test-xla test-cluster sweep tables compare committed-tables default-tables raschka-memory bench predict speed-validation gpu-report dashboard prepare sync chaos doctor clean
.DEFAULT_GOAL := help

help: ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-18s %s\n", $$1, $$2}'
	@echo "  variables: PYTHON=$(PYTHON) VENV=$(VENV) (the interpreter that makes the environment, and its directory)"
	@echo "             TORCH=$(TORCH) RESULTS=$(RESULTS) TABLES=$(TABLES) SEEDS=$(SEEDS) FORMATS=$(FORMATS)"
	@echo "             SCALINGS=$(SCALINGS) EXPERIMENT=$(EXPERIMENT) (a conf/experiment/ preset: smoke,"
	@echo "             raschka_distilbert_imdb, unit_scaling_squad, mindspore_lenet, nanogpt_shakespeare_char_cpu,"
	@echo "             unit_scaling_charlm, unit_scaling_charlm_lr, umup_lr_transfer, umup_fp8, block_formats,"
	@echo "             nvfp4_recipe, nvfp4_recipe_2000, unit_scaling_bert, accumulation, optimizer_precision,"
	@echo "             optimizer_precision_bert, distributed_precision)  ARGS (more overrides for the sweep, e.g."
	@echo "             ARGS='model.data.source=local model.data.path=/path/to/input.txt')"
	@echo "             COMMITTED=$(COMMITTED) (make committed-tables: results/tables/h100 for an H100's folder)"
	@echo "             LAUNCHER=$(LAUNCHER)  ONLY (make bench: some sections, e.g. ONLY=native,host_syncs)"
	@echo "             AS_CPU (make bench: this CPU as a proxy for one with less: avx2, avx512-no-bf16)"
	@echo "             ENTITY, PROJECT (make dashboard: the W&B entity and project; WANDB_API_KEY to create)"

setup: $(STAMP) ## create .venv and install the package and its test tools (torch pinned to TORCH; torchao)

# dev holds torchao (native FP8 on a GPU, and its emulate=True path the tests run on any machine)
EXTRAS  ?= dev

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check torch==$(TORCH)
	$(PY) -m pip install --quiet --disable-pip-version-check -e '.[$(EXTRAS)]'
	touch $@

# pytest-xdist: TEST_WORKERS processes, each test file on one of them (its module fixtures built once); most tests
# wait on a subprocess or on Python, so two workers on two cores take about 60% of one worker's time
TEST_WORKERS ?= 2

test: setup ## lint (ruff: unused names, undefined names, import order), then the fast offline test suite (slow tests excluded; TEST_WORKERS=2 processes)
	$(PY) -m ruff check bench tests hydra_plugins
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile

test-slow: setup ## only the slow end-to-end tests (TEST_WORKERS=2 processes)
	$(PY) -m pytest -m slow -n $(TEST_WORKERS) --dist loadfile

# make test-xla: torch_xla needs its own torch (XLA_TORCH), so it lives in its own environment; torchao, which
# needs a newer torch, is left out there (the tests that need it skip).
XLA_VENV  ?= .venv-xla
XLA_TORCH ?= 2.9.0
XLA_STAMP := $(XLA_VENV)/.installed-torch-xla-$(XLA_TORCH)

$(XLA_STAMP): pyproject.toml
	test -x $(XLA_VENV)/bin/python || $(PYTHON) -m venv $(XLA_VENV)
	echo "torch==$(XLA_TORCH)" > $(XLA_VENV)/constraints.txt
	$(XLA_VENV)/bin/pip install --quiet --disable-pip-version-check torch==$(XLA_TORCH) torch-xla==$(XLA_TORCH)
	$(XLA_VENV)/bin/pip install --quiet --disable-pip-version-check -c $(XLA_VENV)/constraints.txt -e . 'pytest>=8'
	touch $@

test-xla: $(XLA_STAMP) ## the XLA path on torch_xla's CPU device (PJRT_DEVICE=CPU), in its own environment: pytest -m xla
	PJRT_DEVICE=CPU $(XLA_VENV)/bin/python -m pytest -m xla tests/xla

test-cluster: setup ## the SLURM path against a real single-node SLURM (set up here first if none answers; needs root)
	tests/cluster/slurm_up.sh
	$(PY) -m pytest -m cluster tests/cluster

sweep: setup ## LeNet x FORMATS x SCALINGS on the digits (or EXPERIMENT=<preset>; LAUNCHER=parallel|local|submitit_local|slurm)
ifeq ($(EXPERIMENT),)
	$(PY) -m bench.run -m hydra/launcher=$(LAUNCHER) model=lenet format=$(FORMATS) scaling=$(SCALINGS) seed=$(SEEDS) \
		results_dir=$(RESULTS) $(ARGS)
else
	$(PY) -m bench.run -m hydra/launcher=$(LAUNCHER) experiment=$(EXPERIMENT) results_dir=$(RESULTS) $(ARGS)
endif
	$(PY) -m bench.aggregate $(RESULTS) --out $(TABLES)
ifeq ($(EXPERIMENT),)
	-$(PY) -m bench.compare $(RESULTS) --against results/tables/default
endif

tables: setup ## regenerate every committed table folder from its records, and their index (results/tables/README.md); with RESULTS=<dir>: your records into TABLES
ifneq ($(filter command line environment,$(origin RESULTS)),)
	$(PY) -m bench.aggregate $(RESULTS) --out $(TABLES)
else
	$(PY) -m bench.reporting.committed
endif

compare: setup ## your cells under RESULTS beside a committed folder (AGAINST, default results/tables/default): within or outside its intervals
	$(PY) -m bench.compare $(RESULTS) --against $(or $(AGAINST),results/tables/default)

committed-tables: setup ## sweep EXPERIMENT (or the default sweep) afresh and commit its tables with their records (COMMITTED/<experiment>/)
	rm -rf results/runs/committed/$(or $(EXPERIMENT),default)
	$(MAKE) --no-print-directory sweep RESULTS=results/runs/committed
	$(PY) -m bench.aggregate results/runs/committed --experiment $(or $(EXPERIMENT),default) --out $(COMMITTED) --keep-records
	$(PY) -m bench.reporting.committed --index-only

default-tables: committed-tables ## the same as committed-tables without EXPERIMENT (the name before 0.2.0)

raschka-memory: setup ## Raschka's DistilBERT memory (A100) beside the modelled step on this CPU (results/tables/raschka_memory)
	$(PY) -m bench.tools.raschka_memory --out results/tables/raschka_memory

bench: setup ## measure harness overhead, emulation cost, native speed (on CUDA), aggregation; JSON to results/bench/
	$(PY) -m pip install --quiet --disable-pip-version-check -e '.[bench]'
	$(PY) -m bench.tools.benchmark --out results/bench $(if $(ONLY),--only $(ONLY)) $(if $(AS_CPU),--as-cpu $(AS_CPU))

predict: setup ## the speed model's step time, speed-ups and memory for cells not trained, on GPU profiles (ARGS='model=bert_base format=fp8 scaling=per_tensor gpu=H100,B200': its speed-ups over FP32 and BF16 beside it)
	$(PY) -m bench.predict $(ARGS)

speed-validation: setup ## fit the speed model's constants on its fit rows, validate on every other GPU figure we have (results/bench/speed_model_validation.md)
	$(PY) -m bench.tools.speed_validation

gpu-report: setup ## on a CUDA machine, the GPU checks in one command (~9 min): GEMM outputs for the tensor-core replay, the GEMM curve, native rows eager and compiled, a compiled Raschka-shape run; elsewhere prints the plan
	$(PY) -m pip install --quiet --disable-pip-version-check -e '.[bench]'
	$(PY) -m bench.tools.gpu_report

dashboard: setup ## W&B workspace + report for EXPERIMENT (default: default); specs to results/local/dashboards/ offline
	$(PY) -m bench.reporting.dashboard $(or $(EXPERIMENT),default) --results $(RESULTS) --tables $(TABLES) --tables results/tables \
		$(if $(ENTITY),--entity $(ENTITY)) $(if $(PROJECT),--project $(PROJECT))

prepare: setup ## download and cache the hub models and datasets once (needs internet; see README)
	$(PY) -m bench.tools.prepare

sync: setup ## upload the offline W&B runs under RESULTS (needs WANDB_API_KEY)
	find $(RESULTS) -type d -name 'offline-run-*' -exec $(VENV)/bin/wandb sync {} +

chaos: setup ## kill, crash, diverge and corrupt cells of a small sweep; re-run until complete; check the records
	$(PY) -m bench.tools.chaos

doctor: setup ## self-test of this node: device, one step per native path, W&B, HF cache, SLURM (< 2 min)
	$(PY) -m bench.tools.doctor

clean: ## remove the virtual environments and caches (records are kept)
	rm -rf $(VENV) $(XLA_VENV) .pytest_cache
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
