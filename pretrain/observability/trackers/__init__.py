"""Experiment trackers by name (`logging.trackers`), docs/observability.md.

* registry.py - `TRACKERS`, `register_tracker`, `active_trackers`.
* base.py - the `Tracker` contract; fanout.py - the logging rank's fan-out to every active tracker.
* tensorboard.py, wandb.py, mlflow.py - one tracker each, registered by name.
"""
