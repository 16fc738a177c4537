"""Training data at run time (docs/training.md): what the loop reads, step by step.

* datasets.py - Megatron indexed datasets from the blend, `BatchSource` and its fixed-mix source.
* mix.py - data-mix phases (weights that change with consumed tokens).
* fim.py - fill-in-the-middle; packing.py - document masks and packed micro-batches.
* tokenizer.py - the run's tokenizer, loaded one way for FIM, export and evals.
"""
