"""The data pipeline, on CPU nodes (docs/preprocessing.md): raw text -> Megatron indexed datasets.

* pipeline.py - the config's stages in order, here; stages.py - stages by name; config.py - the typed config
  (conf/ holds its YAML); cli.py - flags and overrides shared by every stage.
* records.py - reading documents (JSONL, parquet, text), counting what cannot be used; fetch.py - `make data`.
* normalize.py (1: normalisation, exact dedup), dedup/ (2: MinHash near-duplicates), filters.py (3: quality),
  tokenizer_io.py (4: tokenizers), tokenize_indexed.py + indexed_io.py (5: .bin/.idx), blend.py (6: the data mix).
* markers.py - resumable stage markers and summaries. bench/ - `make bench-preprocess`, apart from the stages.
"""
