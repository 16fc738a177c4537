"""Hugging Face transformers export and import (mapping.py: the tensors; convert.py: the files)."""
