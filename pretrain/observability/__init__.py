"""What a run shows (docs/observability.md).

* metrics.py - per-step metrics: console, metrics.jsonl, events.jsonl, trackers.
* trackers/ - TensorBoard, W&B, MLflow by name.
* straggler.py - slow-rank detection; downstream.py - in-loop downstream evals on the live model.
* hooks.py - the loop's observers (watchdog, straggler, profiler) behind one interface.
* provenance.py - versions and environment; banner.py - the start-of-run banner.
* report.py, report_plot.py - `make report`.
"""
