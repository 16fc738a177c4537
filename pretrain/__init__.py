"""pretrain: the training runtime. One folder per chapter of docs/ (docs/architecture.md):

* config/ - the ground floor: every section, every compose-time rule, derived values.
* data/ - datasets, data mix, FIM, packing, the run's tokenizer (docs/training.md).
* engines/ - the `Engine` contract and its megatron-core and DeepSpeed implementations.
* model/ - the network both engines build, its inventory and its HF mapping.
* optim/ - optimizers by name. schedules.py - LR schedules and batch ramps.
* checkpoint/ - the checkpoint store, integrity digests, meta.json, `make ckpt-info` (docs/checkpoints.md).
* stability/ - spike guard, rollback, preemption, watchdog, run lifetime, fault drills (docs/stability.md).
* observability/ - metrics, trackers, stragglers, in-loop evals, provenance, reports (docs/observability.md).
* hf/ - export to and import from Hugging Face. plan/ - `make plan`. scaling/ - `make ladder`.
* train.py - the entry point; loop.py - the training loop; bench_train.py - `make bench-train`.
"""
