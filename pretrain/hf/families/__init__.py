"""The HF exporter families: each module registers its `Exporter`s (pretrain/hf/exporters.py) on import."""
