"""Shared base of pretrain/, preprocessing/ and launch/: config helpers, command-line handling,
file digests, SLURM value checks and registries. It imports none of those packages.

Layering: launch -> pretrain, preprocessing -> common (pretrain may also read preprocessing's
data formats); nothing here imports upward.
"""
