"""The megatron-core engine.

* engine.py - `MegatronEngine`: wrapping, optimizer, steps, evaluation; checkpointing.py - dist checkpointing.
* optimizers.py - registered optimizers inside megatron-core's wrapper; optimizer_state.py - its state on save/load.
* moe_stats.py - router losses and expert load per step; fsdp2.py - torch FSDP2 instead of DDP.
"""
