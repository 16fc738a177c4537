"""WARC/WET input (preprocessing/web/warc.py, the `warc` stage): real WARC files of pywb's sdist, and damaged
copies of them, every record accounted for by reason with exact counts."""
from __future__ import annotations

import base64
import gzip
import hashlib
import json
import re
from pathlib import Path

import pytest

from preprocessing.config import PreprocessConfig
from preprocessing.fetch import fetch
from preprocessing.pipeline import run_stage
from preprocessing.records import BadInputError, detect_format, expand_shard_folders
from preprocessing.web.warc import WarcCounts, _records, read_warc

# pywb 2.10.0's sample crawl of iana.org: 343 records, 16 of them HTML pages (200 OK)
IANA = {"warcinfo_record": 1, "request_record": 171, "revisit_record": 123, "not_html": 28, "http_status": 4}


@pytest.fixture(scope="module")
def warcs() -> Path:
    return Path(fetch("web-warc"))


def read(path: Path):
    counts = WarcCounts()
    return list(read_warc(path, counts)), counts


def offsets(path: Path):
    return [offset for _, _, offset in _records(path, WarcCounts())]


def test_real_warc_every_record_counted(warcs):
    docs, counts = read(warcs / "iana.warc.gz")
    assert (counts.records, counts.documents, dict(counts.skipped)) == (343, 16, IANA)
    assert counts.records == counts.documents + sum(counts.skipped.values())
    assert dict(counts.decode) == {"http_charset": 16}
    first = docs[0]
    assert set(first) == {"id", "text", "html", "url", "warc_date", "warc_record_id", "lang_hint", "source"}
    assert first["text"] == "" and first["lang_hint"] is None and first["url"] == "http://www.iana.org/"
    assert first["warc_date"] == "2014-01-26T20:06:24Z" and first["id"] == first["warc_record_id"]
    assert first["html"].lstrip().lower().startswith("<!doctype html>") and "IANA" in first["html"]
    # pywb's planted bad status line ("HTTPX/1.1 200 OK") and a page charset found in <meta> only
    docs, counts = read(warcs / "example-extra.warc")
    assert dict(counts.skipped) == {"request_record": 2, "revisit_record": 2, "malformed_http": 1}
    assert (counts.documents, dict(counts.decode)) == (1, {"meta_charset": 1})


def test_damaged_copies_exact_counts(warcs, tmp_path):
    data = (warcs / "iana.warc.gz").read_bytes()
    starts = offsets(warcs / "iana.warc.gz")
    assert len(starts) == 343
    # one byte flipped inside gzip member 10 (a request record): that member is `malformed`, the rest read
    flipped = bytearray(data)
    flipped[(starts[10] + starts[11]) // 2] ^= 0xFF
    (tmp_path / "flip.warc.gz").write_bytes(bytes(flipped))
    docs, counts = read(tmp_path / "flip.warc.gz")
    assert (counts.records, counts.documents) == (343, 16)
    assert dict(counts.skipped) == {**IANA, "request_record": 170, "malformed": 1}
    # cut inside the last record of an uncompressed copy: `cut_off`, nothing else lost
    plain = gzip.decompress(data)
    plain_starts = [m.start() for m in re.finditer(b"(?m)^WARC/1\\.0\r$", plain)]
    assert len(plain_starts) == 343
    (tmp_path / "cut.warc").write_bytes(plain[:plain_starts[-1] + 600])
    docs, counts = read(tmp_path / "cut.warc")
    last_kind = "request_record"            # the crawl's last record is a request
    assert counts.records == 343 and counts.skipped["cut_off"] == 1
    assert dict(counts.skipped) == {**IANA, last_kind: IANA[last_kind] - 1, "cut_off": 1}
    # a flipped byte in the `WARC/1.0` line of record 1 (the first page): one malformed region, 15 pages left
    broken = bytearray(plain)
    broken[plain_starts[1] + 2] ^= 0x20
    (tmp_path / "head.warc").write_bytes(bytes(broken))
    docs, counts = read(tmp_path / "head.warc")
    assert (counts.records, counts.documents) == (343, 15)
    assert counts.skipped["malformed"] == 1 and len(docs) == 15


def record(kind: str, body: bytes, extra: str = "") -> bytes:
    """One WARC record as Common Crawl's WET files hold them."""
    head = (f"WARC/1.0\r\nWARC-Type: {kind}\r\nWARC-Record-ID: <urn:uuid:{kind}-{len(body)}>\r\n"
            f"WARC-Date: 2024-02-20T10:00:00Z\r\n{extra}Content-Length: {len(body)}\r\n\r\n")
    return head.encode() + body + b"\r\n\r\n"


def test_wet_conversion_records(tmp_path):
    """A WET file as Common Crawl writes it: warcinfo, then `conversion` records of text/plain."""
    wet = tmp_path / "x.warc.wet.gz"
    wet.write_bytes(gzip.compress(record("warcinfo", b"software: test\r\n")) + gzip.compress(record(
        "conversion", "Grüße aus Köln.\nZweite Zeile.".encode(),
        "WARC-Target-URI: https://a.example.de/x\r\nWARC-Identified-Content-Language: deu\r\n"))
        + gzip.compress(record("conversion", b"  \n", "WARC-Target-URI: https://b.example.de/\r\n")))
    assert detect_format(wet) == "warc"
    docs, counts = read(wet)
    assert dict(counts.skipped) == {"warcinfo_record": 1, "empty_text": 1} and counts.records == 3
    assert docs == [{"id": "urn:uuid:conversion-32", "url": "https://a.example.de/x", "warc_date":
                     "2024-02-20T10:00:00Z", "warc_record_id": "urn:uuid:conversion-32", "lang_hint": "deu",
                     "source": "x.warc.wet.gz@141",
                     "text": "Grüße aus Köln.\nZweite Zeile."}]


def stage_cfg(tmp_path: Path, paths, parts: int) -> PreprocessConfig:
    cfg = PreprocessConfig(output_dir=str(tmp_path / "out"), work_dir=str(tmp_path / f"work{parts}"))
    cfg.input.paths = expand_shard_folders(list(paths))
    cfg.dedup.enabled, cfg.filters.shards = False, parts
    cfg.stages = ["warc", "url_filter"]
    return cfg


def joined(cfg: PreprocessConfig, name: str, kind: str = "part"):
    return [json.loads(line) for p in sorted((Path(cfg.work_dir) / name).glob(f"{kind}-*.jsonl"))
            for line in p.read_text().splitlines()]


def test_warc_stage_parts_by_file_and_url_filter(warcs, tmp_path):
    """The `warc` stage over a folder of the 4 real files, in 1 and 3 parts: the same documents; then the
    `url_filter` pass reads its parts and removes the iana.org pages by a UT1 `domains` list."""
    (tmp_path / "ut1/gov").mkdir(parents=True)
    (tmp_path / "ut1/gov/domains").write_text("# UT1 format\niana.org\n")
    results = {}
    cfg = stage_cfg(tmp_path, [str(warcs)], 3)
    with pytest.raises(BadInputError, match=r"(?s)warc part 1 of 3 .*example-extra.warc.*1 of 6 input records are "
                                            r"unusable.*malformed_http: 1 \(e\.g\. .*example-extra.warc@3207"):
        run_stage(cfg, "warc")          # one damaged record of 6 in the part is over input.max_bad_fraction=0.01
    for parts in (1, 3):
        cfg = stage_cfg(tmp_path, [str(warcs)], parts)
        cfg.fetch = ["web-warc"]                # found in place: fetched by the fixture
        cfg.url_filter.ut1_dirs = [str(tmp_path / "ut1")]
        cfg.input.max_bad_fraction = 0.2
        summary = run_stage(cfg, "warc")
        assert summary["records"] == 361 and summary["documents"] == 19 and summary["files"] == 4
        assert sum(summary["skipped by reason"].values()) == 361 - 19
        assert len(joined(cfg, "warc", "removed")) == 361 - 19     # one line per record that is not a document
        filtered = run_stage(cfg, "url_filter")
        assert (filtered["documents in"], filtered["kept"]) == (19, 3)
        assert filtered["removed by rule"] == {"url/gov/domain": 16}
        results[parts] = (joined(cfg, "warc"), joined(cfg, "url_filter"))
    assert results[1] == results[3]
    assert sorted(d["url"] for d in results[1][1]) == ["http://example.com/", "http://example.com?example=1",
                                                       "http://example.com?example=2"]
    assert len(list((tmp_path / "work3/warc").glob("part-*.jsonl"))) == 3


def test_passes_before_prepare_feed_it(tmp_path):
    """stages warc -> url_filter -> prepare -> filter -> split on a WET file: prepare reads the url_filter parts
    (exact dedup over them), the filter pass after prepare reads normalized.jsonl, not the passes before."""
    pages = [("https://a.example.org/1", "first page text"), ("https://blocked.test/x", "blocked page"),
             ("https://b.example.org/2", "first page text"), ("https://c.example.org/3", "third page")]
    wet = tmp_path / "in" / "crawl.warc.wet.gz"
    wet.parent.mkdir()
    wet.write_bytes(gzip.compress(record("warcinfo", b"x")) + b"".join(gzip.compress(record(
        "conversion", text.encode(), f"WARC-Target-URI: {url}\r\nWARC-Record-ID: <urn:uuid:{i}>\r\n"))
        for i, (url, text) in enumerate(pages)))
    (tmp_path / "blocked.txt").write_text("blocked.test\n")
    cfg = stage_cfg(tmp_path, [str(wet)], 2)
    cfg.url_filter.domain_files = [str(tmp_path / "blocked.txt")]
    cfg.filters.enabled, cfg.transforms = False, []
    cfg.stages = ["warc", "url_filter", "prepare", "filter", "split"]
    for stage in cfg.stages:
        run_stage(cfg, stage)
    work = Path(cfg.work_dir)
    normalized = [json.loads(x) for x in (work / "normalized.jsonl").read_text().splitlines()]
    assert [d["url"] for d in normalized] == ["https://a.example.org/1", "https://c.example.org/3"]
    # provenance names the WET file and the record's offset, not the url_filter part it came through
    assert [d["_provenance"] for d in normalized] == [[str(wet), int(d["source"].split("@")[1]), []]
                                                      for d in normalized]
    assert json.loads((work / "normalize_removed.jsonl").read_text())["method"] == "exact"
    assert [d["url"] for d in joined(cfg, "filter")] == ["https://a.example.org/1", "https://c.example.org/3"]
    assert [r["reason"] for r in joined(cfg, "url_filter", "removed")] == ["url/blocked/domain"]


def response(url: str, http: bytes, digest: str | None = None, extra: str = "") -> bytes:
    """A response record; `digest`: 'ok' writes the block's true sha1 (base32, as Common Crawl), 'bad' a wrong one."""
    if digest:
        sha1 = hashlib.sha1(http if digest == "ok" else http + b"x").digest()
        extra += f"WARC-Block-Digest: sha1:{base64.b32encode(sha1).decode()}\r\n"
    return record("response", http, f"WARC-Target-URI: {url}\r\n{extra}")


def test_record_checks_and_charsets(tmp_path):
    """Each reason and charset source on one record made for it; exact counts."""
    page = "<html><body><p>Grüße aus Köln</p></body></html>"
    ok = b"HTTP/1.1 200 OK\r\nContent-Type: text/html; charset=iso-8859-1\r\nContent-Encoding: gzip\r\n\r\n" \
        + gzip.compress(page.encode("latin-1"))
    meta = b"HTTP/1.1 200 OK\r\nContent-Type: text/html\r\n\r\n<meta charset='windows-1252'>" + page.encode("cp1252")
    wrong = b"HTTP/1.1 200 OK\r\nContent-Type: text/html; charset=utf-8\r\n\r\n" + page.encode("latin-1")
    path = tmp_path / "made.warc"
    path.write_bytes(b"".join([
        response("https://a.test/ok", ok, "ok"),
        response("https://a.test/bad-digest", ok, "bad"),
        response("https://a.test/meta", meta),
        response("https://a.test/wrong-charset", wrong),
        response("https://a.test/cut", ok, extra="WARC-Truncated: length\r\n"),
        response("https://a.test/br", b"HTTP/1.1 200 OK\r\nContent-Type: text/html\r\nContent-Encoding: br\r\n\r\nx"),
        response("https://a.test/empty", b"HTTP/1.1 200 OK\r\nContent-Type: text/html\r\n\r\n  "),
        response("https://a.test/pdf", b"HTTP/1.1 200 OK\r\nContent-Type: application/pdf\r\n\r\n%PDF"),
        response("https://a.test/moved", b"HTTP/1.1 301 Moved\r\nContent-Type: text/html\r\n\r\n<a>"),
    ]))
    docs, counts = read(path)
    assert [d["url"] for d in docs] == ["https://a.test/ok", "https://a.test/meta", "https://a.test/wrong-charset"]
    assert dict(counts.skipped) == {"digest_mismatch": 1, "truncated": 1, "content_encoding": 1, "empty_payload": 1,
                                    "not_html": 1, "http_status": 1}
    assert dict(counts.decode) == {"http_charset": 1, "meta_charset": 1, "http_charset_failed": 1,
                                   "utf8_replacement": 1}
    assert page in docs[0]["html"] and page in docs[1]["html"]
    assert docs[2]["html"].count("\ufffd") == 3                     # ü, ß, ö: latin-1 bytes under a utf-8 label
