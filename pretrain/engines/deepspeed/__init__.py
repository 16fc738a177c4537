"""The DeepSpeed engine. Importing this package does not import deepspeed: ds_config.py is used at
compose time on machines that only validate recipes.

* engine.py - `DeepSpeedEngine`; ds_config.py - ds_configs/ templates rendered from the recipe.
* checkpointing.py - saves and loads; universal.py - universal checkpoints; consolidate.py - whole fp32 weights.
* cpu_compat.py - the CPU adaptations, applied only when CUDA is absent.
"""
