"""The DeepSpeed engine (see engine.py). Importing this package does not import deepspeed:
ds_config.py is used at compose time on machines that only validate recipes."""
