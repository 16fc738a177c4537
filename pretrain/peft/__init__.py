"""Parameter-efficient training on a frozen base (docs/peft.md): base.py (the `PeftMethod` contract, naming
and freezing), registry.py (methods by `peft.method`), lora.py, adapter.py, ptuning.py (one method each),
checkpoint.py (adapter-only checkpoints over the frozen base)."""
