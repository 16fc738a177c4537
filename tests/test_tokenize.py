"""Indexed datasets: readable by megatron-core, token-exact, byte-equal to Megatron-LM's layout."""
import json
import subprocess

import numpy as np
import pytest
from megatron.core.datasets.indexed_dataset import DType, IndexedDataset, IndexedDatasetBuilder

from preprocessing import tokenize_indexed
from preprocessing.config import DedupConfig, InputConfig, PreprocessConfig, TokenizeConfig, TokenizerSpec
from preprocessing.fetch import fetch
from preprocessing.indexed_io import optimal_dtype
from preprocessing.records import BadInput, cut
from preprocessing.stages import merge, tokenize
from preprocessing.tokenize_indexed import jsonl_texts, tokenize_to_indexed
from preprocessing.tokenizer_io import load_tokenizer
from tests.conftest import REPO


@pytest.mark.slow
def test_demo_pipeline_output_opens_and_every_document_matches(demo_data):
    blend = json.loads((demo_data / "blend.json").read_text())
    tok = load_tokenizer("hf", demo_data / "tokenizer")
    assert tok.vocab_size == 4096
    for split in ("train", "valid", "test"):
        ds = IndexedDataset(str(demo_data / f"{split}_text_document"))
        texts = [json.loads(x)["text"] for part in sorted((REPO / "data/demo/work/split").glob(f"{split}.*.jsonl"))
                 for x in open(part)]
        assert len(ds) == len(texts) and ds.index.dtype == np.uint16
        limit = len(texts) if split != "train" else 400
        for i in range(limit):
            assert ds[i].tolist() == tok.encode(texts[i]) + [tok.eod], (split, i)
        assert blend["splits"][split][0]["prefix"] == f"{split}_text_document"
    removed = [json.loads(x) for x in open(REPO / "data/demo/work/normalize_removed.jsonl")]
    milton_dups = {r["id"].split("/")[1] for r in removed if r["id"].startswith("milton/")}
    assert {"comus_gut", "paradise_regained_gut", "poemata_gut", "areopagitica_gut"} & milton_dups or \
        {"comus", "paradiseregained", "poemata", "areopagitica"} & milton_dups


def megatron_lm_style(prefix, docs, tok):
    """What Megatron-LM's tools/preprocess_data.py --append-eod does per document."""
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=DType.optimal_dtype(tok.vocab_size))
    for text in docs:
        ids = tok.encode(text) + [tok.eod]
        builder.add_document(ids, [len(ids)])
    builder.finalize(f"{prefix}.idx")


@pytest.mark.parametrize("kind", ["gpt2", "sentencepiece"])
def test_files_are_byte_equal_to_megatron_lm_layout(tmp_path, kind, monkeypatch):
    """Our numpy writer, with 1 and 2 worker processes, against megatron-core's IndexedDatasetBuilder."""
    path = fetch("gpt2-tokenizer") if kind == "gpt2" else fetch("llama-sp-tokenizer")
    tok = load_tokenizer(kind, path)
    docs = ["Shall I compare thee to a summer's day?", "Thou art more lovely and more temperate:\n\nRough winds",
            "ünïcödé — dashes… and emoji 🎭", "x" * 3000]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    megatron_lm_style(tmp_path / "ref", docs, tok)
    monkeypatch.setattr(tokenize_indexed, "MIN_WORKER_BYTES", 1)         # fork workers even for 4 documents
    for workers in (1, 2):
        tokenize_to_indexed(InputConfig(paths=[str(tmp_path / "in.jsonl")]), tok, tmp_path / f"ours{workers}",
                            TokenizeConfig(batch_size=3, workers=workers))
        for ext in (".bin", ".idx"):
            assert (tmp_path / f"ours{workers}{ext}").read_bytes() == (tmp_path / f"ref{ext}").read_bytes()
    sidecar = json.loads((tmp_path / "ours2.json").read_text())
    assert sidecar["documents"] == 4 and sidecar["dtype"] == "uint16"
    ds = IndexedDataset(str(tmp_path / "ours2"))
    assert [ds[i].tolist() for i in range(len(ds))] == [tok.encode(d) + [tok.eod] for d in docs]


def test_byte_ranges_read_every_line_once_in_order(tmp_path):
    """Any cut of a JSONL file into byte ranges yields each document once, in order; bad lines are
    counted once with their line number."""
    lines = [json.dumps({"text": f"doc {i} " + "word " * (i * 7 % 23)}) for i in range(9)]
    lines[3], lines[6] = "{not json", ""
    path = tmp_path / "in.jsonl"
    path.write_text("\n".join(lines))                                 # no newline after the last line
    want = [json.loads(x)["text"] for x in lines if x.startswith('{"')]
    size = path.stat().st_size
    for n in (1, 2, 3, 5, 16, size):
        bad, got = BadInput(), []
        for k in range(n):
            got += jsonl_texts(cut([(path, 0, size)], k * size // n, (k + 1) * size // n), InputConfig(), bad)
        assert got == want, n
        assert dict(bad.counts) == {"invalid_json": 1} and bad.examples["invalid_json"][0].startswith(f"{path}:4:")


def test_tokenize_shards_merge_to_the_bytes_of_one_pass(tmp_path, monkeypatch):
    """tokenize.shards=1 vs 3 (one shard of each split empty) and 1 vs 2 workers: the same merged files."""
    monkeypatch.setattr(tokenize_indexed, "MIN_WORKER_BYTES", 1)
    split_dir = tmp_path / "work" / "split"
    split_dir.mkdir(parents=True)
    for split, docs in {"train": ["a long first document " * 60, "second", "third one", "fourth"],
                        "valid": ["only a long one " * 40, "and a short one"], "test": ["just one document"]}.items():
        (split_dir / f"{split}.00000-of-00001.jsonl").write_text(                 # the split stage's one part
            "".join(json.dumps({"id": f"{split}{i}", "text": t}) + "\n" for i, t in enumerate(docs)))
    outs = {}
    for shards, workers in ((1, 1), (3, 2)):
        out = tmp_path / f"out{shards}"
        cfg = PreprocessConfig(work_dir=str(tmp_path / "work"), output_dir=str(out), dedup=DedupConfig(shards=1),
                               tokenizer=TokenizerSpec(type="gpt2", path=fetch("gpt2-tokenizer")),
                               tokenize=TokenizeConfig(shards=shards, workers=workers))
        tokenize(cfg, None)
        outs[shards] = merge(cfg, None)
    assert outs[1] == {**outs[3], "blend": outs[1]["blend"]}
    sizes = [json.loads((tmp_path / f"out3/shards/valid_text_document.{k:05d}-of-00003.json").read_text())["documents"]
             for k in range(3)]
    assert sizes == [1, 0, 1]                                            # the empty shard case
    for split in ("train", "valid", "test"):
        for ext in (".bin", ".idx"):
            one, three = (tmp_path / f"out{n}" / f"{split}_text_document{ext}" for n in (1, 3))
            assert one.read_bytes() == three.read_bytes(), (split, ext)
    assert len(IndexedDataset(str(tmp_path / "out3" / "train_text_document"))) == 4
    merged = tmp_path / "out3" / "train_text_document.bin"
    merged.write_bytes(merged.read_bytes()[:-2])                          # a damaged output is rebuilt
    merge(cfg, None)
    assert merged.read_bytes() == (tmp_path / "out1" / "train_text_document.bin").read_bytes()


def test_gpt2_ids_equal_transformers_gpt2_tokenizer():
    from transformers import GPT2TokenizerFast
    path = fetch("gpt2-tokenizer")
    ours = load_tokenizer("gpt2", path)
    ref = GPT2TokenizerFast(vocab=f"{path}/vocab.json", merges=f"{path}/merges.txt")   # transformers 5 keywords
    text = "Hello world! It's 2026 -- the  GPT-2   tokenizer's regex handles 'll and 've."
    assert ours.encode(text) == ref.encode(text) and ours.eod == 50256 and ours.vocab_size == 50257


def test_large_vocab_uses_int32():
    for vocab in (50257, 65499, 65500, 128256):
        assert optimal_dtype(vocab) == DType.optimal_dtype(vocab)
    assert optimal_dtype(128256) == np.int32 and optimal_dtype(50257) == np.uint16


@pytest.mark.slow
def test_make_tokenize_and_make_dedup_interfaces(tmp_path):
    docs = tmp_path / "docs with space.jsonl"
    docs.write_text("".join(json.dumps({"id": f"d{i}", "text": f"document number {i} " * 20}) + "\n" for i in range(5))
                    + json.dumps({"id": "copy", "text": "document number 0 " * 20}) + "\n")
    out = tmp_path / "out dir"
    res = subprocess.run(["make", "-s", "dedup", f"INPUT={docs}", f"OUTPUT={out}"], cwd=REPO, capture_output=True,
                         text=True)
    assert res.returncode == 0, res.stderr[-2000:]
    removed = [json.loads(x) for x in (out / "removed.jsonl").read_text().splitlines()]
    assert removed == [{"id": "copy", "duplicate_of": "d0", "method": "exact", "jaccard": 1.0, "containment": 1.0}]
    assert [json.loads(x)["id"] for x in (out / "kept.jsonl").read_text().splitlines()] == [f"d{i}" for i in range(5)]
    prefix = tmp_path / "tok" / "docs"
    res = subprocess.run(["make", "-s", "tokenize", f"INPUT={out / 'kept.jsonl'}",
                          f"TOKENIZER={fetch('gpt2-tokenizer')}", f"OUTPUT={prefix}"], cwd=REPO, capture_output=True,
                         text=True)
    assert res.returncode == 0, res.stderr[-2000:]
    ds = IndexedDataset(str(prefix))
    assert len(ds) == 5
    mtime = (tmp_path / "tok" / "docs.bin").stat().st_mtime_ns
    subprocess.run(["make", "-s", "tokenize", f"INPUT={out / 'kept.jsonl'}", f"TOKENIZER={fetch('gpt2-tokenizer')}",
                    f"OUTPUT={prefix}"], cwd=REPO, capture_output=True, text=True, check=True)
    assert (tmp_path / "tok" / "docs.bin").stat().st_mtime_ns == mtime       # finished output is not redone


def test_data_preprocessed_again_into_the_same_prefixes_gets_new_dataset_caches(tmp_path):
    """megatron-core keys its index caches by path, split, seed and length: without the files' version in
    the key, a cache built for the old .bin/.idx indexes the new ones (out of range: an IndexError at the
    first step, or silently the wrong tokens). Re-tokenized data must give samples of the new tokens."""
    from preprocessing.blend import write_blend
    from preprocessing.tokenizer_io import train_bpe
    from pretrain.config.compose import load_recipe
    from pretrain.data.datasets import build_datasets
    words = [f"w{i}" for i in range(200)]
    tok = train_bpe([" ".join(words)] * 4, 400, 1, tmp_path / "tok")
    blend = write_blend(tmp_path / "out" / "blend.json", {s: [(1.0, f"{s}_text_document")]
                                                         for s in ("train", "valid", "test")},
                        tokenizer={"vocab_size": tok.vocab_size, "eod": tok.eod})
    job = load_recipe("gpt-tiny", [f"data.blend={blend}", "model.seq_length=16", "schedule.train_iters=2"])

    def preprocess(docs):
        (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
        for split in ("train", "valid", "test"):
            for ext in ("bin", "idx", "json"):           # a rerun of the pipeline writes new files
                (tmp_path / "out" / f"{split}_text_document.{ext}").unlink(missing_ok=True)
            tokenize_to_indexed(InputConfig(paths=[str(tmp_path / "docs.jsonl")]), tok,
                                tmp_path / "out" / f"{split}_text_document", TokenizeConfig(workers=1))
        return set(np.fromfile(tmp_path / "out" / "train_text_document.bin", dtype=np.uint16).tolist())

    preprocess([" ".join(words)] * 40)                            # many long documents
    build_datasets(job, 8, 8, 8)
    preprocess([" ".join(words[:30])] * 6)                        # fewer, shorter ones, other tokens
    again = build_datasets(job, 8, 8, 8)[0]
    fresh = build_datasets(load_recipe("gpt-tiny", [f"data.blend={blend}", "model.seq_length=16",
                                                    "schedule.train_iters=2", f"data.cache_dir={tmp_path / 'fresh'}"]),
                           8, 8, 8)[0]
    assert len(again) == len(fresh)
    for i in range(len(fresh)):
        assert again[i]["tokens"].tolist() == fresh[i]["tokens"].tolist(), i


def test_a_pair_from_two_writes_is_refused_by_the_loader_naming_the_files(tmp_path):
    """A rewrite renames .bin, then .idx (preprocessing/indexed_io.publish_pair): a crash between them leaves
    the new .bin beside the old .idx. megatron-core would read it (tokens of one write cut by the lengths of the
    other); the pair check refuses it, and so does the training loader before it maps anything."""
    from preprocessing.blend import write_blend
    from preprocessing.indexed_io import pair_problem
    from preprocessing.tokenizer_io import train_bpe
    from pretrain.config.compose import load_recipe
    from pretrain.data.datasets import build_datasets
    words = [f"w{i}" for i in range(200)]
    tok = train_bpe([" ".join(words)] * 4, 400, 1, tmp_path / "tok")
    out = tmp_path / "out"
    blend = write_blend(out / "blend.json", {s: [(1.0, f"{s}_text_document")] for s in ("train", "valid", "test")},
                        tokenizer={"vocab_size": tok.vocab_size, "eod": tok.eod})
    for name, docs in (("old", [" ".join(words)] * 40), ("new", [" ".join(words[:30])] * 6)):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
        for split in ("train", "valid", "test"):
            tokenize_to_indexed(InputConfig(paths=[str(tmp_path / f"{name}.jsonl")]), tok,
                                tmp_path / name / f"{split}_text_document", TokenizeConfig(workers=1))
    for split in ("train", "valid", "test"):
        for ext in ("bin", "idx"):
            (out / f"{split}_text_document.{ext}").write_bytes((tmp_path / "old" / f"{split}_text_document.{ext}")
                                                                .read_bytes())
    assert pair_problem(out / "train_text_document") is None
    (out / "train_text_document.bin").write_bytes((tmp_path / "new" / "train_text_document.bin").read_bytes())
    problem = pair_problem(out / "train_text_document")           # the crash: new .bin, old .idx
    assert f"{out / 'train_text_document.bin'} holds" in problem and "different writes" in problem
    with pytest.raises(ValueError, match="train_text_document.bin holds .* different writes"):
        job = load_recipe("gpt-tiny", [f"data.blend={blend}", "model.seq_length=16", "schedule.train_iters=2"])
        build_datasets(job, 8, 8, 8)
    (out / "valid_text_document.idx").unlink()
    assert pair_problem(out / "valid_text_document") == f"{out / 'valid_text_document.idx'} missing"
