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

from .evalsets import DEFAULT_BIGBENCH

STAGE_NAMES = ("prepare", "signatures", "buckets", "verify", "clusters", "write", "filter", "decontaminate", "split",
               "tokenizer", "tokenize", "merge")


@dataclass
class InputConfig:
    paths: List[str] = doc(None, "Input files or folders (JSONL[.gz/.zst], Parquet, text folders, HF save_to_disk).",
                           factory=list)
    format: str = doc("auto", "'auto' (by name), 'jsonl', 'parquet', 'text', 'hf_disk' or 'warc' (.warc[.gz], "
                              ".wet[.gz]: read by the `warc` stage).")
    text_field: str = doc("text", "Record field holding the document text.")
    id_field: str = doc("id", "Record field holding the document id (file:line when absent).")
    max_bad_fraction: float = doc(0.01, "Fail the run when more than this fraction of records is unusable.")
    quarantine: Optional[str] = doc(None, "File of documents to leave out (a record id or file:line per line, as "
                                          "make explain-step prints them); null: none. preprocessing/provenance.py.")


@dataclass
class NormalizeConfig:
    enabled: bool = doc(True, "Run Unicode normalisation and control-character stripping.")
    form: str = doc("NFC", "Unicode normal form.")
    exact_dedup: bool = doc(True, "Drop documents whose normalised text hashes equal an earlier one (one process "
                                  "holds every hash; at scale set false: the sharded MinHash step removes the same).")


@dataclass
class ExtractConfig:
    """The `extract` stage (preprocessing/extract.py): HTML -> main text (docs/web-data.md#main-text-extraction)."""
    extractor: str = doc("trafilatura", "Registered extractor of the record's `html` field: 'trafilatura' (the "
                                        "measured default), 'resiliparse', 'justext', 'inscriptis' or 'lxml_text'.")
    include_tables: bool = doc(True, "Keep the text of <table> elements (trafilatura, resiliparse).")
    include_comments: bool = doc(False, "Keep user comments below the main text (trafilatura, resiliparse).")
    favor_precision: bool = doc(True, "trafilatura: leave out more uncertain text (less boilerplate, less text); "
                                      "the measured best F1.")
    favor_recall: bool = doc(False, "trafilatura: keep more uncertain text (more text, more boilerplate).")
    justext_language: str = doc("English", "justext: the stop-word list its paragraph classifier uses.")
    min_words: int = doc(1, "Remove a document whose extracted text has fewer whitespace-separated words "
                            "(reason `short_extraction`; an empty one is `empty_extraction`).")


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
    component_tasks: int = doc(4, "Tasks of each phase of the clusters step's connected components, each holding "
                                  "only its share of the nodes' edges (~300 B x edges / tasks: raise with the "
                                  "corpus).")
    max_bucket_size: int = doc(10_000, "An LSH bucket of more documents pairs only its first this many (counted "
                                       "and reported; exact copies are never capped).")
    workers: int = doc(2, "Local worker processes for the sharded dedup steps.")
    lowercase: bool = doc(True, "Lowercase words before shingling.")


@dataclass
class LanguageConfig:
    """The `language` filter (preprocessing/quality/language.py, py3langid; docs/preprocessing.md)."""
    keep: List[str] = doc(None, "Language codes (ISO 639-1, as py3langid names them) a kept document's top "
                                "language must be one of.", factory=lambda: ["en"])
    min_score: float = doc(0.65, "Drop a document whose top-language probability is below this (datatrove/FineWeb's "
                                 "0.65; py3langid's probability, not fastText's).")
    max_chars: int = doc(2000, "Characters from the start of the text given to the model (cost grows with them); "
                               "0: the whole text.")


@dataclass
class GopherQualityConfig:
    """`gopher_quality`: datatrove 0.10.1 GopherQualityFilter's defaults (words: spaCy English tokens); 0 disables."""
    min_doc_words: int = doc(50, "Drop documents with fewer non-symbol words (a word not made only of punctuation).")
    max_doc_words: int = doc(100_000, "Drop documents with more non-symbol words.")
    min_avg_word_length: float = doc(3, "Drop documents whose mean non-symbol word length is below this.")
    max_avg_word_length: float = doc(10, "Drop documents whose mean non-symbol word length is above this.")
    max_symbol_word_ratio: float = doc(0.1, "Max '#' count, and max '...'+'…' count, per word (all tokens).")
    max_bullet_lines_ratio: float = doc(0.9, "Max fraction of lines (str.splitlines) starting with '•' or '-'.")
    max_ellipsis_lines_ratio: float = doc(0.3, "Max fraction of lines ending with '...' or '…'.")
    min_alpha_words_ratio: float = doc(0.8, "Min fraction of tokens holding a letter (datatrove's "
                                             "max_non_alpha_words_ratio, a minimum despite its name).")
    min_stop_words: int = doc(2, "Min count of distinct stop words among the tokens (case-sensitive).")
    stop_words: List[str] = doc(None, "Gopher's stop words.",
                                factory=lambda: ["the", "be", "to", "of", "and", "that", "have", "with"])


@dataclass
class GopherRepetitionConfig:
    """`gopher_repetition`: datatrove 0.10.1 GopherRepetitionFilter's defaults (Gopher Table A1); 0 disables."""
    dup_line_frac: float = doc(0.3, "Max fraction of lines (split on newline runs) repeating an earlier line.")
    dup_para_frac: float = doc(0.3, "Max fraction of paragraphs (split on 2+ newlines) repeating an earlier one.")
    dup_line_char_frac: float = doc(0.2, "Max characters in repeated lines over the document's characters.")
    dup_para_char_frac: float = doc(0.2, "Max characters in repeated paragraphs over the document's characters.")
    top_n_grams: Dict[str, float] = doc(None, "n -> max characters of the most frequent word n-gram (times its "
                                              "count) over the document's characters.",
                                        factory=lambda: {"2": 0.2, "3": 0.18, "4": 0.16})
    dup_n_grams: Dict[str, float] = doc(None, "n -> max characters in repeated word n-grams over the document's "
                                              "characters.", factory=lambda: {"5": 0.15, "6": 0.14, "7": 0.13,
                                                                              "8": 0.12, "9": 0.11, "10": 0.10})


@dataclass
class C4Config:
    """`c4`: datatrove 0.10.1 C4QualityFilter's defaults (split_paragraph=True: one line at a time).

    Drop-only: the kept document keeps its text; datatrove also rewrites it to the kept lines."""
    remove_citations: bool = doc(True, "Remove [1], [edit], [citation needed] before the line checks.")
    filter_no_terminal_punct: bool = doc(True, "A line not ending in . ? ! \" ' (or ending in ...) does not count.")
    min_num_sentences: int = doc(5, "Drop documents with fewer sentences in their counted lines (-1: off).")
    min_words_per_line: int = doc(3, "A line with fewer whitespace-separated words does not count (-1: off).")
    max_word_length: int = doc(1000, "A line with a longer word does not count (-1: off).")
    filter_lorem_ipsum: bool = doc(True, "Drop documents with 'lorem ipsum' in a counted line.")
    filter_javascript: bool = doc(True, "A line mentioning 'javascript' does not count.")
    filter_curly_bracket: bool = doc(True, "Drop documents with '{' in a counted line.")
    filter_policy: bool = doc(True, "A line with 'terms of use', 'privacy policy', 'cookie policy', 'uses cookies', "
                                    "'use of cookies' or 'use cookies' does not count.")


@dataclass
class FineWebConfig:
    """`fineweb`: datatrove 0.10.1 FineWebQualityFilter's defaults (over the non-blank lines)."""
    line_punct_thr: float = doc(0.12, "Drop documents with a smaller fraction of lines ending in terminal punctuation.")
    line_punct_exclude_zero: bool = doc(False, "Keep documents where no line ends in terminal punctuation.")
    short_line_thr: float = doc(0.67, "Drop documents with a larger fraction of short lines.")
    short_line_length: int = doc(30, "A line of at most this many characters is short.")
    char_duplicates_ratio: float = doc(0.01, "Max characters in repeated lines over the characters without newlines.")
    new_line_ratio: float = doc(0.3, "Max newlines per word (spaCy English tokens).")


@dataclass
class QualityClassifierConfig:
    """The `quality` filter (preprocessing/quality/classifier.py): the fastText model `make quality-classifier`
    trained."""
    model: Optional[str] = doc(None, "The model file (.bin) `make quality-classifier` wrote; required when `quality` "
                                     "is in filters.names.")
    threshold: float = doc(0.5, "Drop a document whose probability of the positive (high-quality) label is below "
                                "this (reason `quality`).")
    score_field: str = doc("quality_score", "Record field the kept (and dropped) document's score is written to.")
    max_chars: int = doc(0, "Characters from the start of the text given to the model; 0: the whole text.")


@dataclass
class QualityTrainConfig:
    """`make quality-classifier` (preprocessing/quality_classifier.py): fastText supervised, DCLM's recipe (word
    bigrams over whitespace-joined lines), trained on positive vs negative JSONL; docs/web-data.md."""
    positive: List[str] = doc(None, "JSONL files of high-quality examples (label 1).", factory=list)
    negative: List[str] = doc(None, "JSONL files of low-quality examples (label 0).", factory=list)
    text_field: str = doc("text", "Record field holding the text.")
    output: str = doc(MISSING, "Where the model (.bin) goes, written atomically; its held-out report goes beside it "
                               "(.json).")
    word_ngrams: int = doc(2, "Word n-gram features (fastText -wordNgrams); DCLM's classifier uses bigrams.")
    dim: int = doc(256, "Embedding dimension (fastText -dim).")
    epoch: int = doc(3, "Passes over the training set (fastText -epoch).")
    lr: float = doc(0.1, "Learning rate (fastText -lr).")
    min_count: int = doc(1, "Words seen fewer times are dropped (fastText -minCount).")
    bucket: int = doc(2_000_000, "Hash buckets of the n-gram features (fastText -bucket): memory is bucket x dim x 4 "
                                 "bytes, in training and in the saved model.")
    heldout_fraction: float = doc(0.1, "Examples (by id hash) kept out of training to measure precision/recall on.")
    threshold: float = doc(0.5, "Score from which a held-out example counts as predicted positive (the filter's "
                                "filters.quality.threshold should match).")
    max_chars: int = doc(0, "Characters from the start of each text used; 0: the whole text (as the filter's).")
    seed: int = doc(0, "Seed of the held-out split and of fastText.")
    threads: int = doc(1, "fastText training threads (1: the same model on every run).")


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
    gopher_quality: GopherQualityConfig = doc(None, "Filter `gopher_quality` (datatrove parity).",
                                              factory=GopherQualityConfig)
    gopher_repetition: GopherRepetitionConfig = doc(None, "Filter `gopher_repetition` (datatrove parity).",
                                                    factory=GopherRepetitionConfig)
    c4: C4Config = doc(None, "Filter `c4` (datatrove parity, drop-only).", factory=C4Config)
    fineweb: FineWebConfig = doc(None, "Filter `fineweb` (datatrove parity).", factory=FineWebConfig)
    language: LanguageConfig = doc(None, "Settings of the `language` filter.", factory=LanguageConfig)
    quality: QualityClassifierConfig = doc(None, "Settings of the `quality` filter (a trained fastText classifier).",
                                           factory=QualityClassifierConfig)
    shards: int = doc(4, "Parts (array tasks) of the document passes (filter, decontaminate) when dedup is off; "
                         "with dedup they are its dedup.shards parts.")


@dataclass
class PIIConfig:
    """The `pii` transform (preprocessing/pii.py): personal data in kept documents -> placeholders (Dolma's)."""
    kinds: List[str] = doc(None, "What is replaced: any of 'email', 'ipv4', 'ipv6', 'phone'.",
                           factory=lambda: ["email", "ipv4", "ipv6", "phone"])
    email_placeholder: str = doc("|||EMAIL_ADDRESS|||", "Replaces an e-mail address (datatrove: email@example.com).")
    ip_placeholder: str = doc("|||IP_ADDRESS|||", "Replaces a public IPv4 or IPv6 address.")
    phone_placeholder: str = doc("|||PHONE_NUMBER|||", "Replaces a phone number.")
    public_ips_only: bool = doc(True, "Replace only public IPs (datatrove's only_remove_public_ips); private, "
                                      "loopback, link-local, documentation and reserved ones stay.")


@dataclass
class EvalFileConfig:
    """A user eval set for decontamination: JSONL, one item per line."""
    path: str = doc(MISSING, "The JSONL file.")
    fields: List[str] = doc(None, "Fields of an item's text: its input first, then its answers (a list field gives "
                                  "one answer per element).", factory=lambda: ["input"])
    name: Optional[str] = doc(None, "Its task name in the report (null: the file name without .jsonl).")


@dataclass
class DecontaminateConfig:
    """Benchmark decontamination (preprocessing/decontaminate.py, docs/preprocessing.md#decontamination)."""
    enabled: bool = doc(False, "Remove (or mask) training documents that contain eval items' n-grams.")
    ngram: int = doc(13, "Words per n-gram (GPT-3's and Llama's 13), over lowercased words stripped of punctuation.")
    tasks: List[str] = doc(None, "BIG-bench tasks of bigbench==1.0.0 (those `make eval-data` writes).",
                           factory=lambda: list(DEFAULT_BIGBENCH))
    eval_files: List[EvalFileConfig] = doc(None, "User eval sets (JSONL) decontaminated against too.", factory=list)
    item_text: str = doc("input+answers", "What of an item is indexed: 'input', or 'input+answers' (the input, and "
                                          "the input followed by each target/choice, as GPT-3 took context plus "
                                          "completion).")
    min_item_words: int = doc(8, "An item text shorter than `ngram` words but this long counts as one n-gram of its "
                                 "own length (the whole text must appear); shorter ones are skipped and counted.")
    min_ngrams: int = doc(1, "A document is contaminated from this many matching n-gram positions on.")
    action: str = doc("remove", "'remove' the document (into the side file) or 'mask' the matching spans.")
    mask: str = doc("", "With action=mask: what replaces each matching span ('' deletes it).")


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
    train: bool = doc(False, "Train a tokenizer (of `algorithm`) on the train split instead of loading.")
    algorithm: str = doc("bpe", "What `train` trains: 'bpe' (byte-level, GPT-2's) or 'wordpiece' (BERT's uncased, "
                                "with [PAD] [UNK] [CLS] [SEP] [MASK] <s> </s> <extra_id_0..99> as ids 0..106).")
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
    split_sentences: bool = doc(False, "One sequence per sentence (spaCy's sentencizer), documents marked by the "
                                       "index's document_indices: Megatron-LM's --split-sentences, for BERT and T5.")


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
class WarcConfig:
    """The `warc` stage (preprocessing/web/warc_stage.py): WARC/WET files -> documents, a task per file group."""
    content_types: List[str] = doc(None, "HTTP Content-Types (without parameters) whose response records are "
                                         "documents; any other is counted as not_html.",
                                   factory=lambda: ["text/html", "application/xhtml+xml"])
    ok_status_only: bool = doc(True, "Keep only 2xx responses (redirects and error pages counted as http_status).")


@dataclass
class UrlFilterConfig:
    """The `url_filter` pass (preprocessing/web/url_filter.py): block lists by domain, URL substring and regex."""
    ut1_dirs: List[str] = doc(None, "UT1 blacklist folders: <dir>/<category>/domains and <dir>/<category>/urls "
                                    "(one entry a line, # comments).", factory=list)
    categories: List[str] = doc(None, "UT1 categories used (e.g. [adult, malware]); empty: every category found.",
                                factory=list)
    domain_files: List[str] = doc(None, "Plain lists of blocked domains (a domain blocks its subdomains too).",
                                  factory=list)
    url_files: List[str] = doc(None, "Plain lists of blocked URLs (host or a subdomain, then a path prefix; "
                                     "scheme and www. ignored), as UT1's urls files.", factory=list)
    substring_files: List[str] = doc(None, "Plain lists of strings blocked anywhere in the lowercased URL.",
                                     factory=list)
    regex_files: List[str] = doc(None, "Plain lists of Python regular expressions searched in the whole URL.",
                                 factory=list)
    url_field: str = doc("url", "Record field holding the URL.")
    missing_url: str = doc("keep", "A record without a URL: 'keep' it (counted) or 'remove' it (reason no_url).")


@dataclass
class PreprocessConfig:
    name: str = doc("demo", "Pipeline name.")
    work_dir: str = doc("data/work", "Intermediate files (normalised, deduplicated, filtered, split).")
    output_dir: str = doc(MISSING, "Tokenizer, .bin/.idx per split, blend.json.")
    input: InputConfig = doc(None, "What to read.", factory=InputConfig)
    warc: WarcConfig = doc(None, "The `warc` stage (WARC/WET input).", factory=WarcConfig)
    extract: ExtractConfig = doc(None, "The `extract` stage: HTML -> main text.", factory=ExtractConfig)
    url_filter: UrlFilterConfig = doc(None, "The `url_filter` pass (block lists).", factory=UrlFilterConfig)
    normalize: NormalizeConfig = doc(None, "Stage 1.", factory=NormalizeConfig)
    dedup: DedupConfig = doc(None, "Stage 2.", factory=DedupConfig)
    filters: FilterConfig = doc(None, "Stage 3.", factory=FilterConfig)
    transforms: List[str] = doc(None, "Registered text transforms applied in order to kept documents "
                                      "(preprocessing.transforms.register_transform).", factory=lambda: ["pii"])
    pii: PIIConfig = doc(None, "Settings of the `pii` transform.", factory=PIIConfig)
    decontaminate: DecontaminateConfig = doc(None, "Benchmark decontamination (after the filters, before the split).",
                                             factory=DecontaminateConfig)
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
ConfigStore.instance().store(name="quality_train_schema", node=QualityTrainConfig)

