"""The `url_filter` pass (preprocessing/web/url_filter.py): a UT1-format tree and plain lists written here, exact
removals and reasons, subdomains by the public-suffix list, no false positive on look-alike hosts."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from preprocessing.config import PreprocessConfig, UrlFilterConfig
from preprocessing.pipeline import problems, run_stage
from preprocessing.web.url_filter import UrlBlockList, UrlFilterPass, _parents

# url -> the reason it is removed (None: kept)
CASES = {
    "https://example.co.uk/": "url/adult/domain",
    "http://a.b.example.co.uk/page?x=1": "url/adult/domain",         # a subdomain, two labels deep
    "https://www.example.co.uk": "url/adult/domain",
    "https://notexample.co.uk/": None,                                # look-alike host, not a subdomain
    "https://notexample.com/": None,
    "https://example.com.evil.org/": None,                            # the blocked name as a label elsewhere
    "https://other.co.uk/": None,                                     # the list's `co.uk` entry is a public suffix
    "https://co.uk/": "url/adult/domain",                             # ... which blocks only that exact host
    "https://user.github.io/": None,                                  # `github.io` is a (private) public suffix
    "https://github.io/": "url/adult/domain",
    "http://casino.test/poker": "url/gambling/domain",
    "https://m.casino.test/": "url/gambling/domain",
    "https://news.site.org/ads/banner.html": "url/gambling/url",     # UT1 urls: host + path prefix
    "https://www.news.site.org/ads": "url/gambling/url",
    "https://news.site.org/adserver": None,                           # a prefix is cut at a path boundary
    "https://news.site.org/": None,
    "https://blog.example.net/?utm=track-me-now": "url/mine/substring",
    "https://shop.example.net/item/12345/buy": "url/patterns/regex",
    "https://shop.example.net/item/abc/buy": None,
    "http://10.0.0.7/x": "url/ips/domain",
    "http://10.0.0.70/x": None,
}


@pytest.fixture
def lists(tmp_path: Path) -> UrlFilterConfig:
    ut1 = tmp_path / "blacklists"
    for category, kind, lines in (("adult", "domains", ["# UT1 adult", "example.co.uk", "co.uk", "github.io", ""]),
                                  ("gambling", "domains", ["casino.test"]),
                                  ("gambling", "urls", ["news.site.org/ads"]),
                                  ("phishing", "domains", ["notexample.com.invalid"])):
        (ut1 / category).mkdir(parents=True, exist_ok=True)
        (ut1 / category / kind).write_text("\n".join(lines) + "\n")
    (tmp_path / "mine.txt").write_text("track-me\n")
    (tmp_path / "patterns.txt").write_text(r"/item/\d+/" + "\n")
    (tmp_path / "ips.txt").write_text("10.0.0.7\n")
    return UrlFilterConfig(ut1_dirs=[str(ut1)], categories=["adult", "gambling"],
                           domain_files=[str(tmp_path / "ips.txt")],
                           substring_files=[str(tmp_path / "mine.txt")], regex_files=[str(tmp_path / "patterns.txt")])


def test_reasons_subdomains_and_look_alikes(lists):
    block = UrlBlockList(lists)
    assert {url: block.reason(url) for url in CASES} == CASES
    assert dict(block.entries) == {"adult:domain": 3, "gambling:domain": 1, "gambling:url": 1, "ips:domain": 1,
                                   "mine:substring": 1, "patterns:regex": 1}    # phishing: not in `categories`
    assert _parents("a.b.example.co.uk") == ["a.b.example.co.uk", "b.example.co.uk", "example.co.uk"]


def test_pass_counts_and_stage(lists, tmp_path):
    cfg = PreprocessConfig(output_dir=str(tmp_path / "out"), work_dir=str(tmp_path / "work"))
    cfg.url_filter = lists
    records = [{"id": str(i), "text": "t", "url": url} for i, url in enumerate(CASES)] + [{"id": "x", "text": "t"}]
    doc_pass = UrlFilterPass(cfg)
    reasons = [doc_pass.apply(r) for r in records]
    assert reasons == list(CASES.values()) + [None]
    removed = [r for r in CASES.values() if r]
    assert doc_pass.summary() == {"removed by rule": {r: removed.count(r) for r in set(removed)},
                                  "records without a URL": {"keep": 1}}
    cfg.url_filter.missing_url = "remove"
    assert UrlFilterPass(cfg).apply({"id": "x", "text": "t", "url": ""}) == "no_url"
    # the registered pass over normalized.jsonl (dedup off): removed-*.jsonl names each document's reason
    cfg.dedup.enabled, cfg.filters.shards, cfg.stages = False, 2, ["url_filter"]
    assert problems(cfg) == []
    work = Path(cfg.work_dir)
    work.mkdir()
    (work / "normalized.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    summary = run_stage(cfg, "url_filter")
    assert (summary["documents in"], summary["kept"], summary["removed"]) == (22, 9, 13)
    assert len(removed) + 1 == 13
    lines = [json.loads(x) for p in sorted((work / "url_filter").glob("removed-*"))
             for x in p.read_text().splitlines()]
    assert [(x["id"], x["reason"]) for x in lines] == [(str(i), r) for i, r in enumerate(CASES.values()) if r] + \
        [("x", "no_url")]


def test_bad_lists_are_named(tmp_path):
    cfg = PreprocessConfig(output_dir="out", stages=["url_filter"])
    cfg.url_filter = UrlFilterConfig(domain_files=[str(tmp_path / "gone.txt")], missing_url="drop")
    assert problems(cfg) == ["url_filter.missing_url='drop': use 'keep' or 'remove' (a record without a URL).",
                             f"url_filter.domain_files: {tmp_path / 'gone.txt'} does not exist. Fix: the path of a "
                             "list (a UT1 folder for ut1_dirs)."]
    (tmp_path / "bad.txt").write_text("ok\n(unclosed\n")
    with pytest.raises(ValueError, match=r"bad.txt:2: '\(unclosed' is not a regular expression"):
        UrlBlockList(UrlFilterConfig(regex_files=[str(tmp_path / "bad.txt")]))
    with pytest.raises(FileNotFoundError, match=r"url_filter.ut1_dirs: .*nowhere is not a folder"):
        UrlBlockList(UrlFilterConfig(ut1_dirs=[str(tmp_path / "nowhere")]))
