"""What defines the network, in one place: used by both engines, the planner and the HF export.

* gpt.py - JobConfig -> megatron-core TransformerConfig, layer spec and GPTModel (GPT-2/3 and
  Llama layouts are the same GPTModel with other choices of norm, activation, positions, bias).
* init.py - layout-invariant initialisation (the same weights under any TP/PP/DP).
* inventory.py - the per-tensor parameter inventory (shapes, TP split) the planner counts;
  tests/test_plan.py checks it against the built model.
* hf_mapping.py - megatron-core names and layouts <-> Hugging Face GPT-2 / Llama.
* third_party_warnings.py - silences known third-party warnings; imported before megatron-core.
"""
