# precision-bench. Every target sets up its own virtual environment when it is missing.
# CPU installs pin torch (TORCH=2.13.0); on a CUDA machine PyPI's build of the same pin is the CUDA one.
PYTHON  ?= python3
VENV    ?= .venv
TORCH   ?= 2.13.0
RESULTS ?= results/runs
TABLES  ?= results/tables
FORMATS ?= fp32,tf32,fp16,bf16,fp8
SCALINGS ?= none,static,dynamic,per_tensor,unit
EXPERIMENT ?=
PY      := $(VENV)/bin/python
STAMP   := $(VENV)/.installed-torch-$(TORCH)

.PHONY: help setup test test-slow sweep tables prepare clean
.DEFAULT_GOAL := help

help: ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-10s %s\n", $$1, $$2}'
	@echo "  variables: TORCH=$(TORCH) RESULTS=$(RESULTS) TABLES=$(TABLES) FORMATS=$(FORMATS)"
	@echo "             SCALINGS=$(SCALINGS) EXPERIMENT=$(EXPERIMENT) (a conf/experiment/ preset: smoke,"
	@echo "             raschka_distilbert_imdb, unit_scaling_squad, mindspore_lenet)"

setup: $(STAMP) ## create .venv and install the package (torch pinned to TORCH)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check torch==$(TORCH)
	$(PY) -m pip install --quiet --disable-pip-version-check -e '.[dev]'
	touch $@

test: setup ## the fast offline test suite (slow tests excluded)
	$(PY) -m pytest

test-slow: setup ## only the slow end-to-end tests
	$(PY) -m pytest -m slow

sweep: setup ## LeNet x FORMATS x SCALINGS on the offline digits (or EXPERIMENT=<preset>), then the tables
ifeq ($(EXPERIMENT),)
	$(PY) -m bench.run -m model=lenet format=$(FORMATS) scaling=$(SCALINGS) seed=0 results_dir=$(RESULTS)
else
	$(PY) -m bench.run -m experiment=$(EXPERIMENT) results_dir=$(RESULTS)
endif
	$(MAKE) --no-print-directory tables

tables: setup ## Markdown + CSV tables from the records under RESULTS
	$(PY) -m bench.aggregate $(RESULTS) --out $(TABLES)

prepare: setup ## download and cache the hub models and datasets once (needs internet; see README)
	$(PY) -m bench.prepare

clean: ## remove the virtual environment and caches (records are kept)
	rm -rf $(VENV) .pytest_cache
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
