"""Evaluation beside training: run comparisons (compare.py); lm-eval-harness tasks are issue #9's next part."""
