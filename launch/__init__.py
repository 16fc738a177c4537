"""Launching runs: local torchrun here; SLURM rendering and submission (issue #7)."""
