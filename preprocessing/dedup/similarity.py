"""True similarity of two documents' shingle sets, and the rule that accepts a candidate pair.

The LSH only proposes pairs; whether a pair is a near-duplicate is decided here, on the exact
shingle sets (sorted unique uint32 hashes, `minhash.shingle_hashes`), never on the estimate:

* `jaccard` |A & B| / |A | B| >= `dedup.threshold`: edited copies (3-10% of the words replaced),
  dropped leading words, and truncations to >= threshold of the length;
* `containment` |A & B| / min(|A|, |B|) >= `dedup.containment_threshold` when the smaller set has
  at least `dedup.min_length_ratio` of the larger's shingles: a truncated copy that was also edited.
  The ratio guard is what keeps a short document (a licence notice plus a line, a bare stage
  direction) from being "contained" in every long document that carries the same boilerplate:
  those sit at containment 0.8-0.9 with length ratios <= 0.36 on the planted corpus, truncations
  to 70-90% at ratio >= 0.69 (docs/dedup.md).
"""
from __future__ import annotations

from typing import Optional, Tuple

import numpy as np


def intersection_size(a: np.ndarray, b: np.ndarray) -> int:
    """|a & b| of two sorted unique arrays: binary search of the smaller in the larger."""
    if len(a) > len(b):
        a, b = b, a
    if len(a) == 0:
        return 0
    pos = np.searchsorted(b, a)
    pos[pos == len(b)] = 0
    return int(np.count_nonzero(b[pos] == a))


def true_similarity(a: np.ndarray, b: np.ndarray) -> Tuple[float, float]:
    """(Jaccard, containment of the smaller set in the larger) of two sorted unique hash arrays."""
    inter = intersection_size(a, b)
    union = len(a) + len(b) - inter
    smaller = min(len(a), len(b))
    return (inter / union if union else 1.0), (inter / smaller if smaller else 1.0)


def accept(jaccard: float, containment: float, n_a: int, n_b: int, cfg) -> Optional[str]:
    """"jaccard" or "containment" when the pair is a near-duplicate under `cfg` (DedupConfig), else None.

    n_a, n_b: the two shingle-set sizes (for the length-ratio guard of containment)."""
    if jaccard >= cfg.threshold:
        return "jaccard"
    larger = max(n_a, n_b)
    if containment >= cfg.containment_threshold and larger and min(n_a, n_b) / larger >= cfg.min_length_ratio:
        return "containment"
    return None
