"""Optimizers by name (`optim.name`), docs/training.md.

* registry.py - `OptimizerSpec`, `OPTIMIZERS`, `register_optimizer`.
* adamw.py, lion.py, adafactor.py - one optimizer each, registered by name.
"""
