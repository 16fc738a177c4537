"""Hugging Face transformers export and import (docs/export-and-evals.md).

* convert.py - `make export` (a checkpoint of either engine -> an HF directory) and `make import-hf`;
  the tensor mapping itself is model/hf_mapping.py.
"""
