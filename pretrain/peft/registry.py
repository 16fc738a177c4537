"""PEFT methods by name (`peft.method`). Each registers lazily ("module:class"): validating a recipe
imports no megatron-core. A method defined elsewhere registers the same way once its module is imported
(`imports:` in the recipe)."""
from __future__ import annotations

from common.registry import Registry

PEFT_METHODS: Registry = Registry("PEFT method", "peft.method")
PEFT_METHODS.register("lora", "pretrain.peft.lora:LoRA")
PEFT_METHODS.register("adapter", "pretrain.peft.adapter:BottleneckAdapters")
PEFT_METHODS.register("ptuning", "pretrain.peft.ptuning:PTuning")
