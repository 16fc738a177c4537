"""Checkpoints (docs/checkpoints.md).

* store.py - the store: atomic saves, retention, the agreed resume scan.
* integrity.py - per-file sizes and digests, hashed and verified by the ranks that wrote them.
* meta.py - `LoopState` and meta.json, written in one place.
* info.py - `make ckpt-info`.
"""
