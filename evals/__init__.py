"""Offline evaluation, above the training runtime (docs/export-and-evals.md).

* tasks.py - `make eval-data`: BIG-bench multiple-choice tasks and held-out perplexity as lm-eval tasks.
* harness.py - `make eval`: lm-eval-harness on a run's HF export. compare.py - `make compare`.
In-loop evals on the live model are pretrain/observability/downstream.py.
"""
