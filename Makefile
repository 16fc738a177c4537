# Every target takes RECIPE=<name> and OVERRIDES='key=value ...' (Hydra override syntax).
# Both reach Python through the environment, never through shell text, so values with
# spaces, quotes or $(...) are passed through unchanged and nothing in them is executed.
SHELL := /bin/bash
.DEFAULT_GOAL := help

VENV   ?= .venv
PY     := $(VENV)/bin/python
RECIPE ?= gpt-tiny
OVERRIDES ?=
JSON   ?=
# $(value ...) keeps make from expanding $(...) inside user text; exported verbatim.
override RECIPE    := $(value RECIPE)
override OVERRIDES := $(value OVERRIDES)
export RECIPE OVERRIDES JSON

STAMP := $(VENV)/.installed

help:  ## list targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-18s %s\n", $$1, $$2}'

$(STAMP): pyproject.toml constraints.txt
	@test -x $(PY) || python3 -m venv $(VENV)
	@echo ">> installing torch==2.13.0 first (CPU wheel), then the pinned rest"
	$(PY) -m pip install -q --disable-pip-version-check torch==2.13.0
	$(PY) -m pip install -q --disable-pip-version-check -c constraints.txt -e '.[dev]' \
	    --config-settings editable_mode=compat
	@touch $@

setup: $(STAMP)  ## create .venv with pinned deps (idempotent)

test: $(STAMP)  ## run the test suite
	$(PY) -m pytest -q

lint: $(STAMP)  ## ruff
	$(PY) -m ruff check pretrain preprocessing evals launch tests hydra_plugins

config: $(STAMP)  ## print the resolved, validated config of RECIPE (with derived values)
	$(PY) -m pretrain.config

plan: $(STAMP)  ## cost of RECIPE: params, FLOPs, memory per GPU, time to budget (JSON=1 for JSON)
	$(PY) -m pretrain.plan

pretrain: $(STAMP)  ## train RECIPE (engine lands with the runtime issue)
	$(PY) -m pretrain.train

clean:  ## remove runs/ and outputs (keeps data/ and .venv)
	rm -rf runs outputs multirun

.PHONY: help setup test lint config plan pretrain clean
