"""The `warc` stage: input.paths' WARC/WET files -> documents, part k of n from its own group of files.

One array task per part (the document passes' parts: dedup.shards, or filters.shards without
dedup): the sorted files are cut into n consecutive groups, task k reads group k record by record
(warc.py) and writes `<work_dir>/warc/part-k` (documents, in file order) and `removed-k` (`where`:
file@offset and URL, `reason`: one line per record that is not a document), so the passes after it in `stages`
(`extract`, `url_filter`, `filter`, ...) read part k as they read any pass's. Joined in order,
the parts are the same documents for any n. A part is resumable (its files, sizes and mtimes, and
the `warc` settings decide it); damaged records over input.max_bad_fraction fail the part,
naming the reasons and the first places.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, List, Optional

from ..config import PreprocessConfig
from ..fetch import fetch
from ..markers import Marker, fingerprint, print_summary
from ..parts import add_summaries, part_paths
from ..provenance import stamp
from ..records import BadInput, BadInputError
from ..stages import PASSES, _settings, part_count, register_stage
from .warc import DAMAGE_REASONS, WarcCounts, WarcSettings, is_warc_name, read_warc


def warc_files(paths: List[str]) -> List[Path]:
    """input.paths as WARC/WET files, sorted: a folder stands for the WARC/WET files under it."""
    out = []
    for p in map(Path, paths):
        if p.is_dir():
            out.extend(sorted(f for f in p.rglob("*") if f.is_file() and is_warc_name(f.name)))
        elif p.is_file():
            out.append(p)
        else:
            raise FileNotFoundError(f"input {p} does not exist (input.paths)")
    bad = [str(f) for f in out if not is_warc_name(f.name)]
    if bad:
        raise ValueError(f"input.paths: {bad[:3]} are not WARC/WET files (.warc, .warc.gz, .wet, .wet.gz): the `warc` "
                         "stage reads those only. Fix: list WARC files, or drop `warc` from stages for other input.")
    return sorted(out)


def files_of_part(files: List[Path], k: int, n: int) -> List[Path]:
    """Group k of n consecutive groups of the files (empty when there are fewer files than parts)."""
    return files[k * len(files) // n:(k + 1) * len(files) // n]


def read_part(cfg: PreprocessConfig, files: List[Path], k: int, n: int) -> Dict[str, Any]:
    """Part k: its files' documents and skipped records; resumable; returns its summary."""
    out, removed_out = part_paths(cfg, "warc", k, n)
    settings = [_settings(cfg.warc), cfg.input.max_bad_fraction, [str(f) for f in files], "provenance"]
    marker = Marker(out.parent, f"warc-{k:05d}-of-{n:05d}", fingerprint(settings, files))
    done = marker.done(announce=False)
    if done is not None:
        return done
    read_settings = WarcSettings(tuple(t.lower() for t in cfg.warc.content_types), cfg.warc.ok_status_only)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp, tmp_removed = out.with_name(out.name + ".tmp"), removed_out.with_name(removed_out.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as kept_f, open(tmp_removed, "w", encoding="utf-8") as removed_f:
        counts = WarcCounts(on_skip=lambda reason, where: removed_f.write(
            json.dumps({"where": where, "reason": reason}, ensure_ascii=False) + "\n"))
        for path in files:
            for doc in read_warc(path, counts, read_settings):
                # the record's place in its WARC file, not in this work part: prepare keeps it (provenance.py)
                stamp(doc, f"{path}:{doc['source'].rsplit('@', 1)[1]}", False)
                kept_f.write(json.dumps(doc, ensure_ascii=False) + "\n")
    bad = BadInput(good=counts.records - counts.damaged)
    for reason in (r for r in DAMAGE_REASONS if counts.skipped[r]):
        for where in counts.examples[reason]:
            bad.add(reason, where)
        bad.counts[reason] = counts.skipped[reason]
    try:
        bad.check(cfg.input.max_bad_fraction, f"warc part {k + 1} of {n} ({[str(f) for f in files]})")
    except BadInputError:
        tmp.unlink()
        tmp_removed.unlink()
        raise
    tmp.replace(out)
    tmp_removed.replace(removed_out)
    summary = {"files": len(files), "records": counts.records, "documents": counts.documents,
               "skipped by reason": dict(counts.skipped), "html decoded by": dict(counts.decode)}
    marker.mark(summary, outputs=[out, removed_out])
    return summary


@register_stage("warc", shards=part_count)
def warc(cfg: PreprocessConfig, shard: Optional[int] = None) -> dict:
    """WARC/WET files -> documents, one task per part, each reading its own group of files. The config's `fetch`
    runs first (as in `prepare`), so a pipeline that starts here can fetch its WARC files."""
    for what in cfg.fetch:
        fetch(what)
    n, files = part_count(cfg), warc_files(list(cfg.input.paths))
    total = add_summaries([read_part(cfg, files_of_part(files, k, n), k, n)
                           for k in (range(n) if shard is None else [shard])])
    rows = {key: value for key, value in total.items() if not isinstance(value, dict)}
    for table in ("skipped by reason", "html decoded by"):
        rows.update({f"{table}: {what}": count for what, count in total.get(table, {}).items()})
    print_summary("WARC/WET records" + ("" if shard is None else f": part {shard + 1} of {n}"), rows)
    return total


PASSES.add("warc")          # the passes after it in `stages` read its parts
