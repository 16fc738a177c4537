"""Engines: what trains the model (docs/training.md).

* registry.py - engines by name (`parallel.engine`), `register_engine`, `create_engine`.
* base.py - the `Engine` contract the loop calls; common.py - pieces both engines share.
* megatron/ - megatron-core (TP/PP/SP/CP/EP, distributed optimizer, dist checkpointing).
* deepspeed/ - DeepSpeed ZeRO-1/2/3 with offload.
"""
