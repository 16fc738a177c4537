"""Document provenance through tokenization (preprocessing/provenance.py): every document of every split's
.bin/.idx maps back to its input file and line, its record id, and the stages that kept or edited it; a
quarantine file takes named documents out of the next preprocessing run; the data identity covers the map."""
import json
import random
from pathlib import Path

import numpy as np
import pytest

from preprocessing import provenance
from preprocessing.cli import load_config
from preprocessing.indexed_io import read_index
from preprocessing.pipeline import run_pipeline
from preprocessing.tokenizer_io import load_tokenizer

WORDS = ("the king rode out at dawn and the men of the north followed him across the river to the old "
         "castle where the queen waited with her court and her counsel").split()


def corpus(path: Path, n: int = 60) -> list:
    """n English-like documents (one with an e-mail address the PII transform replaces), three planted junk
    documents at known lines, one blank line (lines count it); returns the records by line number."""
    rng = random.Random(0)
    lines = []
    for i in range(n):
        text = " ".join(rng.choice(WORDS) for _ in range(80 + i))
        if i == 7:
            text += " write to someone@mailhost.org today"
        lines.append({"id": f"doc{i}", "text": text})
    junk = [{"id": "junk-repeat", "text": "zz " * 300},
            {"id": "junk-lang", "text": "Der schnelle braune Fuchs springt über den faulen Hund " * 20},
            {"id": "junk-bytes", "text": "".join(chr(rng.randrange(0x4E00, 0x9FFF)) for _ in range(400))}]
    for at, rec in zip((10, 30, 50), junk, strict=True):
        lines.insert(at, rec)
    body = [json.dumps(r, ensure_ascii=False) for r in lines]
    body.insert(3, "")
    path.write_text("\n".join(body) + "\n", encoding="utf-8")
    return {i + 1: json.loads(line) for i, line in enumerate(body) if line}


def configure(src: Path, root: Path, *extra: str):
    return load_config("demo", [f"input.paths=['{src}']", "fetch=[]", f"work_dir='{root}/work'",
                                f"output_dir='{root}/out'", f"tokenizer.path='{root}/out/tokenizer'",
                                "tokenizer.vocab_size=300", "split.valid_fraction=0.1", "split.test_fraction=0.1",
                                "dedup.enabled=false", "filters.enabled=false", "decontaminate.enabled=false",
                                "filters.shards=2", *extra])


def split_documents(out: Path, split: str):
    prefix = out / f"{split}_text_document"
    _, lengths, _ = read_index(f"{prefix}.idx")
    return prefix, provenance.read(prefix), lengths


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("prov")
    src = root / "corpus.jsonl"
    records = corpus(src)
    run_pipeline(configure(src, root))
    return root, src, records


def small_job(root):
    """gpt-tiny over the `built` blend at 64 tokens, 8 samples a step, and its train dataset (32 samples)."""
    from pretrain.config.compose import load_recipe
    from pretrain.data.datasets import build_datasets
    out = root / "out"
    job = load_recipe("gpt-tiny", [f"data.blend={out / 'blend.json'}", f"data.tokenizer.path={out / 'tokenizer'}",
                                   "model.seq_length=64", "schedule.train_iters=4", "batch.global_batch_size=8",
                                   "batch.micro_batch_size=4", f"data.cache_dir={root / 'cache'}"])
    return job, build_datasets(job, 32, 8, 8)[0]


def test_every_document_maps_to_its_line_and_the_stages_that_kept_it(built):
    root, src, records = built
    tok = load_tokenizer("hf", root / "out" / "tokenizer")
    seen = 0
    for split in ("train", "valid", "test"):
        prefix, prov, lengths = split_documents(root / "out", split)
        assert prov is not None and len(prov) == len(lengths) > 0
        tokens = np.fromfile(f"{prefix}.bin", dtype=np.uint16)
        ends = np.cumsum(lengths)
        for i in range(len(prov)):
            e = prov.entry(i)
            rec = records[e["line"]]
            assert e["source"] == str(src) and e["id"] == rec["id"]
            assert e["kept_by"] == ["normalize + exact dedup", "filter", f"split:{split}"]
            ids = tokens[ends[i] - lengths[i]:ends[i] - 1].tolist()
            if rec["id"] == "doc7":          # the PII transform of the filter pass replaced the address
                assert e["edited_by"] == ["filter"] and "someone@mailhost.org" not in tok.decode(ids)
            else:
                assert e["edited_by"] == [] and tok.decode(ids) == rec["text"]
        seen += len(prov)
    assert seen == len(records) == 63
    size = Path(f"{root}/out/train_text_document.prov").stat().st_size
    _, prov, _ = split_documents(root / "out", "train")
    ids = sum(len(prov.record_id(i)) for i in range(len(prov)))
    header = int.from_bytes(Path(f"{root}/out/train_text_document.prov").read_bytes()[8:12], "little")
    assert size == len(provenance.MAGIC) + 4 + header + len(prov) * provenance.BYTES_PER_DOCUMENT + ids


def test_quarantine_by_id_and_by_line_leaves_the_documents_out(built, tmp_path, capsys):
    root, src, records = built
    line_of = {r["id"]: n for n, r in records.items()}
    held = tmp_path / "quarantine.txt"
    held.write_text(f"# planted junk\njunk-repeat\n{src}:{line_of['junk-lang']}\njunk-bytes  # by id\n")
    run_pipeline(configure(src, root, f"input.quarantine='{held}'"))
    assert "quarantined" in capsys.readouterr().err
    ids = [prov.record_id(i) for split in ("train", "valid", "test")
           for prov in [split_documents(root / "out", split)[1]] for i in range(len(prov))]
    assert len(ids) == 60 and not {"junk-repeat", "junk-lang", "junk-bytes"} & set(ids)
    removed = [json.loads(x) for x in (root / "work" / "normalize_removed.jsonl").read_text().splitlines()]
    assert sorted(r["id"] for r in removed if r["method"] == "quarantine") == ["junk-bytes", "junk-lang",
                                                                              "junk-repeat"]
    assert provenance.read(root / "out" / "train_text_document").header["kept_by"][1] == "quarantine"


def test_a_missing_quarantine_file_names_the_field(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"input.quarantine / data.quarantine"):
        provenance.read_quarantine(tmp_path / "nope.txt")


def test_a_steps_samples_map_to_their_documents_tokens_and_lines(built):
    """attribution.segments reads megatron-core's indices as GPTDataset does: the documents' tokens, cut where the
    segments say, are the sample's tokens; each names its input line. document_losses puts target t + 1 on the
    document filling position t + 1."""
    from pretrain.data import attribution
    from pretrain.data.datasets import StepBatches
    root, src, records = built
    job, train = small_job(root)
    source = StepBatches(train, 8, 0, 1)
    tokens = {}
    positions = attribution.step_positions(8, 8)              # step 2
    layout = [attribution.segments(train, source.index(p)) for p in positions]
    for p, parts in zip(positions, layout, strict=True):
        sample = train[source.index(p)]
        whole = sample["tokens"].tolist() + sample["labels"].tolist()[-1:]
        assert sum(s.length for s in parts) == len(whole) == 65 and parts[0].start == 0
        for seg in parts:
            if seg.prefix not in tokens:
                tokens[seg.prefix] = (np.fromfile(f"{seg.prefix}.bin", dtype=np.uint16),
                                      np.concatenate([[0], np.cumsum(read_index(f"{seg.prefix}.idx")[1])]))
            flat, starts = tokens[seg.prefix]
            doc = flat[starts[seg.document]:starts[seg.document + 1]].tolist()
            piece = whole[seg.start:seg.start + seg.length]
            assert any(doc[o:o + len(piece)] == piece for o in range(len(doc) - len(piece) + 1)), seg
    rows = attribution.explain(layout, positions)
    assert {r["id"] for r in rows} <= {r["id"] for r in records.values()}
    assert all(records[r["line"]]["id"] == r["id"] and r["source"] == str(src) for r in rows)
    assert sum(r["tokens"] for r in rows) == 8 * 65
    # losses: 1.0 on every target, 5.0 on those of the first sample's last document
    losses, mask = np.ones((8, 64)), np.ones((8, 64))
    second = layout[0][-1]
    losses[0, max(second.start - 1, 0):second.start + second.length - 1] = 5.0
    per_doc = attribution.document_losses(layout, losses, mask)
    assert sum(n for _, n in per_doc.values()) == 8 * 64
    ranked = attribution.explain(layout, positions, per_doc)
    assert (ranked[0]["prefix"], ranked[0]["document"]) == (second.prefix, second.document)
    assert ranked[0]["loss"] > 1.0 and all(r["loss"] in (1.0, None) for r in ranked[1:])


def planted(built):
    """The tokenizer, a gpt-tiny job over the `built` blend (data cache under `cache`), and five eval items: 0 copies
    13 words of a training document, 2 has a 10-word choice of one; 1, 3 (valid/test text) and 4 (12 words) don't."""
    from pretrain.config.compose import load_recipe
    root, src, records = built
    out = root / "out"
    _, prov, _ = split_documents(out, "train")
    train_words = records[prov.entry(5)["line"]]["text"].split()
    heldout = [r["text"] for r in records.values() if r["id"] not in {prov.record_id(i) for i in range(len(prov))}]
    docs = [{"input": "Which is right? " + " ".join(train_words[20:33]), "choices": ["yes", "no"], "gold": 0},
            {"input": "a question of its own about seven different things", "choices": ["a", "b"], "gold": 1},
            {"input": "q", "choices": ["first", " ".join(train_words[40:50])], "gold": 0},     # a 10-word choice
            {"input": " ".join(heldout[0].split()[:30]), "choices": ["x", "y"], "gold": 0},   # valid/test text only
            {"input": " ".join(train_words[20:32]) + " and then something else", "choices": ["p"], "gold": 0}]

    def job(blend=out / "blend.json", cache=root / "cache"):
        return load_recipe("gpt-tiny", [f"data.blend={blend}", f"data.tokenizer.path={out / 'tokenizer'}",
                                        f"data.cache_dir={cache}", "schedule.train_iters=2"])
    return load_tokenizer("hf", out / "tokenizer"), job, docs


class CountingDecode:
    """The tokenizer's decode, counting the documents it decoded."""

    def __init__(self, tok):
        self.tok, self.calls = tok, 0

    def __call__(self, ids):
        self.calls += 1
        return self.tok.decode(ids)


def test_planted_contaminated_items_are_exactly_the_excluded_ones(built):
    """Eval items that copy 13 words of a training document (or a whole 8..12-word text of one) are excluded, and
    only they; the clean score is the mean over the rest; the cached answer is reused; mock data excludes none."""
    from pretrain.config.compose import load_recipe
    from pretrain.observability.contamination import clean_scores, excluded_items
    root = built[0]
    tok, make_job, docs = planted(built)
    job = make_job()
    excluded = excluded_items(job, {"planted": docs}, tok.decode, tok.eod)["planted"]
    assert excluded == [0, 2]            # item 4 shares 12 words only; item 3 is held-out text
    cache = list((root / "cache" / "contamination").glob("planted-*.json"))
    assert len(cache) == 1 and json.loads(cache[0].read_text())["excluded"] == [0, 2]
    assert excluded_items(job, {"planted": docs}, lambda ids: 1 / 0, tok.eod) == {"planted": [0, 2]}   # the record
    scores = clean_scores({"acc": [1.0, 0.0, 1.0, 1.0, 0.0]}, excluded)
    assert scores == {"acc_clean": pytest.approx(1 / 3), "excluded": 2}
    mock = load_recipe("gpt-tiny", ["data.mock=true"])
    assert excluded_items(mock, {"planted": docs}, tok.decode, tok.eod) == {"planted": []}
    clean = [d for i, d in enumerate(docs) if i not in excluded]
    assert excluded_items(job, {"clean": clean}, tok.decode, tok.eod) == {"clean": []}


def test_a_changed_train_split_or_task_is_checked_again(built, tmp_path):
    """The record is keyed by the train .idx digests and the task's items: new items, or other bytes under the
    same train prefix, decode the split again; unchanged ones decode nothing."""
    import shutil

    from preprocessing.blend import write_blend
    from pretrain.observability.contamination import excluded_items
    out = built[0] / "out"
    tok, make_job, docs = planted(built)
    data = tmp_path / "data"
    data.mkdir()
    for ext in ("bin", "idx"):
        shutil.copy(out / f"train_text_document.{ext}", data / f"train_text_document.{ext}")
    blend = write_blend(tmp_path / "blend.json", {s: [(1.0, str(data / "train_text_document"))]
                                                  for s in ("train", "valid", "test")})
    job, documents = make_job(blend, tmp_path / "cache"), len(read_index(data / "train_text_document.idx")[1])
    decode = CountingDecode(tok)
    assert excluded_items(job, {"planted": docs}, decode, tok.eod) == {"planted": [0, 2]}
    assert decode.calls == documents
    assert excluded_items(job, {"planted": docs}, decode, tok.eod) == {"planted": [0, 2]}
    assert decode.calls == documents                                       # recorded: nothing decoded
    assert excluded_items(job, {"planted": docs[2:]}, decode, tok.eod) == {"planted": [0]}     # other items
    assert decode.calls == 2 * documents
    for ext in ("bin", "idx"):                 # the same train prefix now holds the valid split's documents
        shutil.copy(out / f"valid_text_document.{ext}", data / f"train_text_document.{ext}")
    valid_documents = len(read_index(data / "train_text_document.idx")[1])
    assert excluded_items(job, {"planted": docs}, decode, tok.eod) == {"planted": []}
    assert decode.calls == 2 * documents + valid_documents
    assert len(list((tmp_path / "cache" / "contamination").glob("planted-*.json"))) == 3


def test_the_ranks_parts_of_the_documents_are_the_whole_in_order(built):
    """indexed_texts' contiguous parts across several prefixes (and more parts than documents), joined, are every
    document once in order: what the ranks' check decodes between them."""
    from preprocessing.contamination import indexed_texts
    out = built[0] / "out"
    prefixes = [str(out / f"{split}_text_document") for split in ("valid", "train", "test")]
    whole = list(indexed_texts(prefixes, tuple, 0))
    assert len(whole) == sum(len(read_index(f"{p}.idx")[1]) for p in prefixes)
    for parts in (2, 3, 7, len(whole) + 3):
        assert [d for part in range(parts) for d in indexed_texts(prefixes, tuple, 0, part, parts)] == whole


def excluded_on_a_rank(rank, port, out, built, cache):
    """(tests/rank_pool.py task) Both planted tasks' excluded items from a 2-rank gloo group, twice, and how many
    documents this rank decoded each time."""
    import torch.distributed as dist

    from pretrain.observability.contamination import excluded_items
    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    tok, make_job, docs = planted(built)
    job, decode = make_job(cache=cache), CountingDecode(tok)
    tasks = {"planted": docs, "clean": docs[1:2]}
    mine = out[rank] = {"first": excluded_items(job, tasks, decode, tok.eod), "decoded": decode.calls}
    mine.update(again=excluded_items(job, tasks, decode, tok.eod), decoded_again=decode.calls - mine["decoded"])


@pytest.mark.slow           # 2 spawned rank processes (tests/rank_pool.py) importing megatron-core
@pytest.mark.beside_training
def test_two_ranks_decode_the_train_split_once_between_them_and_agree(built, tmp_path):
    """The in-loop eval's check on 2 gloo ranks: each decodes its own half of the train documents (together each
    document exactly once, both tasks in one pass), both get the single process's answer, rank 0 records it; a
    second evaluation decodes nothing."""
    from tests.megatron_harness import spawn
    ranks = spawn(excluded_on_a_rank, built, tmp_path / "cache")
    assert sorted(ranks) == [0, 1]
    documents = len(read_index(built[0] / "out" / "train_text_document.idx")[1])
    assert [r["first"] for r in ranks.values()] == [{"planted": [0, 2], "clean": []}] * 2
    assert [r["again"] for r in ranks.values()] == [{"planted": [0, 2], "clean": []}] * 2
    assert sorted(r["decoded"] for r in ranks.values()) == [documents // 2, documents - documents // 2]
    assert [r["decoded_again"] for r in ranks.values()] == [0, 0]
    assert len(list((tmp_path / "cache" / "contamination").glob("*.json"))) == 2


def test_data_quarantine_masks_the_named_documents_loss_in_every_sample(built, tmp_path):
    """A training run's data.quarantine: every target of a named document (by id or file:line) has loss mask 0,
    every other target keeps 1; the samples and their order are unchanged."""
    from pretrain.data import attribution
    from pretrain.data.datasets import StepBatches, train_prefixes
    root, src, records = built
    job, train = small_job(root)
    plain = StepBatches(train, 8, 0, 1)
    layout = [attribution.segments(train, plain.index(p)) for p in range(8)]
    prefix, prov = layout[0][0].prefix, provenance.read(layout[0][0].prefix)
    named = {layout[0][0].document, layout[3][-1].document}
    first, second = sorted(named)
    held = tmp_path / "q.txt"
    held.write_text(f"{prov.record_id(first)}\n{prov.entry(second)['source']}:{prov.entry(second)['line']}\n")
    quarantine = attribution.Quarantine(str(held), train_prefixes(job))
    assert quarantine.documents == {(prefix, d) for d in named}
    masked = StepBatches(train, 8, 0, 1)
    masked.quarantine = quarantine
    [a], [b] = plain.micro_batches(0, 8), masked.micro_batches(0, 8)
    assert a["tokens"].equal(b["tokens"])
    expected = a["loss_mask"].clone()
    for s, parts in enumerate(layout):
        for seg in parts:
            if seg.document in named:
                expected[s, max(seg.start - 1, 0):seg.start + seg.length - 1] = 0
    assert b["loss_mask"].equal(expected) and quarantine.masked_tokens == int((a["loss_mask"] - expected).sum()) > 0


def test_make_eval_and_the_inloop_scorer_report_the_clean_subset(built, tmp_path):
    """evals/harness.clean_subset on lm-eval's logged samples (out of doc_id order), and downstream.per_item whose
    means are `accuracy`'s: the clean metrics leave out exactly the contaminated items."""
    from evals.harness import clean_subset
    from pretrain.config.compose import load_recipe
    from pretrain.observability.downstream import Task, accuracy, per_item
    root, src, records = built
    out = root / "out"
    tok = load_tokenizer("hf", out / "tokenizer")
    tok.save(tmp_path / "hf")                                # what the export writes beside the weights
    _, prov, _ = split_documents(out, "train")
    words = records[prov.entry(2)["line"]]["text"].split()
    docs = [{"q": "plain words that appear nowhere at all in it", "choices": ["a", "b"], "gold": 0},
            {"q": " ".join(words[5:25]), "choices": ["a", "b"], "gold": 1},
            {"q": "another question with nothing to hide from you", "choices": ["a", "b"], "gold": 0}]
    job = load_recipe("gpt-tiny", [f"data.blend={out / 'blend.json'}", f"data.tokenizer.path={out / 'tokenizer'}",
                                   f"data.cache_dir={tmp_path / 'cache'}", "schedule.train_iters=2"])
    samples = [{"doc_id": i, "doc": docs[i], "acc": acc, "acc_norm": 1.0 - acc}
               for i, acc in ((2, 1.0), (0, 0.0), (1, 1.0))]
    clean = clean_subset(job, tmp_path / "hf", "t", samples, {"acc": 2 / 3, "acc_stderr": 0.3, "acc_norm": 1 / 3})
    assert clean == {"acc_clean": 0.5, "acc_norm_clean": 0.5, "excluded": 1}
    task = Task("t", docs, "q", "choices", "gold", " ")
    lls = [[-1.0, -2.0], [-1.0, -2.0], [-3.0, -2.0]]
    items = per_item(task, lls)
    assert items == {"acc": [1.0, 0.0, 0.0], "acc_norm": [1.0, 0.0, 0.0]}
    assert accuracy(task, lls)["acc"] == pytest.approx(sum(items["acc"]) / 3)
