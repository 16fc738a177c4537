"""Scaling-law ladder: train model sizes x token budgets through `make ablate`, fit L(N, D) (Hoffmann et al. 2022),
report compute-optimal N and D. `make ladder`; docs/ladder.md."""
