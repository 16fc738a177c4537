"""Shingle hashes and datasketch-compatible MinHash signatures, vectorised with numpy.

A shingle is a word n-gram (word = regex `\\w+`, lowercased by default); a document shorter
than n words is one shingle of all its words. Words are found and hashed for a whole batch of
documents in a few numpy passes over their bytes (`words_batch`: a byte polynomial per word,
stable across processes and machines, unlike Python's `hash()`); the n word hashes of a
window are combined polynomially in uint64 and mixed down to 32 bits (splitmix64 finaliser).
No Python code runs per word or per n-gram.

Signatures reproduce datasketch's `MinHash(num_perm, seed)` (scheme "affine32", datasketch
>= 2.0) fed with these 32-bit values through `hashfunc=int`: the value is pre-mixed with the
MurmurHash3 32-bit finaliser, then permutation k maps h -> a_k * h + b_k mod 2^32, and the
signature is the minimum per permutation. tests/test_dedup.py checks the equality.
"""
from __future__ import annotations

import re
from typing import List, Sequence, Tuple

import numpy as np

_WORD = re.compile(r"\w+", re.UNICODE)
_U64 = np.uint64
_P = _U64(0x100000001B3)                    # odd: invertible mod 2^64 (byte polynomial of a word)
_P_INV = _U64(pow(0x100000001B3, -1, 1 << 64))
_POLY = _U64(0x9E3779B97F4A7C15)            # odd multiplier of the window polynomial
_EMPTY = _U64(0x2545F4914F6CDD1D)           # the one shingle of a document without words
# A word byte: re's \w on ASCII ([0-9A-Za-z_]), or any byte of a multi-byte UTF-8 character (only
# non-ASCII texts have those, and there the buffer holds just the regex's words, space-separated).
_WORD_BYTE = np.zeros(256, dtype=bool)
_WORD_BYTE[list(b"0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ_")] = True
_WORD_BYTE[0x80:] = True
_POWERS: List[np.ndarray] = [np.ones(1, np.uint64), np.ones(1, np.uint64)]


def _mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64 finaliser: every input bit reaches the 32 bits that are kept."""
    x = x ^ (x >> _U64(30))
    x = x * _U64(0xBF58476D1CE4E5B9)
    x = x ^ (x >> _U64(27))
    x = x * _U64(0x94D049BB133111EB)
    return x ^ (x >> _U64(31))


def _powers(n: int) -> List[np.ndarray]:
    """[P^j, P^-j] mod 2^64 for j < n (grown on demand, kept for the process)."""
    if len(_POWERS[0]) < n:
        size = max(n, 2 * len(_POWERS[0]), 1 << 16)
        tables = []
        for p in (_P, _P_INV):
            a = np.full(size, p, np.uint64)
            a[0] = 1
            tables.append(np.multiply.accumulate(a))
        _POWERS[:] = tables
    return _POWERS


def _text_buffer(texts: Sequence[str], lowercase: bool) -> Tuple[np.ndarray, np.ndarray]:
    """All texts' bytes in one array, each followed by a space, and where each text starts. An ASCII text
    goes as it is (its words are the runs of word bytes); any other as its regex words joined by spaces."""
    parts: List[bytes] = []
    for text in texts:
        text = text.lower() if lowercase else text
        parts.append(text.encode("ascii") if text.isascii()
                     else " ".join(_WORD.findall(text)).encode("utf-8"))
    lens = np.fromiter(map(len, parts), np.int64, len(parts)) + 1
    starts = np.zeros(len(parts) + 1, np.int64)
    np.cumsum(lens, out=starts[1:])
    parts.append(b"")
    return np.frombuffer(b" ".join(parts), np.uint8), starts


def words_batch(texts: Sequence[str], lowercase: bool = True) -> Tuple[np.ndarray, np.ndarray]:
    """(uint64 hash of every word of all texts, in order; words per text). The hash of a word is the byte
    polynomial sum_j c_j P^(e-1-j) mod 2^64 of its UTF-8 bytes [s, e), mixed: computed for all words at
    once as (C[e] - C[s]) * P^(e-1), C the prefix sums of c_j P^-j (P odd, so P^-1 exists mod 2^64)."""
    buf, text_starts = _text_buffer(texts, lowercase)
    word = _WORD_BYTE[buf].view(np.int8)
    edge = np.diff(word, prepend=np.int8(0))
    starts = np.flatnonzero(edge == 1)
    ends = np.flatnonzero(edge == -1)             # every text ends with a space: each start has its end
    counts = np.bincount(np.searchsorted(text_starts, starts, side="right") - 1, minlength=len(texts))
    if len(starts) == 0:
        return np.zeros(0, np.uint64), counts[:len(texts)]
    pw, inv = _powers(len(buf) + 1)
    prefix = np.zeros(len(buf) + 1, np.uint64)
    with np.errstate(over="ignore"):
        np.cumsum(buf * inv[:len(buf)], out=prefix[1:])
        hashes = (prefix[ends] - prefix[starts]) * pw[ends - 1] + (ends - starts).astype(np.uint64)
    return _mix64(hashes), counts[:len(texts)]


def _windows(w: np.ndarray, n: int) -> np.ndarray:
    """Combined hash of every window of n consecutive word hashes (len(w) - n + 1 of them)."""
    acc = w[:len(w) - n + 1].copy()
    for j in range(1, n):
        acc = acc * _POLY + w[j:len(w) - n + 1 + j]
    return acc


def _to32(acc: np.ndarray) -> np.ndarray:
    return (_mix64(acc) >> _U64(32)).astype(np.uint32)


def sorted_unique(x: np.ndarray) -> np.ndarray:
    """np.unique by sort + neighbour compare (numpy 2's hash-based np.unique is ~6x slower on uint64)."""
    x = np.sort(x)
    return x[np.concatenate([[True], x[1:] != x[:-1]])] if len(x) else x


def shingle_hashes(text: str, ngram: int, lowercase: bool = True) -> np.ndarray:
    """Sorted unique uint32 hashes of the word n-grams of `text`."""
    return shingle_hashes_batch([text], ngram, lowercase)[0]


def shingle_hashes_batch(texts: Sequence[str], ngram: int, lowercase: bool = True
                         ) -> Tuple[np.ndarray, np.ndarray]:
    """`shingle_hashes` of many documents at once: (concatenated hashes, offsets of len(texts) + 1).

    One numpy pass over all words of the batch: windows that would cross a document boundary
    are dropped, short documents get their one all-words shingle, and a single sort of
    (document, hash) keys gives every document's sorted unique set."""
    if len(texts) == 0:
        return np.zeros(0, np.uint32), np.zeros(1, np.int64)
    words, lengths = words_batch(texts, lowercase)
    starts = np.zeros(len(texts) + 1, np.int64)
    np.cumsum(lengths, out=starts[1:])
    doc_of_word = np.repeat(np.arange(len(texts), dtype=np.int64), lengths)
    with np.errstate(over="ignore"):
        if len(words) >= ngram:
            acc = _windows(words, ngram)
            first = np.arange(len(acc))
            ok = doc_of_word[first] == doc_of_word[first + ngram - 1]
            keys_doc, keys_acc = doc_of_word[first[ok]], acc[ok]
        else:
            keys_doc, keys_acc = np.zeros(0, np.int64), np.zeros(0, np.uint64)
        short = np.flatnonzero(lengths < ngram)
        if len(short):   # documents of fewer than n words: one window over all their words
            short_acc = np.full(len(short), _EMPTY)
            for i in np.flatnonzero(lengths[short] > 0):
                d = short[i]
                short_acc[i] = _windows(words[starts[d]:starts[d + 1]], int(lengths[d]))[0]
            keys_doc = np.concatenate([keys_doc, short])
            keys_acc = np.concatenate([keys_acc, short_acc])
    keys = sorted_unique((keys_doc.astype(np.uint64) << _U64(32)) | _to32(keys_acc).astype(np.uint64))
    counts = np.bincount((keys >> _U64(32)).astype(np.int64), minlength=len(texts))
    offsets = np.zeros(len(texts) + 1, dtype=np.int64)
    np.cumsum(counts, out=offsets[1:])
    return (keys & _U64(0xFFFFFFFF)).astype(np.uint32), offsets


def permutations(num_perm: int, seed: int) -> np.ndarray:
    """datasketch's affine32 permutation parameters (a odd, b), shape (2, num_perm), uint32."""
    gen = np.random.RandomState(seed)
    a = gen.randint(0, 1 << 31, num_perm, dtype=np.uint32) * np.uint32(2) + np.uint32(1)
    b = gen.randint(0, 1 << 32, num_perm, dtype=np.uint32)
    return np.array([a, b])


def fmix32(h: np.ndarray) -> np.ndarray:
    """MurmurHash3's 32-bit finaliser (datasketch's pre-mix of every input hash)."""
    h = h ^ (h >> np.uint32(16))
    h = h * np.uint32(0x85EBCA6B)
    h = h ^ (h >> np.uint32(13))
    h = h * np.uint32(0xC2B2AE35)
    return h ^ (h >> np.uint32(16))


def signatures(hashes: np.ndarray, perms: np.ndarray, offsets: np.ndarray | None = None,
               block: int = 8192) -> np.ndarray:
    """MinHash signatures, datasketch's arithmetic: uint32 (documents, num_perm).

    `hashes` are one document's shingle hashes, or many documents' concatenated with `offsets`
    (len = documents + 1; every document has at least one shingle). Work goes in blocks of
    about `block` shingles so the (num_perm, block) temporary stays in cache (4 MiB at 128 perms)."""
    hashes = np.asarray(hashes, dtype=np.uint32)
    if offsets is None:
        offsets = np.array([0, len(hashes)], dtype=np.int64)
    a, b = perms[0][:, None], perms[1][:, None]
    n_perm = perms.shape[1]
    out = np.empty((len(offsets) - 1, n_perm), dtype=np.uint32)
    mixed = fmix32(hashes)
    buf = np.empty(n_perm * block, np.uint32)     # reused: no allocation per block
    d = 0
    while d < len(offsets) - 1:   # documents [d, e) in one block; a huge document is a block alone
        e = max(d + 1, int(np.searchsorted(offsets, offsets[d] + block, side="right")) - 1)
        e = min(e, len(offsets) - 1)
        lo, hi = offsets[d], offsets[e]
        width = int(hi - lo)
        phv = buf[:n_perm * width].reshape(n_perm, width) if width <= block else np.empty((n_perm, width), np.uint32)
        np.multiply(mixed[None, lo:hi], a, out=phv)
        np.add(phv, b, out=phv)
        out[d:e] = np.minimum.reduceat(phv, offsets[d:e] - lo, axis=1).T
        d = e
    return out
