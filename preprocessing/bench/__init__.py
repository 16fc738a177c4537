"""`make bench-preprocess` (docs/bench-preprocess.md): benchmarks and the planted corpus, apart from the stages.

* __main__.py - the command; tokenization.py - tokenization vs encode_batch_fast.
* dedup.py - dedup per step; dedup_baseline.py - the datasketch baseline; planted.py - the planted
  near-duplicate corpus and the quality table.
"""
