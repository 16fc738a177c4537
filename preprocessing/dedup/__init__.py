"""Stage 2: exact + MinHash near-duplicate removal (docs/dedup.md).

* run.py - the five steps (signatures, buckets, verify, clusters, write) and `python -m preprocessing.dedup`.
* minhash.py, signatures.py, buckets.py, verify.py, clusters.py, components.py, shards.py, similarity.py -
  the steps' parts.
"""
