"""Main-text extraction (preprocessing/extract.py): the `extract` pass on real pages with hand-marked main text
(tests/data/extraction: 3 pages of article-extraction-benchmark), records without HTML untouched, every removal
counted by reason, the config check, and the bench's word scores."""
import gzip
import json
from pathlib import Path

import pytest

from common.config import ConfigError
from preprocessing.bench.extract import half_of, word_scores
from preprocessing.cli import load_config
from preprocessing.config import ExtractConfig
from preprocessing.extract import MODULE_OF, ExtractPass, extract_problems, make_extractor
from preprocessing.pipeline import problems, run_stage

PAGES = Path(__file__).parent / "data" / "extraction" / "pages.jsonl.gz"


@pytest.fixture(scope="module")
def pages():
    with gzip.open(PAGES, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def config(tmp_path: Path, *extra: str):
    return load_config("demo", [f"input.paths=['{tmp_path / 'in.jsonl'}']", "fetch=[]", f"work_dir='{tmp_path}/w'",
                                f"output_dir='{tmp_path}/out'", f"tokenizer.path='{tmp_path}/tok'",
                                "dedup.enabled=false", "filters.shards=1", "normalize.exact_dedup=false",
                                "stages=[prepare,extract]", *extra])


def test_word_scores_count_words_as_a_multiset():
    assert word_scores("the cat the dog", "The cat sat") == pytest.approx((0.5, 2 / 3, 4 / 7))
    assert word_scores("", "gold words") == (0.0, 0.0, 0.0)
    assert [half_of(x) for x in ("0a", "1b", "e0", "ff")] == ["choose", "report", "choose", "report"]


def test_default_extractor_finds_the_marked_main_text_of_real_pages(pages):
    run = make_extractor(ExtractConfig())
    scores = [word_scores(run(p["html"]), p["gold"]) for p in pages]
    everything = make_extractor(ExtractConfig(extractor="lxml_text"))
    baseline = [word_scores(everything(p["html"]), p["gold"]) for p in pages]
    for (p, r, f1), (bp, br, _), page in zip(scores, baseline, pages, strict=True):
        assert f1 >= 0.85, (page["url"], p, r)
        assert p > bp + 0.15, page["url"]            # the whole page's text: menus and footers cut its precision
        assert br >= 0.95                            # ...though it holds the main text


def test_extract_stage_fills_text_drops_html_and_counts_every_removal(pages, tmp_path):
    records = [{"id": "page0", "text": "", "html": pages[0]["html"], "url": pages[0]["url"]},
               {"id": "plain", "text": "A plain-text document with no HTML at all passes through."},
               {"id": "blank", "text": "", "html": "   "},
               {"id": "script-only", "text": "",
                "html": "<html><head><script>var a = 1;</script></head><body></body></html>"},
               {"id": "short", "text": "", "html": "<html><body><article><p>Two words.</p></article></body></html>"},
               {"id": "page1", "text": "", "html": pages[1]["html"], "url": pages[1]["url"]}]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    cfg = config(tmp_path, "extract.min_words=5")
    run_stage(cfg, "prepare")
    summary = run_stage(cfg, "extract")
    kept = [json.loads(x) for x in Path(cfg.work_dir, "extract", "part-00000-of-00001.jsonl").read_text().splitlines()]
    removed = [json.loads(x) for x in
               Path(cfg.work_dir, "extract", "removed-00000-of-00001.jsonl").read_text().splitlines()]
    assert [r["id"] for r in kept] == ["page0", "plain", "page1"]
    assert all("html" not in r for r in kept) and kept[0]["url"] == pages[0]["url"]
    assert kept[1]["text"] == records[1]["text"]
    assert word_scores(kept[0]["text"], pages[0]["gold"])[2] >= 0.85
    assert {r["id"]: r["reason"] for r in removed} == {"blank": "empty_extraction", "script-only": "empty_extraction",
                                                       "short": "short_extraction"}
    assert summary["documents in"] == 6 and summary["kept"] == 3 and summary["removed"] == 3
    assert summary["extract (trafilatura)"] == {"extracted": 2, "passed through (no html)": 1}


def test_config_check_names_the_field_and_the_fix(tmp_path, monkeypatch):
    (tmp_path / "in.jsonl").write_text(json.dumps({"id": "a", "text": "", "html": "<p>a page</p>"}) + "\n")
    found = problems(config(tmp_path, "extract.extractor=boilerpipe", "extract.min_words=-1"))
    assert any("extract.extractor='boilerpipe' is not a registered extractor" in p for p in found)
    assert any("extract.min_words=-1" in p for p in found)
    with pytest.raises(ConfigError, match="hold HTML .* no 'extract'"):
        run_stage(config(tmp_path, "stages=[prepare,filter]"), "prepare")
    late = problems(config(tmp_path, "dedup.enabled=true", "stages=[prepare,signatures,extract]"))
    assert any("'extract' comes after the dedup steps" in p for p in late)
    monkeypatch.setitem(MODULE_OF, "justext", "no_such_module_here")
    missing = extract_problems(ExtractConfig(extractor="justext"))
    assert len(missing) == 1 and "'no_such_module_here', which is not installed" in missing[0]
    cfg = config(tmp_path, "extract.favor_precision=true", "extract.favor_recall=true")
    with pytest.raises(ConfigError, match="favor_precision and extract.favor_recall are both true"):
        ExtractPass(cfg)


def test_extract_listed_before_dedup_feeds_dedup_and_the_passes_after_it_read_dedup(pages, tmp_path):
    """Web pages have no text before extraction: dedup must read the extracted parts, and `filter` dedup's."""
    records = [{"id": f"p{i}", "text": "", "html": p["html"]} for i, p in enumerate(pages)]
    records.append({"id": "copy-of-p0", "text": "", "html": pages[0]["html"].replace("<body", "<body data-x='1'")})
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    cfg = config(tmp_path, "dedup.enabled=true", "dedup.shards=2", "dedup.bucket_tasks=1", "dedup.component_tasks=1",
                 "dedup.workers=1", "filters.names=[]",
                 "stages=[prepare,extract,signatures,buckets,verify,clusters,write,filter]")
    for stage in cfg.stages:
        run_stage(cfg, stage)
    filtered = [json.loads(x)["id"] for p in sorted(Path(cfg.work_dir, "filter").glob("part-*.jsonl"))
                for x in p.read_text().splitlines()]
    assert sorted(filtered) == ["p0", "p1", "p2"]               # the copy's extracted text is p0's: removed by dedup
