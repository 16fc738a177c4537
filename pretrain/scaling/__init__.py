"""Scaling-law ladder: train model sizes x token budgets through `make ablate`, fit L(N, D) (Hoffmann et al.
2022), report compute-optimal N and D. `make ladder`; docs/ladder.md.

* __main__.py - the command; ladder.py - the rungs and their runs; fit.py - the fit and bootstrap;
  report.py - table and plot.
"""
