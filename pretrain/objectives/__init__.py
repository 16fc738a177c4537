"""What a run trains (docs/objectives.md): objectives implement `Objective` (pretrain/engines/base.py).

* registry.py - objectives by name (`objective.name`); task.py - the run's objective, adapters and FLOPs, built once.
* causal.py - next-token prediction on GPTModel; masked_lm.py - BERT; denoising.py - T5 / BART.
* adapters.py - a PEFT method on an objective's model, a distillation teacher around its forward.
* losses.py - the token-mean loss, z-loss and the context-parallel loss.
* samples.py, noise.py, corpus.py, index_cache.py - the encoder objectives' samples.
"""
