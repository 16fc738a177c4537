"""Stage 5: documents -> token ids + EOD -> Megatron indexed dataset (.bin/.idx).

    python -m preprocessing.tokenize_indexed --input docs.jsonl --tokenizer DIR|FILE --output PREFIX
    make tokenize INPUT=docs.jsonl TOKENIZER=DIR OUTPUT=PREFIX

Written with megatron-core's IndexedDatasetBuilder, dtype by `DType.optimal_dtype(vocab)`
(uint16 below 65500 tokens, else int32), one sequence per document with EOD appended:
the layout Megatron-LM's `tools/preprocess_data.py --append-eod` writes, so files from
either tool mix. Streaming in batches (memory is one batch); HF tokenizers encode a
batch on all cores, SentencePiece with `tokenize.workers` threads. A JSON sidecar
records tokenizer, counts and source hashes. Output appears atomically (tmp + rename).
"""
from __future__ import annotations

import json
import os
import sys
from itertools import islice
from pathlib import Path
from typing import List, Tuple

import numpy as np
from tqdm import tqdm

from common.digest import file_digest

from .cli import cli_main, stage_args
from .config import InputConfig, TokenizeConfig
from .markers import Marker, fingerprint, print_summary
from .records import BadInput, read_documents
from .tokenizer_io import describe, load_tokenizer


def batched(iterable, n: int):
    it = iter(iterable)
    while batch := list(islice(it, n)):
        yield batch


def tokenize_to_indexed(inp: InputConfig, tokenizer, prefix: str | Path, cfg: TokenizeConfig,
                        doc_range: Tuple[int, int] | None = None) -> dict:
    """`doc_range` (lo, hi): only documents lo..hi-1 of the input (one shard; merge_indexed joins them)."""
    prefix = Path(prefix)
    prefix.parent.mkdir(parents=True, exist_ok=True)
    settings = [vars(inp), {k: v for k, v in vars(cfg).items() if k != "shards"}, describe(tokenizer), doc_range]
    marker = Marker(prefix.parent, prefix.name, fingerprint(settings, inp.paths))
    done = marker.done()
    if done:
        return done
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder  # torch: only when writing
    dtype = DType.optimal_dtype(tokenizer.vocab_size)
    tmp = prefix.with_name(prefix.name + ".tmp")
    builder = IndexedDatasetBuilder(f"{tmp}.bin", dtype=dtype)
    bad, docs, tokens = BadInput(), 0, 0
    progress = tqdm(desc=f"tokenize {prefix.name}", unit="doc", file=sys.stderr)
    docs_in = read_documents(inp.paths, fmt=inp.format, text_field=inp.text_field, id_field=inp.id_field, bad=bad)
    for batch in batched(islice(docs_in, *doc_range) if doc_range else docs_in, cfg.batch_size):
        for ids in tokenizer.encode_batch([d.text for d in batch]):
            if cfg.append_eod:
                ids.append(tokenizer.eod)
            builder.add_document(np.asarray(ids, dtype=dtype), [len(ids)])
            tokens += len(ids)
        docs += len(batch)
        progress.update(len(batch))
    progress.close()
    bad.check(inp.max_bad_fraction, f"tokenize input {inp.paths}")
    builder.finalize(f"{tmp}.idx")
    os.replace(f"{tmp}.bin", f"{prefix}.bin")
    os.replace(f"{tmp}.idx", f"{prefix}.idx")
    summary = {"documents": docs, "tokens": tokens, "dtype": np.dtype(dtype).name,
               "tokens_per_document": round(tokens / max(1, docs), 1)}
    sidecar = {"prefix": str(prefix), **summary, "documents_range": doc_range, "append_eod": cfg.append_eod,
               "tokenizer": describe(tokenizer),
               "sources": [{"path": str(p), "bytes": Path(p).stat().st_size, "sha256": file_digest(Path(p))}
                           for p in inp.paths if Path(p).is_file()],
               "skipped": bad.as_dict()}
    Path(f"{prefix}.json").write_text(json.dumps(sidecar, indent=1))
    print_summary(f"tokenize -> {prefix}.bin/.idx" + (f" (documents {doc_range[0]}..{doc_range[1] - 1})"
                                                      if doc_range else ""), summary, dict(bad.counts))
    marker.mark(summary)
    return summary


def merge_indexed(parts: List[Path], prefix: str | Path) -> dict:
    """Concatenate indexed datasets in order (megatron-core's `add_index`, as Megatron-LM's
    tools/merge_datasets.py): shards of contiguous document ranges give the bytes of one pass."""
    prefix = Path(prefix)
    sidecars = []
    for part in parts:
        if not Path(f"{part}.idx").exists():
            raise FileNotFoundError(f"{part}.idx missing: its tokenize shard has not finished")
        sidecars.append(json.loads(Path(f"{part}.json").read_text()))
    files = [Path(f"{p}.{ext}") for p in parts for ext in ("bin", "idx")]
    marker = Marker(prefix.parent, prefix.name, fingerprint([str(p) for p in parts], files))
    done = marker.done()
    if done:
        return done
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder  # torch: only when writing
    dtype = np.dtype(sidecars[0]["dtype"]).type
    tmp = prefix.with_name(prefix.name + ".tmp")
    builder = IndexedDatasetBuilder(f"{tmp}.bin", dtype=dtype)
    for part in parts:
        builder.add_index(str(part))
    builder.finalize(f"{tmp}.idx")
    os.replace(f"{tmp}.bin", f"{prefix}.bin")
    os.replace(f"{tmp}.idx", f"{prefix}.idx")
    docs, tokens = sum(s["documents"] for s in sidecars), sum(s["tokens"] for s in sidecars)
    summary = {"documents": docs, "tokens": tokens, "dtype": sidecars[0]["dtype"],
               "tokens_per_document": round(tokens / max(1, docs), 1)}
    Path(f"{prefix}.json").write_text(json.dumps({"prefix": str(prefix), **summary, "parts": sidecars}, indent=1))
    marker.mark(summary)
    return summary


@cli_main
def main(argv: List[str] | None = None) -> int:
    args, cfg = stage_args("tokenize_indexed", argv)
    if not args.output or not (args.tokenizer or cfg.tokenizer.path):
        print("need --output PREFIX and --tokenizer PATH (make tokenize INPUT=... TOKENIZER=... OUTPUT=...)",
              file=sys.stderr)
        return 2
    tok = load_tokenizer(None if args.tokenizer else cfg.tokenizer.type, args.tokenizer or cfg.tokenizer.path,
                         threads=cfg.tokenize.workers)
    print(json.dumps(tokenize_to_indexed(cfg.input, tok, args.output, cfg.tokenize)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
