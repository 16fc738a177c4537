"""What the `pii` transform replaces in real text, and how fast: the figures of docs/preprocessing.md, "PII".

    python -m preprocessing.bench.pii [--matches out.tsv] [--sets demo,tuning,held_out]

Sets (files that are not on the machine are skipped and said so):
* demo: the demo corpus (Shakespeare and Milton; preprocessing.fetch), where nothing should change;
* tuning: the METADATA of the installed Python packages (.venv) and /usr/share/doc (Debian changelogs,
  copyright files: maintainers' e-mail, versions, dates) - the phone and IP rules were tuned on these;
* held_out: awscli's command examples (IPs, phone numbers, e-mail in JSON output), Vim's help and
  Node.js's API docs - read only after the rules were fixed.
`--matches` writes every replacement (set, kind, text, 60 characters either side) for review by eye.
"""
from __future__ import annotations

import argparse
import glob
import gzip
import json
import sys
import sysconfig
import time
from pathlib import Path
from typing import Dict, Iterator, List

from ..config import PIIConfig
from ..fetch import fetch
from ..pii import PIITransform

REPO = Path(__file__).resolve().parents[2]
SETS: Dict[str, List[str]] = {
    "tuning": [str(REPO / ".venv/lib/python3.*/site-packages/*.dist-info/METADATA"), "/usr/share/doc/*/*"],
    "held_out": [sysconfig.get_paths()["purelib"] + "/awscli/examples/**/*.rst",   # the venv's, or its base's:
                 sys.base_prefix + "/lib/python3.*/site-packages/awscli/examples/**/*.rst",
                 "/usr/share/vim/vim*/doc/*.txt", "/usr/share/doc/nodejs/api/*.md"],
}


def read_set(name: str) -> Iterator[str]:
    if name == "demo":
        with open(fetch("shakespeare"), encoding="utf-8") as f:
            yield from (json.loads(line)["text"] for line in f)
        return
    seen = set()
    for pattern in SETS[name]:
        files = sorted(p for p in glob.glob(pattern, recursive=True) if Path(p).is_file())
        print(f"  {name}: {pattern}: {len(files)} files", file=sys.stderr)
        for path in files:
            real = Path(path).resolve()
            if real in seen:
                continue
            seen.add(real)
            opener = gzip.open if path.endswith(".gz") else open
            try:
                with opener(path, "rt", encoding="utf-8", errors="replace") as f:
                    yield f.read()
            except OSError:                     # an unreadable or not-really-gzip file: not text to scan
                continue


def scan(name: str, matches=None) -> dict:
    docs = list(read_set(name))
    transform = PIITransform(PIIConfig())
    start = time.process_time()
    changed = sum(transform(doc) is not doc for doc in docs)
    seconds = time.process_time() - start
    mb = sum(len(doc.encode()) for doc in docs) / 1e6
    if matches is not None:
        for doc in docs:
            for replacer in transform.replacers:
                for m in replacer.pattern.finditer(doc):
                    if not replacer.kept(m):
                        context = doc[max(0, m.start() - 60):m.end() + 60].replace("\t", " ").replace("\n", "\\n")
                        matches.write(f"{name}\t{replacer.kind}\t{m.group(0)}\t{context}\n")
    return {"set": name, "docs": len(docs), "MB": round(mb, 2), "changed_docs": changed,
            "replaced": dict(sorted(transform.counts.items())), "MB_per_cpu_s": round(mb / max(seconds, 1e-9), 1)}


def main(argv: List[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m preprocessing.bench.pii", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sets", default="demo,tuning,held_out")
    parser.add_argument("--matches", default=None, help="TSV of every replacement with its context")
    args = parser.parse_args(argv)
    out = open(args.matches, "w", encoding="utf-8") if args.matches else None
    try:
        for name in args.sets.split(","):
            print(json.dumps(scan(name, out)))
    finally:
        if out:
            out.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
