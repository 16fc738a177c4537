"""Sentence-level data for the encoder and denoising objectives (docs/sentence-data.md): spaCy's sentencizer on the
demo corpus, Megatron-LM's --split-sentences .bin/.idx read back by megatron-core, the BERT/T5 WordPiece."""
from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from preprocessing import tokenize_indexed
from preprocessing.blend import combine, write_blend
from preprocessing.config import InputConfig, TokenizeConfig
from preprocessing.fetch import fetch
from preprocessing.normalize import normalize_text
from preprocessing.sentences import split_one, split_sentences
from preprocessing.tokenize_indexed import merge_indexed, tokenize_to_indexed
from preprocessing.tokenizer_io import BERT_SPECIAL, T5_SENTINELS, load_tokenizer, train_wordpiece

SPACE = re.compile(r"\s+")
TITLE_BEFORE_NAME = re.compile(r"\b(Mr|Mrs|St)\. [A-Z][a-z]")


@pytest.fixture(scope="module")
def demo_texts():
    path = Path("data/demo/raw/corpus.jsonl")
    if not path.exists():
        path = Path(fetch("shakespeare"))
    return [normalize_text(json.loads(line)["text"]) for line in path.open(encoding="utf-8")]


@pytest.fixture(scope="module")
def wordpiece(tmp_path_factory, demo_texts):
    """A small WordPiece trained by the pipeline's trainer on real demo text (the demo's has 4096 ids)."""
    return train_wordpiece(demo_texts[:20], 600, 2, tmp_path_factory.mktemp("wp") / "tokenizer")


def test_titles_are_not_split_and_every_character_is_kept(demo_texts):
    titled = [t for t in demo_texts if TITLE_BEFORE_NAME.search(t)]
    sample = titled + demo_texts[:5]
    out = list(split_sentences(sample))
    # measured on the demo corpus: 64 titles before a name ("Mr. Selden", "St. Paul's", "Mr. Doctor"...) in 43
    # documents; spaCy's tokenizer keeps the title and its period one token, so no sentence ends there
    assert len(titled) >= 10 and sum(len(TITLE_BEFORE_NAME.findall(t)) for t in titled) >= 40
    ends = [s for sentences in out for s in sentences if re.search(r"\b(Mr|Mrs|St)\.$", s)]
    assert ends == []
    for sentences, text in zip(out, sample, strict=True):
        assert SPACE.sub("", "".join(sentences)) == SPACE.sub("", text)       # nothing dropped, order kept
        assert all(s == s.strip() and s for s in sentences)
    assert sum(map(len, out)) > 15 * len(sample)                              # split, not passed through
    assert split_one("Is it?  Yes.\n\nMr. Smith went home. ") == ["Is it?", "Yes.", "Mr. Smith went home."]
    assert list(split_sentences(["", "  \n "])) == [[], []]


def test_wordpiece_special_ids_and_transformers_loading(wordpiece, tmp_path):
    from transformers import AutoTokenizer
    tok = wordpiece.tok
    assert [tok.token_to_id(t) for t in BERT_SPECIAL] == list(range(7))
    assert [tok.token_to_id(t) for t in T5_SENTINELS] == list(range(7, 107))
    assert tok.get_vocab_size() == 600 and wordpiece.eod == tok.token_to_id("</s>") == 6
    for directory in (Path(wordpiece.files[0]).parent, tmp_path):      # as trained, and as an export saves it
        if directory == tmp_path:
            load_tokenizer("hf", Path(wordpiece.files[0]).parent).save(tmp_path, max_length=128)
        hf = AutoTokenizer.from_pretrained(str(directory))
        assert type(hf).__name__ in ("BertTokenizer", "BertTokenizerFast")
        assert (hf.pad_token_id, hf.unk_token_id, hf.cls_token_id, hf.sep_token_id, hf.mask_token_id,
                hf.bos_token_id, hf.eos_token_id) == tuple(range(7))
        assert hf.convert_tokens_to_ids("<extra_id_99>") == 106 and len(hf) == 600
        ids = hf("Thou art a villain.", "Mr. Smith.")["input_ids"]
        assert ids[0] == 2 and ids.count(3) == 2 and ids[-1] == 3           # [CLS] A [SEP] B [SEP]
        assert hf.decode(ids, skip_special_tokens=True) == "thou art a villain. mr. smith."   # uncased
    assert (Path(wordpiece.files[0]).parent / "vocab.txt").read_text().split("\n")[:5] == list(BERT_SPECIAL[:5])


def test_sentence_level_indexed_dataset_reads_back_in_megatron(wordpiece, demo_texts, tmp_path, monkeypatch):
    from megatron.core.datasets.indexed_dataset import IndexedDataset  # torch: not at collection time
    docs = demo_texts[100:116] + ["One sentence only."]
    src = tmp_path / "docs.jsonl"
    src.write_text("".join(json.dumps({"id": str(i), "text": t}) + "\n" for i, t in enumerate(docs)))
    monkeypatch.setattr(tokenize_indexed, "MIN_WORKER_BYTES", 1)        # two forked workers even on 60 kB
    inp = InputConfig(paths=[str(src)], format="jsonl")
    cfg = TokenizeConfig(workers=2, batch_size=16, split_sentences=True, append_eod=False)
    summary = tokenize_to_indexed(inp, wordpiece, tmp_path / "one", cfg)
    sentences = [[s for s in doc if wordpiece.encode(s)] for doc in split_sentences(docs)]
    ds = IndexedDataset(str(tmp_path / "one"))
    assert ds.document_indices.tolist() == np.concatenate([[0], np.cumsum([len(s) for s in sentences])]).tolist()
    flat = [s for doc in sentences for s in doc]
    assert len(ds) == len(flat) == summary["sentences"] and summary["documents"] == len(docs)
    assert all(ds[i].tolist() == wordpiece.encode(s) for i, s in enumerate(flat))
    assert summary["single_sentence_documents"] == sum(len(s) == 1 for s in sentences) >= 1
    assert summary["tokens"] == int(ds.sequence_lengths.sum())
    sidecar = json.loads((tmp_path / "one.json").read_text())
    counts = {k: summary[k] for k in tokenize_indexed.SENTENCE_KEYS}
    assert {k: sidecar[k] for k in tokenize_indexed.SENTENCE_KEYS} == counts
    # blend.json carries them ("sentences"); a mix of two sentence-level sources sums them
    source = write_blend(tmp_path / "a" / "blend.json", {"train": [(1.0, str(tmp_path / "one"))]},
                         sentences={"train": counts})
    mixed = json.loads(combine(tmp_path / "mix.json", [(0.5, source), (0.5, source)]).read_text())["sentences"]
    assert mixed == {"train": {k: 2 * v for k, v in counts.items()}}
    # two byte-range shards merged in order: the same bytes, the counts summed; EOD joins each last sentence
    eod = TokenizeConfig(workers=1, split_sentences=True, append_eod=True)
    parts = [tmp_path / f"part{k}" for k in range(2)]
    for k, part in enumerate(parts):
        tokenize_to_indexed(inp, wordpiece, part, eod, shard=(k, 2))
    merged = merge_indexed(parts, tmp_path / "merged")
    tokenize_to_indexed(inp, wordpiece, tmp_path / "pass", eod)
    for ext in ("bin", "idx"):
        assert (tmp_path / f"merged.{ext}").read_bytes() == (tmp_path / f"pass.{ext}").read_bytes()
    whole = IndexedDataset(str(tmp_path / "merged"))
    assert whole.document_indices.tolist() == ds.document_indices.tolist()
    assert merged["single_sentence_documents"] == summary["single_sentence_documents"]
    last = whole.document_indices[1:] - 1
    assert whole.sequence_lengths[last].tolist() == (ds.sequence_lengths[last] + 1).tolist()
    assert all(int(whole[int(i)][-1]) == wordpiece.eod for i in last)


def test_demo_sentences_config_and_bad_tokenizer_settings_are_refused():
    from preprocessing.cli import load_config
    from preprocessing.pipeline import problems
    cfg = load_config("demo-sentences")
    assert (cfg.tokenize.split_sentences, cfg.tokenize.append_eod) == (True, False)
    assert cfg.tokenizer.algorithm == "wordpiece" and cfg.output_dir == "data/demo/wordpiece-sentences"
    assert cfg.input.paths == load_config("demo").input.paths and problems(cfg) == []
    bad = problems(load_config("demo-sentences", ["tokenizer.algorithm=unigram"]))
    assert len(bad) == 1 and "tokenizer.algorithm='unigram'" in bad[0] and "Fix: 'bpe'" in bad[0]
    assert "fim_sentinels=false" in problems(load_config("demo-sentences", ["tokenizer.fim_sentinels=true"]))[0]
