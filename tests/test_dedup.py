"""The sharded MinHash dedup engine: datasketch-equal signatures, byte shards that read each line once,
output bytes independent of shard and bucket-task counts, per-shard resume that checks its outputs.
(Recall and precision on planted corpora: tests/test_dedup_quality.py.)"""
import gzip
import json
import re

import numpy as np
import pytest
from datasketch import MinHash

from preprocessing.bench.planted import planted_corpus
from preprocessing.config import DedupConfig, InputConfig
from preprocessing.dedup.minhash import permutations, shingle_hashes, shingle_hashes_batch, signatures, words_batch
from preprocessing.dedup.run import run_dedup
from preprocessing.dedup.shards import DocShards
from preprocessing.records import BadInput, read_documents
from tests.test_bad_input import lines_with_bad_input

TEXTS = ["To be, or not to be, that is the question: whether 'tis nobler in the mind to suffer",
         "Naïve café — ÉCOLE d'été, straße; 日本語 テキスト and   some_snake_case 42 words",
         "two words", "", "?!", "x " * 40]


def test_shingles_and_signatures_equal_datasketch():
    words, counts = words_batch(TEXTS)
    assert counts.tolist() == [len(re.findall(r"\w+", t.lower())) for t in TEXTS]   # the regex's words
    hashes, offsets = shingle_hashes_batch(TEXTS, 3)
    for i, text in enumerate(TEXTS):
        one = shingle_hashes(text, 3)
        assert np.array_equal(one, hashes[offsets[i]:offsets[i + 1]]) and np.all(np.diff(one.astype(np.int64)) > 0)
    assert offsets[4] - offsets[3] == 1 and offsets[3] - offsets[2] == 1     # short and empty: one shingle
    assert np.array_equal(shingle_hashes("TWO Words", 3), shingle_hashes(TEXTS[2], 3))       # lowercased
    perms = permutations(128, 7)
    sig = signatures(hashes, perms, offsets, block=16)                       # blocks split documents apart
    for i in range(len(TEXTS)):
        m = MinHash(num_perm=128, seed=7, hashfunc=int)
        m.update_batch(hashes[offsets[i]:offsets[i + 1]].tolist())
        assert np.array_equal(m.hashvalues, sig[i])


def test_byte_shards_read_every_document_once_in_input_order(tmp_path):
    """Bad lines, blank lines, a last line without newline, missing ids (file:line) and two files: the
    shards' documents together are read_documents' documents, for any shard count."""
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a.write_bytes(b"\n".join(lines_with_bad_input()) + b"\n\n" + json.dumps({"text": "no id here"}).encode() + b"\n")
    b.write_bytes(b"\n".join(json.dumps({"id": f"b{i}", "text": "t" * i}).encode() for i in range(1, 30)))
    inp = InputConfig(paths=[str(a), str(b)])
    ref_bad = BadInput()
    ref = [(d.id, d.record) for d in read_documents(inp.paths, bad=ref_bad)]
    assert ref[2] == ("a.jsonl:10", {"text": "no id here"})
    for shards in (1, 2, 3, 7, 40):
        layout, bad, got = DocShards.of(inp, DedupConfig(shards=shards)), BadInput(), []
        assert layout.by_bytes
        for k in range(shards):
            got += [(key, d.id, d.record) for key, d, _, _ in layout.documents(k, inp, bad)]
        assert [g[1:] for g in got] == ref and [g[0] for g in got] == sorted(g[0] for g in got)
        assert bad.counts == ref_bad.counts and bad.good == ref_bad.good
        assert sorted(bad.examples["invalid_json"]) == sorted(ref_bad.examples["invalid_json"])


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    path = tmp_path_factory.mktemp("dedup") / "planted.jsonl"
    planted_corpus(path, n_docs=600, seed=3)
    return path


def _run(corpus, out, **kw) -> tuple:
    run_dedup(InputConfig(paths=[str(corpus)]), DedupConfig(workers=1, **kw), out)
    return (out / "kept.jsonl").read_bytes(), (out / "removed.jsonl").read_bytes()


def test_same_bytes_for_any_shard_and_bucket_task_count(corpus, tmp_path):
    one = _run(corpus, tmp_path / "s1", shards=1, bucket_tasks=1)
    assert _run(corpus, tmp_path / "s4", shards=4, bucket_tasks=3) == one
    kept, removed = one[0].decode().splitlines(), [json.loads(x) for x in one[1].decode().splitlines()]
    gone = {r["id"] for r in removed}
    lines = corpus.read_text().splitlines()
    assert kept == [x for x in lines if json.loads(x)["id"] not in gone]    # input lines unchanged, input order
    assert len(removed) > 50 and {r["method"] for r in removed} >= {"exact", "jaccard"}
    kept_ids = {json.loads(x)["id"] for x in kept}
    assert all(r["duplicate_of"] in kept_ids for r in removed)               # no cluster loses all its members
    assert all(set(r) == {"id", "duplicate_of", "method", "jaccard", "containment"} for r in removed)
    gz = tmp_path / "planted.jsonl.gz"                                        # not seekable: i % S == k fallback
    gz.write_bytes(gzip.compress(corpus.read_bytes()))
    run_dedup(InputConfig(paths=[str(gz)]), DedupConfig(workers=1, shards=3, bucket_tasks=2), tmp_path / "gz")
    assert (tmp_path / "gz" / "removed.jsonl").read_bytes() == one[1]
    assert [json.loads(x) for x in (tmp_path / "gz" / "kept.jsonl").read_text().splitlines()] == \
        [json.loads(x) for x in kept]


def test_finished_shards_are_not_redone_and_damaged_outputs_are_rebuilt(corpus, tmp_path, capsys):
    out = tmp_path / "out"
    ref = _run(corpus, out, shards=3, bucket_tasks=2)
    files = {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()}
    assert _run(corpus, out, shards=3, bucket_tasks=2) == ref
    assert {p: p.stat().st_mtime_ns for p in files} == files                 # nothing redone
    (out / "signatures" / "00001-of-00003" / "shingles.u32").unlink()        # one shard's output lost
    (out / "buckets" / "pairs-00000-of-00002.npy").write_bytes(b"")          # one task's output truncated
    capsys.readouterr()
    assert _run(corpus, out, shards=3, bucket_tasks=2) == ref
    err = capsys.readouterr().err
    assert "redoing signatures-00001-of-00003" in err and "redoing buckets-00000-of-00002" in err
    same = [p for p in files if p.exists() and p.stat().st_mtime_ns == files[p]]
    assert out / "signatures" / "00000-of-00003" / "bands.npy" in same        # the finished shards stand
    assert out / "signatures" / "00002-of-00003" / "bands.npy" in same
    assert out / "signatures" / "00001-of-00003" / "bands.npy" not in same


def test_stage_steps_one_task_at_a_time_as_slurm_runs_them(corpus, tmp_path):
    inp, cfg = InputConfig(paths=[str(corpus)]), DedupConfig(workers=1, shards=2, bucket_tasks=2)
    run_dedup(inp, cfg, tmp_path / "arr", step="signatures", shard=0)
    with pytest.raises(FileNotFoundError, match="'signatures' task 1 has not finished"):
        run_dedup(inp, cfg, tmp_path / "arr", step="buckets", shard=0)
    for step, tasks in (("signatures", 2), ("buckets", 2), ("verify", 2), ("clusters", 1), ("write", 2)):
        for k in range(tasks):
            run_dedup(inp, cfg, tmp_path / "arr", step=step, shard=k if tasks > 1 else None)
    parts = b"".join((tmp_path / "arr" / "parts" / f"kept-0000{k}-of-00002.jsonl").read_bytes() for k in (0, 1))
    assert parts == _run(corpus, tmp_path / "all", shards=1, bucket_tasks=1)[0]
