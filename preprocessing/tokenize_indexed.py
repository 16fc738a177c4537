"""Stage 5: documents -> token ids + EOD -> Megatron indexed dataset (.bin/.idx).

    python -m preprocessing.tokenize_indexed --input docs.jsonl --tokenizer DIR|FILE --output PREFIX
    make tokenize INPUT=docs.jsonl TOKENIZER=DIR OUTPUT=PREFIX

One sequence per document with EOD appended, dtype uint16 below 65,500 token ids else int32: the
files Megatron-LM's `tools/preprocess_data.py --append-eod` writes, byte for byte, so files from
either tool mix. They are written with numpy (preprocessing/indexed_io.py), not megatron.core,
whose import (torch) cost 4 of the 6 s start-up.

Plain JSONL inputs are read by byte range: shard k of n (`shard=(k, n)`, a tokenize array task)
reads only bytes [k*size/n, (k+1)*size/n) of the inputs, a line belonging to the range where it
starts, so shards merged in order (`merge_indexed`) give the bytes of one pass. Within a shard,
`tokenize.workers` processes (forked, so no tokenizer reload) encode consecutive byte ranges side
by side, each on one thread, and their token files are concatenated: JSON parsing and id handling
run in parallel too, unlike one `encode_batch` call whose Python side holds the GIL. Other inputs
(.gz/.zst, Parquet, text folders, HF datasets) cannot be entered in the middle: they are read in
this process and encoded on the tokenizer's own threads, and cannot be sharded.
A JSON sidecar records tokenizer, counts and source hashes. Output appears atomically (tmp + rename).

With `tokenize.split_sentences` each sentence (preprocessing/sentences.py) is one sequence and the index's
document_indices mark the documents: Megatron-LM's `preprocess_data.py --split-sentences` (a sentence with
no tokens is left out, EOD joins a document's last sentence), what its BERT and T5 datasets read. The sidecar
then counts the sentences and the documents those datasets pass over (SENTENCE_KEYS).
"""
from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import shutil
import sys
import traceback
from array import array
from contextlib import ExitStack, nullcontext
from itertools import islice
from multiprocessing.connection import wait
from pathlib import Path
from typing import Iterable, Iterator, List, Optional, Tuple

import numpy as np
from tqdm import tqdm

from common.digest import file_digest
from common.files import write_atomic

from . import provenance
from .cli import cli_main, stage_args
from .config import InputConfig, TokenizeConfig
from .indexed_io import concatenate, optimal_dtype, publish_pair, write_index
from .markers import Marker, fingerprint, print_summary
from .records import BadInput, Piece, byte_shard, cut, plain_jsonl, read_documents, read_jsonl_range
from .sentences import pipeline as sentence_pipeline
from .sentences import split_sentences
from .tokenizer_io import describe, load_tokenizer, one_thread

MIN_WORKER_BYTES = 1 << 20          # below this per worker, forking costs more than it saves
# megatron-core's helpers.cpp LONG_SENTENCE_LEN: its BERT/T5 sample mapping (build_mapping) passes over a
# document of 2+ sentences when one of them has more tokens than this
LONG_SENTENCE_TOKENS = 512
# The sidecar's (and blend.json's "sentences") counts of a sentence-level dataset, summed over shards:
# sentences; documents of exactly one sentence (no NSP/SOP pair: BERT's binary head skips them); of none;
# of 2+ sentences with one over LONG_SENTENCE_TOKENS (skipped by megatron-core); sentences with no tokens (dropped).
SENTENCE_KEYS = ("sentences", "single_sentence_documents", "empty_documents", "long_sentence_documents",
                 "sentences_without_tokens")


def batched(iterable, n: int):
    it = iter(iterable)
    while batch := list(islice(it, n)):
        yield batch


def length(pieces: List[Piece]) -> int:
    return sum(end - start for _, start, end in pieces)


def jsonl_texts(pieces: List[Piece], inp: InputConfig, bad: BadInput, done: Optional[list] = None,
                prov: Optional[provenance.Log] = None) -> Iterator[str]:
    """Texts of the JSONL lines that start in `pieces` (records.read_jsonl_range); `done[0]` counts the
    bytes read (progress); `prov` gets each document's provenance."""
    for path, start, end in pieces:
        read = start
        for doc, _, line_end in read_jsonl_range((path, start, end), inp.text_field, inp.id_field, bad,
                                                 locate=prov is not None):
            if done is not None:
                done[0], read = done[0] + line_end - read, line_end
            if prov is not None:
                prov.add(doc.record, doc.id, doc.where)
            yield doc.text
        if done is not None:
            done[0] += max(0, end - read)


class Encoded:
    """What `encode_to` wrote: the sequence lengths; with split_sentences, the sequences of each document (else
    None: one each) and the count of sentences left out for having no tokens."""

    def __init__(self, sentences: bool):
        self.lengths = array("i")
        self.per_doc = array("i") if sentences else None
        self.untokenized = 0

    def as_message(self) -> tuple:
        return self.lengths.tobytes(), None if self.per_doc is None else self.per_doc.tobytes(), self.untokenized


def _encode_sentences(batch: List[str], tokenizer, tokens: array, enc: Encoded, append_eod: bool) -> None:
    docs = list(split_sentences(batch))
    flat = tokenizer.encode_batch([s for sentences in docs for s in sentences])
    at = 0
    for sentences in docs:
        kept = 0
        for ids in flat[at:at + len(sentences)]:
            if ids:
                tokens.extend(ids)
                enc.lengths.append(len(ids))
                kept += 1
        enc.untokenized += len(sentences) - kept
        at += len(sentences)
        if append_eod and kept:
            tokens.append(tokenizer.eod)
            enc.lengths[-1] += 1
        enc.per_doc.append(kept)


def encode_to(out, texts: Iterable[str], tokenizer, dtype: np.dtype, cfg: TokenizeConfig,
              on_batch=lambda: None) -> Encoded:
    """Encode `texts` in batches, writing the tokens (+ EOD) to `out`: one sequence per text, or per sentence."""
    typecode = {"uint16": "H", "int32": "i"}[np.dtype(dtype).name]
    enc = Encoded(cfg.split_sentences)
    for batch in batched(texts, cfg.batch_size):
        tokens = array(typecode)
        if cfg.split_sentences:
            _encode_sentences(batch, tokenizer, tokens, enc, cfg.append_eod)
        else:
            for ids in tokenizer.encode_batch(batch):
                tokens.extend(ids)              # C loop over the id list; raises if an id does not fit
                if cfg.append_eod:
                    tokens.append(tokenizer.eod)
                enc.lengths.append(len(ids) + cfg.append_eod)
        if sys.byteorder == "big":
            tokens.byteswap()
        out.write(tokens)
        on_batch()
    return enc


def _worker(run: List[Piece], inp, tokenizer, dtype, cfg, bin_path: str, progress, slot: int, conn) -> None:
    """One forked worker: encode a run of pieces into `bin_path`; send (lengths, bad counts) back."""
    try:
        bad, done, prov = BadInput(), [0], provenance.Log()

        def report():
            progress[slot] = done[0]
        with open(bin_path, "wb") as out:
            enc = encode_to(out, jsonl_texts(run, inp, bad, done, prov), tokenizer, dtype, cfg, report)
        conn.send(("ok", enc.as_message(), bad.good, dict(bad.counts), dict(bad.examples), prov.as_message()))
    except BaseException:
        conn.send(("error", traceback.format_exc()))
    finally:
        conn.close()


def _encode_pieces(pieces: List[Piece], inp, tokenizer, dtype, cfg, tmp: Path, bad: BadInput,
                   prov: provenance.Log) -> Encoded:
    """Tokens of `pieces` into `tmp`.bin with `cfg.workers` processes; the workers' `Encoded` joined in order."""
    if cfg.split_sentences:
        sentence_pipeline()         # loaded once here, before the forks
    total = length(pieces)
    workers = max(1, min(cfg.workers, total // MIN_WORKER_BYTES))
    runs = [cut(pieces, w * total // workers, (w + 1) * total // workers) for w in range(workers)]
    ctx = multiprocessing.get_context("fork")          # the loaded tokenizer comes along, no reload
    shared = ctx.RawArray("q", workers)
    procs, conns = [], []
    with one_thread(tokenizer) if workers > 1 else nullcontext(), ExitStack() as stack:
        try:
            for w in range(1, workers):
                recv, send = ctx.Pipe(duplex=False)
                procs.append(ctx.Process(target=_worker, args=(runs[w], inp, tokenizer, dtype, cfg,
                                                               f"{tmp}.bin.part{w}", shared, w, send), daemon=True))
                procs[-1].start()
                send.close()
                conns.append(recv)
            done = [0]       # the progress bar starts after the forks: its monitor thread must not be forked
            progress = stack.enter_context(tqdm(desc=f"tokenize {tmp.name.removesuffix('.tmp')}", total=total,
                                                unit="B", unit_scale=True, file=sys.stderr))

            def report():
                shared[0] = done[0]
                progress.update(sum(shared) - progress.n)
            with open(f"{tmp}.bin", "wb") as out:
                enc = encode_to(out, jsonl_texts(runs[0], inp, bad, done, prov), tokenizer, dtype, cfg, report)
                for w, conn in enumerate(conns, 1):
                    while not wait([conn], timeout=0.5):
                        report()
                    try:
                        reply = conn.recv()
                    except EOFError:
                        procs[w - 1].join()
                        raise RuntimeError(f"tokenize worker {w} died (exit code {procs[w - 1].exitcode})") from None
                    if reply[0] == "error":
                        raise RuntimeError(f"tokenize worker {w} failed:\n{reply[1]}")
                    enc.lengths.frombytes(reply[1][0])
                    if enc.per_doc is not None:
                        enc.per_doc.frombytes(reply[1][1])
                    enc.untokenized += reply[1][2]
                    part = BadInput(good=reply[2])
                    part.counts.update(reply[3])
                    part.examples.update(reply[4])
                    bad.merge(part)
                    prov.extend(reply[5])
                    with open(f"{tmp}.bin.part{w}", "rb") as f:
                        shutil.copyfileobj(f, out, 1 << 22)
                    os.unlink(f"{tmp}.bin.part{w}")
                report()
        finally:
            for p in procs:
                if p.is_alive():
                    p.terminate()
                p.join()
            for w in range(1, workers):
                Path(f"{tmp}.bin.part{w}").unlink(missing_ok=True)
    return enc


def sentence_counts(enc: Encoded) -> dict:
    """SENTENCE_KEYS of a sentence-level dataset."""
    per_doc = np.frombuffer(enc.per_doc, dtype=np.int32)
    ends = np.cumsum(per_doc, dtype=np.int64)
    long = np.frombuffer(enc.lengths, dtype=np.int32) > LONG_SENTENCE_TOKENS
    # documents holding a long sentence: those whose [start, end) range of sequences has a long one
    long_before = np.concatenate([[0], np.cumsum(long, dtype=np.int64)])
    long_docs = (long_before[ends] - long_before[ends - per_doc] > 0) & (per_doc > 1)
    return dict(zip(SENTENCE_KEYS, (len(enc.lengths), int((per_doc == 1).sum()), int((per_doc == 0).sum()),
                                    int(long_docs.sum()), enc.untokenized), strict=True))


def _range_digest(piece: Piece) -> str:
    path, start, end = piece
    if start == 0 and end == path.stat().st_size:
        return file_digest(path)
    h = hashlib.sha256()
    with open(path, "rb") as f:
        f.seek(start)
        left = end - start
        while left > 0 and (chunk := f.read(min(left, 1 << 20))):
            h.update(chunk)
            left -= len(chunk)
    return h.hexdigest()


def tokenize_to_indexed(inp: InputConfig, tokenizer, prefix: str | Path, cfg: TokenizeConfig,
                        shard: Optional[Tuple[int, int]] = None, kept_by: Optional[List[str]] = None) -> dict:
    """Tokenize the inputs into `prefix`.bin/.idx/.json and the documents' provenance `prefix`.prov (`kept_by`:
    the pipeline's stages every document passed). `shard` (k, n): only the k-th of n byte ranges
    of the (plain JSONL) inputs; `merge_indexed` joins the n shards into the bytes of one pass."""
    prefix = Path(prefix)
    prefix.parent.mkdir(parents=True, exist_ok=True)
    plain = plain_jsonl(inp.paths, inp.format)
    if shard and shard[1] > 1 and not plain:
        raise ValueError(f"tokenize.shards={shard[1]} needs plain JSONL inputs (read by byte range), got {inp.paths}")
    settings = [vars(inp), cfg.append_eod, describe(tokenizer), shard]    # workers and batch size change no byte
    if cfg.split_sentences:     # only when on: the markers of datasets written before the field stay valid
        settings.append("split_sentences")
    settings.append(["provenance", kept_by or []])
    marker = Marker(prefix.parent, prefix.name, fingerprint(settings, inp.paths))
    done = marker.done()
    if done:
        return done
    dtype = optimal_dtype(tokenizer.vocab_size)
    tmp = prefix.with_name(prefix.name + ".tmp")
    try:    # a failure (too much bad input, a tokenizer error) leaves no half-written <prefix>.tmp.* behind
        bad, prov = BadInput(), provenance.Log()
        if plain:
            pieces = byte_shard(inp.paths, *(shard or (0, 1)))
            enc = _encode_pieces(pieces, inp, tokenizer, dtype, cfg, tmp, bad, prov)
            sources = [{"path": str(p), "bytes": p.stat().st_size, "range": [s, e], "sha256": _range_digest((p, s, e))}
                       for p, s, e in pieces]
        else:
            docs = read_documents(inp.paths, fmt=inp.format, text_field=inp.text_field, id_field=inp.id_field, bad=bad)

            def texts():
                for d in docs:
                    prov.add(d.record, d.id, d.where)
                    yield d.text
            with open(f"{tmp}.bin", "wb") as out:
                enc = encode_to(out, (t for t in tqdm(texts(), desc=f"tokenize {prefix.name}", unit="doc",
                                                           file=sys.stderr)), tokenizer, dtype, cfg)
            sources = [{"path": str(p), "bytes": Path(p).stat().st_size, "sha256": file_digest(Path(p))}
                       for p in inp.paths if Path(p).is_file()]
        bad.check(inp.max_bad_fraction, f"tokenize input {inp.paths}")
        lengths = np.frombuffer(enc.lengths, dtype=np.int32)
        document_indices = None if enc.per_doc is None else \
            np.concatenate([[0], np.cumsum(np.frombuffer(enc.per_doc, dtype=np.int32), dtype=np.int64)])
        write_index(f"{tmp}.idx", dtype, lengths, document_indices)
        prov.write(tmp, kept_by or [])
    except BaseException:
        for ext in ("bin", "idx", "prov"):
            Path(f"{tmp}.{ext}").unlink(missing_ok=True)
        raise
    publish_pair(tmp, prefix)
    os.replace(f"{tmp}.prov", f"{prefix}.prov")
    docs, tokens = len(lengths) if enc.per_doc is None else len(enc.per_doc), int(lengths.sum(dtype=np.int64))
    summary = {"documents": docs, "tokens": tokens, "dtype": dtype.name,
               "tokens_per_document": round(tokens / max(1, docs), 1),
               **({} if enc.per_doc is None else sentence_counts(enc))}
    sidecar = {"prefix": str(prefix), **summary, "shard": shard, "append_eod": cfg.append_eod,
               "tokenizer": describe(tokenizer), "sources": sources, "skipped": bad.as_dict()}
    write_atomic(f"{prefix}.json", json.dumps(sidecar, indent=1))
    print_summary(f"tokenize -> {prefix}.bin/.idx" + (f" (shard {shard[0]} of {shard[1]})" if shard else ""),
                  summary, dict(bad.counts))
    marker.mark(summary, outputs=[f"{prefix}.{ext}" for ext in ("bin", "idx", "json", "prov")])
    return summary


def merge_indexed(parts: List[Path], prefix: str | Path) -> dict:
    """Concatenate indexed datasets in order (as Megatron-LM's tools/merge_datasets.py): shards of
    consecutive byte ranges give the bytes of one pass."""
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
    tmp = prefix.with_name(prefix.name + ".tmp")
    dtype, _, _ = concatenate(parts, tmp)
    joined = provenance.concatenate(parts, tmp)
    publish_pair(tmp, prefix)
    if joined:
        os.replace(joined, f"{prefix}.prov")
    docs, tokens = sum(s["documents"] for s in sidecars), sum(s["tokens"] for s in sidecars)
    summary = {"documents": docs, "tokens": tokens, "dtype": dtype.name,
               "tokens_per_document": round(tokens / max(1, docs), 1),
               **{k: sum(s[k] for s in sidecars) for k in SENTENCE_KEYS if k in sidecars[0]}}
    write_atomic(f"{prefix}.json", json.dumps({"prefix": str(prefix), **summary, "parts": sidecars}, indent=1))
    marker.mark(summary, outputs=[f"{prefix}.{ext}" for ext in ("bin", "idx", "json", "prov")
                                  if Path(f"{prefix}.{ext}").exists()])
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
