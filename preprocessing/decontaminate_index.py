"""The n-grams of the eval items (BIG-bench tasks, user JSONL eval sets) as 64-bit hashes, the index that
decontamination (preprocessing/decontaminate.py) looks training documents' n-grams up in.

Normalisation (GPT-3's "lowercase, whitespace delimited word with no punctuation"): the text is
lowercased, every character that is neither a letter/digit (`\\w` less `_`) nor whitespace is deleted
(so "don't" -> "dont", "brand-new" -> "brandnew"), and the rest split on whitespace. A word hashes to
xxh3-64 of its UTF-8; an n-gram of words w_0..w_{L-1} to sum(w_k * P^(L-1-k)) mod 2^64, computed for
a whole batch of texts with L vectorised multiply-adds.

An item's texts (`item_text`): its input, and with 'input+answers' the input followed by each answer
(BIG-bench `target`s and `target_scores` choices; an eval file's further fields); an input that joins
words with a hyphen, dash or slash is indexed a second time with a space there (a copy writing "brand
new" for "brand-new" is found; the documents are normalised one way only). A text of at least
`ngram` words contributes all its n-grams; one of `min_item_words`..`ngram`-1 words one n-gram of its own
length (the whole text must appear); a shorter one is skipped and counted. Every hash keeps, per task,
the first item it came from. The index is built once into `<work_dir>/decontaminate/` and marked with the
fingerprint of its settings and of the task and eval files (preprocessing/markers.py).
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from itertools import chain
from pathlib import Path
from typing import Dict, Iterable, List, Tuple

import numpy as np
import xxhash

from common.config import ConfigError

from .config import DecontaminateConfig, EvalFileConfig
from .evalsets import (
    BIGBENCH_TASKS,
    Item,
    bigbench_items,
    bigbench_task_files,
    bigbench_task_path,
    ensure_bigbench_tasks,
    jsonl_items,
)
from .markers import Marker, fingerprint

DROP = re.compile(r"[^\w\s]|_")
JOINER = re.compile(r"(?<=[^\W_])[-\u2010-\u2015/]+(?=[^\W_])")
P = np.uint64(0x9E3779B97F4A7C15)        # odd multiplier of the polynomial n-gram hash
ITEM_TEXTS = ("input", "input+answers")
ACTIONS = ("remove", "mask")
INDEX_SETTINGS = ("ngram", "tasks", "eval_files", "item_text", "min_item_words")
INDEX_VERSION = 2            # part of the index's fingerprint: raise it when what is indexed, or how, changes


def _ascii_table() -> Tuple[bytes, bytes]:
    """normalize_words on ASCII as one bytes.translate: uppercase -> lowercase, whitespace -> space (bytes.split
    does not split at \\x1c-\\x1f, str.split does), every other byte but letters and digits deleted."""
    table, delete = bytearray(range(256)), bytearray()
    for b in range(128):
        c = chr(b)
        if c.isspace():
            table[b] = ord(" ")
        elif c.isalnum() and c != "_":
            table[b] = ord(c.lower())
        else:
            delete.append(b)
    return bytes(table), bytes(delete)


ASCII_TABLE, ASCII_DELETE = _ascii_table()


def normalize_words(text: str) -> List[str]:
    return DROP.sub("", text.lower()).split()


def normalized_utf8(text: str) -> List[bytes]:
    """normalize_words(text), UTF-8 encoded; ASCII text (most of it) ten times faster, bytes.translate."""
    if text.isascii():
        return text.encode().translate(ASCII_TABLE, ASCII_DELETE).split()
    return [w.encode() for w in normalize_words(text)]


def spellings(text: str) -> List[str]:
    """`text`, and where it joins words with a hyphen, dash or slash also the text with a space there: deleting
    punctuation makes "brand-new" one word, and a copy that wrote "brand new" would otherwise be missed."""
    spaced = JOINER.sub(" ", text)
    return [text] if spaced == text else [text, spaced]


def word_hashes(words: Iterable[str], count: int) -> np.ndarray:
    return np.fromiter(map(xxhash.xxh3_64_intdigest, map(str.encode, words)), dtype=np.uint64, count=count)


def utf8_word_hashes(words: Iterable[bytes], count: int) -> np.ndarray:
    return np.fromiter(map(xxhash.xxh3_64_intdigest, words), dtype=np.uint64, count=count)


def ngram_hashes(h: np.ndarray, ends: np.ndarray, lengths: Iterable[int]) -> Dict[int, Tuple[np.ndarray, np.ndarray]]:
    """L -> (start positions, hashes) of every L-gram of the word hashes `h` that lies inside one text; text j is
    h[ends[j-1]:ends[j]]. One pass of multiply-adds up to the largest L."""
    wanted, out = set(lengths), {}
    if not len(h) or not wanted:
        return {L: (np.zeros(0, np.int64), np.zeros(0, np.uint64)) for L in wanted}
    room = None                                     # words left in its text, at each word (one text: all fit)
    if len(ends) > 1:
        room = np.repeat(ends, np.diff(ends, prepend=0)) - np.arange(len(h))
    g = h.copy()
    for L in range(1, max(wanted) + 1):
        if L > 1:
            g = g[:-1] * P + h[L - 1:]
        if L in wanted:
            if room is None:
                out[L] = (np.arange(len(g)), g)
            else:
                pos = np.flatnonzero(room[:len(g)] >= L)
                out[L] = (pos, g[pos])
        if not len(g):
            break
    return {L: out.get(L, (np.zeros(0, np.int64), np.zeros(0, np.uint64))) for L in wanted}


@dataclass
class Index:
    """Per n-gram length L: sorted hashes and, beside each, the item it came from (one entry per task)."""
    ngram: int
    tasks: List[str]
    item_task: np.ndarray                    # item -> task number
    item_no: np.ndarray                      # item -> its example number / line in its source
    hashes: Dict[int, np.ndarray]
    refs: Dict[int, np.ndarray]
    stats: Dict[str, dict] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # a bitmap of the hashes' top bits (all lengths, ~1/16 full) answers most lookups before a binary search
        total = sum(len(h) for h in self.hashes.values())
        self.bits = int(min(30, max(16, np.ceil(np.log2(max(1, total) * 16)))))
        self.bitmap = np.zeros(1 << self.bits, dtype=bool)
        for L, h in self.hashes.items():
            self.bitmap[self._slot(L, h)] = True

    def _slot(self, L: int, g: np.ndarray) -> np.ndarray:
        return ((g ^ np.uint64(L * 0x2545F4914F6CDD1D & (2**64 - 1))) >> np.uint64(64 - self.bits)).astype(np.int64)

    def lengths(self) -> List[int]:
        return sorted(L for L, h in self.hashes.items() if len(h))

    def contains(self, L: int, g: np.ndarray) -> np.ndarray:
        keys = self.hashes[L]
        out = self.bitmap[self._slot(L, g)]
        maybe = out.nonzero()[0]
        if not len(maybe):
            return out
        pos = np.minimum(np.searchsorted(keys, g[maybe]), len(keys) - 1)
        out[maybe] = keys[pos] == g[maybe]
        return out

    def items_of(self, L: int, g: int) -> List[int]:
        keys = self.hashes[L]
        lo, hi = np.searchsorted(keys, np.uint64(g), "left"), np.searchsorted(keys, np.uint64(g), "right")
        return [int(r) for r in self.refs[L][lo:hi]]


def _sources(cfg: DecontaminateConfig, cache: Path) -> List[Tuple[str, Iterable[Item]]]:
    tasks = bigbench_task_files(cfg.tasks, cache) if cfg.tasks else {}
    out: List[Tuple[str, Iterable[Item]]] = [(name, bigbench_items(task)) for name, task in tasks.items()]
    out += [(eval_file_name(f), jsonl_items(Path(f.path), list(f.fields))) for f in cfg.eval_files]
    return out


def eval_file_name(f: EvalFileConfig) -> str:
    return f.name or Path(f.path).name.removesuffix(".jsonl")


def build_index(cfg: DecontaminateConfig, cache: Path = BIGBENCH_TASKS) -> Index:
    n, texts, text_item, item_task, item_no, stats = cfg.ngram, [], [], [], [], {}
    answer_words: Dict[str, List[bytes]] = {}          # choices repeat across items ('Yes', 'a', 'correct')
    names = []
    for t, (name, items) in enumerate(_sources(cfg, cache)):
        names.append(name)
        st = stats.setdefault(name, {"items": 0, "indexed": 0, "skipped_short": 0})
        for k, inp, answers in items:
            item = len(item_no)
            item_task.append(t)
            item_no.append(k)
            st["items"] += 1
            variants = []
            for spelling in spellings(inp):
                words = normalized_utf8(spelling)
                variants.append(words)
                if cfg.item_text != "input+answers":
                    continue
                # input + answer: only its n-grams that reach into the answer are new, those of the last n-1
                # input words and the answer (the whole of it where it is shorter than n words)
                for a in answers:
                    tail = answer_words.get(a)
                    if tail is None:
                        tail = answer_words[a] = normalized_utf8(a)
                    variants.append((words if len(words) + len(tail) < n else words[-(n - 1):]) + tail)
            kept = [w for w in variants if len(w) >= min(n, cfg.min_item_words)]
            st["indexed" if kept else "skipped_short"] += 1
            texts += kept
            text_item += [item] * len(kept)
    lengths = np.array([len(w) for w in texts], dtype=np.int64)
    ends = np.cumsum(lengths)
    vocab = dict.fromkeys(chain.from_iterable(texts))    # eval sets repeat their words: each is hashed once
    vocab.update(zip(vocab, utf8_word_hashes(vocab, len(vocab)).tolist(), strict=True))
    total = int(ends[-1]) if len(ends) else 0
    h = np.fromiter(map(vocab.__getitem__, chain.from_iterable(texts)), dtype=np.uint64, count=total)
    short = sorted({int(L) for L in lengths if L < n})
    grams = ngram_hashes(h, ends, [n, *short])
    text_of_word = np.repeat(np.arange(len(texts)), lengths)
    first_word = ends - lengths
    text_item_arr = np.array(text_item, dtype=np.int64)
    item_task_arr = np.array(item_task, dtype=np.int32)
    hashes, refs = {}, {}
    for L, (pos, g) in grams.items():
        if L < n:                        # a short text: only its whole-text n-gram
            keep = (lengths[text_of_word[pos]] == L) & (first_word[text_of_word[pos]] == pos)
            pos, g = pos[keep], g[keep]
        item = text_item_arr[text_of_word[pos]]
        task = item_task_arr[item]
        order = np.lexsort((item, task, g))          # by hash, then task, then first item
        g, item, task = g[order], item[order], task[order]
        first = np.ones(len(g), dtype=bool)
        first[1:] = (g[1:] != g[:-1]) | (task[1:] != task[:-1])
        hashes[L], refs[L] = g[first], item[first].astype(np.int64)
        for t, c in zip(*np.unique(task[first], return_counts=True), strict=True):
            stats[names[t]][f"ngrams_{L}"] = int(c)
    return Index(n, names, item_task_arr, np.array(item_no, dtype=np.int64), hashes, refs, stats)


def check(cfg: DecontaminateConfig, cache: Path = BIGBENCH_TASKS) -> None:
    """Refuse a config that cannot run, naming each field and its fix (ConfigError)."""
    bad = []
    if not isinstance(cfg.ngram, int) or cfg.ngram < 1:
        bad.append(f"decontaminate.ngram={cfg.ngram!r}: must be an integer >= 1 (GPT-3 and Llama used 13).")
    if not isinstance(cfg.min_item_words, int) or cfg.min_item_words < 1:
        bad.append(f"decontaminate.min_item_words={cfg.min_item_words!r}: must be an integer >= 1.")
    if not isinstance(cfg.min_ngrams, int) or cfg.min_ngrams < 1:
        bad.append(f"decontaminate.min_ngrams={cfg.min_ngrams!r}: must be an integer >= 1.")
    if cfg.action not in ACTIONS:
        bad.append(f"decontaminate.action={cfg.action!r}: use one of {list(ACTIONS)}.")
    if cfg.item_text not in ITEM_TEXTS:
        bad.append(f"decontaminate.item_text={cfg.item_text!r}: use one of {list(ITEM_TEXTS)}.")
    if not cfg.tasks and not cfg.eval_files:
        bad.append("decontaminate.tasks and decontaminate.eval_files are both empty: nothing to decontaminate "
                   "against. Fix: name BIG-bench tasks or eval files, or set decontaminate.enabled=false.")
    names = set()
    for i, f in enumerate(cfg.eval_files):
        if not Path(f.path).is_file():
            bad.append(f"decontaminate.eval_files[{i}].path={f.path!r}: no such file. Fix: the path of a JSONL "
                       "eval set, one item per line.")
        if not f.fields:
            bad.append(f"decontaminate.eval_files[{i}].fields is empty: name the field of the item's input first.")
        names.add(eval_file_name(f))
    clash = names & set(cfg.tasks) or (len(names) < len(cfg.eval_files))
    if clash:
        bad.append(f"decontaminate.eval_files: task names clash ({sorted(names & set(cfg.tasks)) or 'two files'}). "
                   "Fix: give each file its own `name`.")
    listing = cache / "single_file_tasks.txt"
    if listing.is_file():
        unknown = sorted(set(cfg.tasks) - set(listing.read_text().split()))
        if unknown:
            bad.append(f"decontaminate.tasks: {unknown} are not single-file tasks of bigbench==1.0.0 (listed in "
                       f"{listing}). Fix: choose others, or remove them.")
    if bad:
        raise ConfigError(bad, source="decontaminate")


def index_fingerprint(cfg: DecontaminateConfig, cache: Path = BIGBENCH_TASKS) -> str:
    """What the index depends on: its settings and the task and eval files (size, mtime). A shard's marker
    can take it in, so a shard is redone exactly when its index changes."""
    settings = {k: json.loads(json.dumps(getattr(cfg, k), default=vars)) for k in INDEX_SETTINGS}
    settings["version"] = INDEX_VERSION
    inputs = [bigbench_task_path(t, cache) for t in cfg.tasks] + [Path(f.path) for f in cfg.eval_files]
    return fingerprint(settings, inputs)


def index_path(work_dir: Path | str) -> Path:
    return Path(work_dir) / "decontaminate" / "index.npz"


def load_or_build(cfg: DecontaminateConfig, work_dir: Path | str, cache: Path = BIGBENCH_TASKS,
                  log=print) -> Index:
    """The index of `cfg` from `<work_dir>/decontaminate/`, built (and marked) when missing or stale. Safe with
    several shard tasks at once: each writes whole files under its own name and renames them in (equal bytes)."""
    check(cfg, cache)
    try:
        ensure_bigbench_tasks(cfg.tasks, cache)         # fetched first: their files are part of the fingerprint
    except ValueError as err:
        raise ConfigError([f"decontaminate.tasks: {err}"], source="decontaminate") from None
    path = index_path(work_dir)
    out = path.parent
    marker = Marker(out, "decontaminate-index", index_fingerprint(cfg, cache))
    done = marker.done(announce=False)
    if done is not None:
        return _load(path, done)
    index = build_index(cfg, cache)
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / f"index.{uuid.uuid4().hex}.tmp.npz"          # unique also across hosts of a SLURM array
    arrays = {"item_task": index.item_task, "item_no": index.item_no}
    for L in index.hashes:
        arrays[f"hash_{L}"], arrays[f"ref_{L}"] = index.hashes[L], index.refs[L]
    np.savez(tmp, **arrays)
    tmp.replace(path)
    summary = {"ngram": index.ngram, "tasks": index.tasks, "stats": index.stats}
    marker.mark(summary, outputs=[path])
    log(f">> decontamination index: {sum(len(h) for h in index.hashes.values()):,} n-gram hashes of "
        f"{len(index.item_no):,} items ({', '.join(index.tasks)}) -> {path}")
    return index


def _load(path: Path, summary: dict) -> Index:
    with np.load(path) as z:
        lengths = sorted(int(k.split("_")[1]) for k in z.files if k.startswith("hash_"))
        return Index(summary["ngram"], summary["tasks"], z["item_task"], z["item_no"],
                     {L: z[f"hash_{L}"] for L in lengths}, {L: z[f"ref_{L}"] for L in lengths}, summary["stats"])


def item_label(index: Index, item: int) -> Tuple[str, int]:
    return index.tasks[int(index.item_task[item])], int(index.item_no[item])
