"""The megatron-core engine.

* engine.py - `MegatronEngine`: model, optimizer, steps, evaluation; checkpointing.py - dist checkpointing.
* optimizers.py - registered optimizers inside megatron-core's wrapper; optimizer_state.py - its state on save/load.
* moe_stats.py - router losses and expert load per step.
* cpu_compat.py, cpu_compat_moe.py - the CPU adaptations, applied only when CUDA is absent.
"""
