"""Typed config of the preprocessing pipeline (Hydra ConfigStore: `preprocess_schema`).

`preprocessing/conf/<name>.yaml` picks values; every stage CLI takes Hydra overrides
(`python -m preprocessing.dedup input.paths=[x.jsonl] output=out dedup.threshold=0.7`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

from common.config import doc
from common.slurm_values import JobStepConfig

STAGE_NAMES = ("prepare", "signatures", "buckets", "verify", "clusters", "write", "filter", "tokenize", "merge")


@dataclass
class InputConfig:
    paths: List[str] = doc(None, "Input files or folders (JSONL[.gz/.zst], Parquet, text folders, HF save_to_disk).",
                           factory=list)
    format: str = doc("auto", "'auto' (by name), 'jsonl', 'parquet', 'text' or 'hf_disk'.")
    text_field: str = doc("text", "Record field holding the document text.")
    id_field: str = doc("id", "Record field holding the document id (file:line when absent).")
    max_bad_fraction: float = doc(0.01, "Fail the run when more than this fraction of records is unusable.")


@dataclass
class NormalizeConfig:
    enabled: bool = doc(True, "Run Unicode normalisation and control-character stripping.")
    form: str = doc("NFC", "Unicode normal form.")
    exact_dedup: bool = doc(True, "Drop documents whose normalised text hashes equal an earlier one.")


@dataclass
class DedupConfig:
    enabled: bool = doc(True, "Run MinHashLSH near-duplicate removal.")
    ngram: int = doc(3, "Word n-gram size of the shingles (docs/dedup.md: 3 keeps 10%-edited copies above 0.5).")
    num_perm: int = doc(128, "MinHash permutations (signature length).")
    bands: int = doc(32, "LSH bands (bands x rows <= num_perm); 32 x 4: P(candidate) 0.87 at J=0.5, 0.99 at 0.65.")
    rows: int = doc(4, "MinHash values per LSH band.")
    threshold: float = doc(0.5, "Exact Jaccard of the shingle sets from which an LSH candidate pair is a duplicate.")
    containment_threshold: float = doc(0.8, "Or: share of the smaller document's shingles found in the larger one "
                                             "(truncated copies), from which a candidate pair is a duplicate.")
    min_length_ratio: float = doc(0.5, "Containment counts only when the smaller set has at least this fraction of "
                                       "the larger's shingles (a short boilerplate page is not 'contained').")
    seed: int = doc(1, "MinHash seed (same seed, same result).")
    shards: int = doc(4, "Document shards: the signatures, verify and write steps run one task (SLURM array "
                         "task) per shard, each reading only its bytes of a plain JSONL input.")
    bucket_tasks: int = doc(4, "LSH bucket tasks: task t groups the t-th slice of band-hash space of every band.")
    max_bucket_size: int = doc(10_000, "An LSH bucket of more documents pairs only its first this many (counted "
                                       "and reported; exact copies are never capped).")
    workers: int = doc(2, "Local worker processes for the sharded dedup steps.")
    lowercase: bool = doc(True, "Lowercase words before shingling.")


@dataclass
class FilterConfig:
    enabled: bool = doc(True, "Run the quality filters of `names`.")
    names: List[str] = doc(None, "Registered filters applied in order (preprocessing.filters.register_filter); "
                                 "a document is dropped by the first rule it fails.", factory=lambda: ["gopher"])
    params: Dict[str, Any] = doc(None, "Settings of filters registered outside the project, read by their factories "
                                       "(e.g. +filters.params.max_digits=0.2).", factory=dict)
    min_words: int = doc(50, "Drop documents with fewer words.")
    max_words: int = doc(100_000, "Drop documents with more words.")
    min_mean_word_length: float = doc(3.0, "Drop documents whose mean word length is below this.")
    max_mean_word_length: float = doc(10.0, "Drop documents whose mean word length is above this.")
    max_symbol_word_ratio: float = doc(0.1, "Max ratio of '#' and '...' symbols to words.")
    min_alpha_word_fraction: float = doc(0.8, "Min fraction of words with an alphabetic character.")
    min_stop_words: int = doc(2, "Min count of English stop words (the, be, to, of, and, that, have, with).")
    max_bullet_line_fraction: float = doc(0.9, "Max fraction of lines starting with a bullet.")
    max_ellipsis_line_fraction: float = doc(0.3, "Max fraction of lines ending with an ellipsis.")
    max_dup_line_fraction: float = doc(0.3, "Max fraction of lines that repeat an earlier line.")
    max_dup_line_char_fraction: float = doc(0.2, "Max fraction of characters in repeated lines.")
    max_top_ngram_char_fraction: Dict[str, float] = doc(None, "n -> max char fraction of the most frequent n-gram.",
                                                         factory=lambda: {"2": 0.2, "3": 0.18, "4": 0.16})
    max_dup_ngram_char_fraction: Dict[str, float] = doc(None, "n -> max char fraction in repeated n-grams.",
                                                         factory=lambda: {"5": 0.15, "6": 0.14, "7": 0.13,
                                                                          "8": 0.12, "9": 0.11, "10": 0.10})


@dataclass
class SplitConfig:
    valid_fraction: float = doc(0.02, "Documents held out for validation (by document id hash).")
    test_fraction: float = doc(0.02, "Documents held out for test (by document id hash).")
    seed: int = doc(0, "Salt of the split hash.")


@dataclass
class TokenizerConfig:
    """The data's tokenizer; the recipe's `data.tokenizer` is this section too."""
    type: str = doc("gpt2", "'gpt2' (vocab.json+merges.txt dir), 'hf' (tokenizer dir/json) or "
                            "'sentencepiece' (.model).")
    path: Optional[str] = doc(None, "Tokenizer file or directory; null only for plans and mock data.")


@dataclass
class TokenizerSpec(TokenizerConfig):
    """data.tokenizer (type, path) plus how to train one when `train` is set."""
    type: str = doc("hf", "'hf', 'gpt2' or 'sentencepiece' (as data.tokenizer.type).")
    path: str = doc(MISSING, "Tokenizer directory/file to load, or to write when trained.")
    train: bool = doc(False, "Train a byte-level BPE on the train split instead of loading.")
    vocab_size: int = doc(4096, "Vocabulary size when training.")
    min_frequency: int = doc(2, "Minimum pair frequency when training.")
    fim_sentinels: bool = doc(False, "When training, also add the fill-in-the-middle sentinels <fim_prefix> "
                                     "<fim_middle> <fim_suffix> <fim_pad> as special tokens (data.fim).")


@dataclass
class TokenizeConfig:
    workers: int = doc(2, "Processes encoding consecutive byte ranges of a plain JSONL input side by side, one "
                          "thread each (other inputs: the tokenizer's own threads).")
    batch_size: int = doc(256, "Documents per encode batch.")
    append_eod: bool = doc(True, "Append the end-of-document token (Megatron --append-eod).")
    shards: int = doc(1, "Byte ranges per split (one SLURM array task each, reading only its bytes), merged in "
                         "order into one .bin/.idx per split: the same bytes as one pass.")


@dataclass
class SlurmJobConfig(JobStepConfig):
    """CPU jobs of `make preprocess LAUNCHER=slurm` (launch/preprocess.py)."""
    partition: Optional[str] = doc(None, "SLURM partition of the CPU jobs (null: the cluster's default).")
    account: Optional[str] = doc(None, "SLURM account.")
    qos: Optional[str] = doc(None, "SLURM QOS.")
    constraint: Optional[str] = doc(None, "SLURM --constraint.")
    cpus_per_task: int = doc(4, "CPUs of every job and array task.")
    mem: Optional[str] = doc(None, "SLURM --mem per job (e.g. '16G').")
    time: str = doc("04:00:00", "Time limit of every job and array task.")
    exclude: List[str] = doc(None, "Hosts never to use.", factory=list)
    setup: List[str] = doc(None, "Shell lines run first (modules, container); trusted site config.", factory=list)
    env: Dict[str, str] = doc(None, "Environment variables of every job.", factory=dict)


@dataclass
class PreprocessConfig:
    name: str = doc("demo", "Pipeline name.")
    work_dir: str = doc("data/work", "Intermediate files (normalised, deduplicated, filtered, split).")
    output_dir: str = doc(MISSING, "Tokenizer, .bin/.idx per split, blend.json.")
    input: InputConfig = doc(None, "What to read.", factory=InputConfig)
    normalize: NormalizeConfig = doc(None, "Stage 1.", factory=NormalizeConfig)
    dedup: DedupConfig = doc(None, "Stage 2.", factory=DedupConfig)
    filters: FilterConfig = doc(None, "Stage 3.", factory=FilterConfig)
    split: SplitConfig = doc(None, "Held-out splits.", factory=SplitConfig)
    tokenizer: TokenizerSpec = doc(None, "Stage 4.", factory=TokenizerSpec)
    tokenize: TokenizeConfig = doc(None, "Stage 5.", factory=TokenizeConfig)
    slurm: SlurmJobConfig = doc(None, "Jobs of LAUNCHER=slurm.", factory=SlurmJobConfig)
    fetch: List[str] = doc(None, "Registry data to fetch first: 'shakespeare', 'gpt2-tokenizer', 'llama-sp-tokenizer'.",
                           factory=list)
    stages: List[str] = doc(None, "Registered stages run in order (preprocessing.stages.register_stage); each is one "
                                  "SLURM job or job array under LAUNCHER=slurm.", factory=lambda: list(STAGE_NAMES))
    imports: List[str] = doc(None, "Python modules imported before the config is checked, so the filters and stages "
                                   "they register can be named here (also in SLURM jobs).", factory=list)


ConfigStore.instance().store(name="preprocess_schema", node=PreprocessConfig)

