"""Extending preprocessing without touching the project: a quality filter and a stage defined and
registered here are selected by config overrides and run inside the real pipeline; and the
layering that keeps preprocessing/ free of pretrain/ and launch/."""
import dataclasses
import json
import os
import subprocess
from pathlib import Path

import pytest

from common.config import ConfigError
from preprocessing.cli import load_config
from preprocessing.config import PreprocessConfig
from preprocessing.fetch import fetch
from preprocessing.filters import FILTERS, FilterDoc, QualityFilter, register_filter
from preprocessing.pipeline import run_pipeline
from preprocessing.stages import register_stage
from preprocessing.tokenizer_io import load_tokenizer
from tests.conftest import PY, REPO

BANNED = "sword"


@register_filter("test_banned_word")
def banned_word(cfg):
    """Drop documents that use a word (`filters.params.banned_word`), case and punctuation aside."""
    word = cfg.params.get("banned_word", BANNED)
    return [("banned_word", lambda d: word not in words_of(d))]


def words_of(doc: FilterDoc) -> set:
    return {w.lower().strip(".,;:!?'\"()[]-") for w in doc.words}


@register_stage("test_split_stats")
def split_stats(cfg, shard=None):
    """A stage of our own between filter and tokenize: documents per split -> <work_dir>/split_stats.json."""
    work = Path(cfg.work_dir)
    counts = {s: sum(len(p.read_text().splitlines()) for p in (work / "split").glob(f"{s}.*.jsonl"))
              for s in ("train", "valid", "test")}
    (work / "split_stats.json").write_text(json.dumps(counts))
    return counts


@pytest.fixture(scope="module")
def small_corpus(tmp_path_factory):
    """Every 10th document of the demo corpus (Shakespeare and Milton, ~310 documents)."""
    raw = Path(fetch("shakespeare"))
    path = tmp_path_factory.mktemp("corpus") / "corpus.jsonl"
    path.write_text("".join(line for i, line in enumerate(raw.read_text().splitlines(keepends=True)) if i % 10 == 0))
    return path


def overrides(corpus: Path, root: Path) -> list:
    return [f"input.paths=['{corpus}']", "fetch=[]", f"work_dir='{root}/work'", f"output_dir='{root}/out'",
            f"tokenizer.path='{root}/out/tokenizer'", "tokenizer.vocab_size=1024", "split.valid_fraction=0.1",
            "split.test_fraction=0.1", "dedup.workers=1", "dedup.shards=2",
            "filters.names=[gopher,test_banned_word]", f"+filters.params.banned_word={BANNED}",
            "stages=[prepare,signatures,buckets,verify,clusters,write,filter,split,test_split_stats,tokenizer,tokenize,"
            "merge]"]


def check_outputs(root: Path) -> int:
    """The filter's rejects are counted as skipped under its rule and appear in no output; returns their count."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset  # torch: not at collection time
    work, out = root / "work", root / "out"
    texts = {r["id"]: r["text"] for r in map(json.loads, (work / "normalized.jsonl").read_text().splitlines())}
    parts = sorted((work / "filter").glob("removed-*-of-00002.jsonl"))       # one per dedup part
    rejected = [r["id"] for p in parts for r in map(json.loads, p.read_text().splitlines())
                if r["reason"] == "banned_word"]
    assert len(parts) == 2 and rejected and all(BANNED in words_of(FilterDoc.of(texts[i])) for i in rejected)
    assert sum(json.loads(m.read_text())["removed by rule"].get("banned_word", 0)
               for m in (work / "filter").glob(".done-filter-*.json")) == len(rejected)
    kept = [json.loads(x) for p in sorted((work / "filter").glob("part-*.jsonl")) for x in p.read_text().splitlines()]
    assert kept and not {r["id"] for r in kept} & set(rejected)
    assert not any(BANNED in words_of(FilterDoc.of(r["text"])) for r in kept)
    tok, documents = load_tokenizer("hf", out / "tokenizer"), 0
    for split in ("train", "valid", "test"):
        ids = {r["id"] for p in (work / "split").glob(f"{split}.*.jsonl")
               for r in map(json.loads, p.read_text().splitlines())}
        assert not ids & set(rejected)
        ds = IndexedDataset(str(out / f"{split}_text_document"))
        documents += len(ds)
        for k in range(len(ds)):
            assert BANNED not in words_of(FilterDoc.of(tok.decode(ds[k].tolist()[:-1])))
    assert documents == len(kept) == sum(json.loads((work / "split_stats.json").read_text()).values())
    return len(rejected)


def test_a_filter_registered_in_a_test_module_runs_in_the_pipeline(small_corpus, tmp_path, capsys):
    cfg = load_config("demo", overrides(small_corpus, tmp_path))
    assert cfg.filters.names == ["gopher", "test_banned_word"] and "test_banned_word" in FILTERS
    result = run_pipeline(cfg)
    assert json.loads(Path(result["blend"]).read_text())["tokenizer"]["vocab_size"] == 1024
    dropped = check_outputs(tmp_path)
    err = capsys.readouterr().err
    assert "removed by rule: banned_word" in err                    # the stage's summary names the rule
    assert "dedup -> " in err and "removed near-dup" in err and "lsh bands x rows" in err   # the dedup summary
    assert dropped >= 5


def test_unknown_filter_and_stage_names_fail_listing_the_registered_ones(small_corpus, tmp_path):
    cfg = load_config("demo", overrides(small_corpus, tmp_path) + ["filters.names=[gopher,nope]", "stages=[prepare,x]"])
    with pytest.raises(ConfigError) as err:
        run_pipeline(cfg)
    text = str(err.value)
    assert "filters.names: 'nope' is not a registered quality filter. Registered: [" in text and "'gopher'" in text
    assert "'test_banned_word'" in text and "register_filter('nope')" in text
    assert "stages: 'x' is not a registered preprocessing stage" in text and "'tokenize'" in text
    assert not (tmp_path / "work").exists()                         # checked before anything ran


def test_imports_register_filters_from_a_module_named_in_the_config(tmp_path, monkeypatch):
    (tmp_path / "site_filters_for_test.py").write_text(
        "from preprocessing.filters import register_filter\n\n"
        "@register_filter('site_min_chars')\n"
        "def site_min_chars(cfg):\n"
        "    return [('short', lambda d: len(d.text) >= cfg.params.get('min_chars', 10))]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = load_config("default", ["imports=[site_filters_for_test]", "filters.names=[site_min_chars]"])
    assert "site_min_chars" in FILTERS
    qf = QualityFilter(cfg.filters)
    assert qf.reject_reason("tiny") == "short" and qf.reject_reason("long enough text") is None
    with pytest.raises(ConfigError, match=r"imports\[0\]='no_such_module_x' cannot be imported"):
        load_config("default", ["imports=[no_such_module_x]"])


@pytest.mark.slow
def test_make_preprocess_imports_the_filter_module_in_its_own_process(small_corpus, tmp_path):
    """The path SLURM jobs take: a fresh process finds the filter through the config's `imports`."""
    over = " ".join(overrides(small_corpus, tmp_path) + [f"imports=[{__name__}]"])
    res = subprocess.run(["make", "-s", "preprocess", "PREPROCESS=demo", f"OVERRIDES={over}"], cwd=REPO,
                         capture_output=True, text=True, timeout=600, env=dict(os.environ, DRY_RUN="false"))
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert check_outputs(tmp_path) >= 5


def test_import_preprocessing_loads_nothing_from_pretrain_or_launch():
    code = ("import importlib, pkgutil, sys, preprocessing\n"
            "for m in pkgutil.iter_modules(preprocessing.__path__):\n"
            "    importlib.import_module('preprocessing.' + m.name)\n"
            "print(sorted(k for k in sys.modules if k.split('.')[0] in ('pretrain', 'launch')))")
    res = subprocess.run([PY, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert res.stdout.strip() == "[]", res.stdout


def test_every_preprocessing_config_field_has_a_one_line_doc():
    def walk(cls, prefix=""):
        for f in dataclasses.fields(cls):
            yield prefix + f.name, f
            if dataclasses.is_dataclass(f.default_factory if callable(f.default_factory) else None):
                yield from walk(f.default_factory, f"{prefix}{f.name}.")
    fields = list(walk(PreprocessConfig))
    assert len(fields) > 50 and "filters.names" in dict(fields) and "tokenizer.type" in dict(fields)
    assert not [k for k, f in fields if not f.metadata.get("doc") or "\n" in f.metadata["doc"]]
