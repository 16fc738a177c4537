"""Pretraining objectives beyond next-token prediction: BERT's masked LM and T5/BART denoising (docs/objectives.md)."""
