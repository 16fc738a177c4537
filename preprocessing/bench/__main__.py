"""`make bench-preprocess`: the data path's benchmarks, side by side in one run.

* tokenization (preprocessing/bench/tokenization.py): JSONL -> .bin/.idx against tokenizers'
  `encode_batch_fast` on the same texts in memory, >= 50 MB; start-up of the CLI;
* dedup at scale (preprocessing/bench/dedup.py): a generated planted corpus of 200,000
  documents through every step, each in its own process (peak RSS, docs/s per core), against
  the previous single-process cluster step, and the extrapolation to 1 B documents;
* dedup quality (preprocessing/bench/planted.py): recall per planted edit level and precision,
  ours against the previous defaults, and (tuning_similarity.py) the similarity of each planted copy to its
  original at 2- to 5-grams, written into docs/dedup.md between their markers;
* language identification (preprocessing/bench/language.py): accuracy per language on Django's
  translations, py3langid beside fastText lid.176.ftz, docs/s on the demo corpus -> docs/preprocessing.md;
* dedup components (preprocessing/bench/components.py): the clusters step's sharded connected
  components at 0.5 M, 1 M, 2 M documents (peak RSS per task, time) against the union-find -> docs/dedup.md;
* quality filters (preprocessing/bench/quality.py): gopher_quality, gopher_repetition, c4 and fineweb against
  datatrove 0.10.1's on the same documents, agreement and docs/s per core -> docs/preprocessing.md;
* dedup held out (preprocessing/bench/heldout.py): the frozen dedup defaults on corpora they were not chosen on
  (other seeds, edit models, source code, templated pages) -> docs/dedup.md;
* document passes (preprocessing/bench/passes.py): the corpus-gpt2 filter and decontaminate tasks and the split, each
  in its own process: docs per CPU second, peak RSS per task, the 1B-document extrapolation -> docs/preprocessing.md;
* sentence splitters (preprocessing/bench/sentences.py): spaCy's sentencizer beside pySBD and a corpus-trained Punkt
  on held-out demo documents, wrong splits and MB/s -> docs/sentence-data.md.

    python -m preprocessing.bench [--tokenize-mb 50] [--dedup-docs 200000] [--only tokenize,...,heldout,passes]
"""
from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path
from typing import List

from common.text import replace_block

from .heldout import heldout_table
from .language import bench_language
from .passes import bench_passes
from .planted import quality_table
from .quality import bench_filters
from .sentences import bench_sentences
from .tuning_similarity import similarity_table

REPO = Path(__file__).resolve().parents[2]            # the repository root (bench -> preprocessing -> root)
PARTS = ("tokenize", "scale", "quality", "language", "components", "filters", "heldout", "passes", "sentences")


def main(argv: List[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m preprocessing.bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokenize-mb", type=float, default=50, help="MB of text for the tokenization benchmark")
    parser.add_argument("--dedup-docs", type=int, default=200_000, help="documents of the dedup scale benchmark")
    parser.add_argument("--only", default=",".join(PARTS), help=f"comma-separated subset of {','.join(PARTS)}")
    args = parser.parse_args(argv)
    parts = [p for p in args.only.split(",") if p]
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        parser.error(f"--only {unknown}: choose from {', '.join(PARTS)}")
    page = REPO / "docs" / "bench-preprocess.md"
    machine = (f"Measured {time.strftime('%Y-%m-%d')} on {platform.machine()}, {__import__('os').cpu_count()} cores, "
               f"Python {platform.python_version()}, by `make bench-preprocess`.")
    if "tokenize" in parts:
        from .tokenization import bench_tokenize
        replace_block(page, "tokenize", [machine, ""] + bench_tokenize(mb=args.tokenize_mb))
    if "scale" in parts:
        from .dedup import bench_dedup
        replace_block(page, "dedup-scale", [machine, ""] + bench_dedup(n_docs=args.dedup_docs))
    if "quality" in parts:
        replace_block(REPO / "docs" / "dedup.md", "quality-table", quality_table())
        replace_block(REPO / "docs" / "dedup.md", "similarity-table", similarity_table())
    if "language" in parts:
        replace_block(REPO / "docs" / "preprocessing.md", "language-id", [machine, ""] + bench_language())
    if "components" in parts:
        from .components import bench_components
        replace_block(REPO / "docs" / "dedup.md", "components-table", [machine, ""] + bench_components())
    if "filters" in parts:
        replace_block(REPO / "docs" / "preprocessing.md", "quality-parity", [machine, ""] + bench_filters())
    if "heldout" in parts:
        replace_block(REPO / "docs" / "dedup.md", "heldout-table", [machine, ""] + heldout_table())
    if "passes" in parts:
        replace_block(REPO / "docs" / "preprocessing.md", "passes-scale", [machine, ""] + bench_passes())
    if "sentences" in parts:
        replace_block(REPO / "docs" / "sentence-data.md", "sentence-splitters", [machine, ""] + bench_sentences())
    print(page.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
