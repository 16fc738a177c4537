"""The megatron-core engine (see engine.py)."""
