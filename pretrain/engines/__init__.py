"""Engines: what trains the model (docs/training.md).

* registry.py - engines by name (`parallel.engine`), `register_engine`, `create_engine`.
* base.py - the `Engine` contract the loop calls and the `Objective` contract an engine runs (what it trains,
  pretrain/objectives/); common.py - process group, RNG, weight-decay rule, which both engines share.
* cpu_compat.py, cpu_compat_moe.py, cpu_compat_jit.py - megatron-core's CPU adaptations (both engines run its
  models), applied only when CUDA is absent (cpu_compat_jit.py as megatron-core is imported: the entry points
  install it); deferred_imports.py - megatron-core's and DeepSpeed's optional wandb and mlflow run at first use
  (the same entry points install it, with or without CUDA).
* megatron/ - megatron-core (TP/PP/SP/CP/EP, distributed optimizer, FSDP2, dist checkpointing).
* deepspeed/ - DeepSpeed ZeRO-1/2/3 with offload.
"""
