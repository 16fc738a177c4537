"""The evaluation tasks' items, where both `make eval-data` (evals/tasks.py) and decontamination read them.

BIG-bench: `benchmark_tasks/<task>/task.json` straight out of the `bigbench==1.0.0` sdist (Apache-2.0;
fetched once from pip's sources into the registry cache, only the named files are read and kept in
data/cache/bigbench-1.0.0/). User eval sets: JSONL files, one item per line, whose named fields hold the
item's text. Both give (item number, input, answers) for the decontamination index.
"""
from __future__ import annotations

import json
import os
import tarfile
from pathlib import Path
from typing import Dict, Iterable, Iterator, List, Tuple

from common.files import exclusive

from .fetch import CACHE, download

BIGBENCH = "bigbench==1.0.0"
BIGBENCH_TASKS = Path("data/cache/bigbench-1.0.0")       # <task>/task.json, taken out of the sdist once
DEFAULT_BIGBENCH = ("hyperbaton", "winowhy", "social_iqa", "strategyqa")
TASKS_IN_SDIST = "bigbench-1.0.0/bigbench/benchmark_tasks/"
LISTING = "single_file_tasks.txt"                          # the sdist's <task>/task.json names, one a line
Item = Tuple[int, str, List[str]]                           # (item number, input text, answer texts)


def bigbench_task_path(name: str, cache: Path = BIGBENCH_TASKS) -> Path:
    return cache / name / "task.json"


def bigbench_task_files(names: Iterable[str], cache: Path = BIGBENCH_TASKS,
                        registry: Path | None = None) -> Dict[str, dict]:
    """task name -> parsed task.json. The files come out of the sdist (358 MB, downloaded once into the
    registry cache data/cache/registry, read without unpacking the rest) and are kept as
    <cache>/<task>/task.json: a task read once needs neither the archive nor the network again."""
    names = ensure_bigbench_tasks(names, cache, registry)
    return {n: json.loads(bigbench_task_path(n, cache).read_bytes()) for n in names}


def ensure_bigbench_tasks(names: Iterable[str], cache: Path = BIGBENCH_TASKS,
                          registry: Path | None = None) -> List[str]:
    """The names (deduplicated, in order), each task.json extracted into <cache> where it is not yet there."""
    names = list(dict.fromkeys(names))
    missing = [n for n in names if not bigbench_task_path(n, cache).is_file()]
    listing = cache / LISTING
    if missing and listing.is_file():        # an unknown name is refused without reading the archive again
        known = set(listing.read_text().split())
        _refuse([n for n in missing if n not in known])
    if missing:
        cache.mkdir(parents=True, exist_ok=True)
        # one reader of the archive at a time (each read is ~6 s of CPU gunzipping 358 MB): a test session's three
        # pytest processes and the demo pipeline's decontaminate stage ask at once; the later ones find the files
        with exclusive(cache / ".extract.lock"):
            missing = [n for n in names if not bigbench_task_path(n, cache).is_file()]
            if missing:
                extract_bigbench_tasks(missing, cache, registry)
    return names


def _refuse(unknown: List[str]) -> None:
    if unknown:
        raise ValueError(f"{BIGBENCH} has no benchmark_tasks/<task>/task.json for {sorted(unknown)} (tasks with "
                         "subtasks or programmatic tasks are not single task.json files). Fix: choose other TASKS.")


def extract_bigbench_tasks(names: List[str], cache: Path, registry: Path | None = None) -> set:
    """benchmark_tasks/<task>/task.json of each name, out of the sdist into <cache>/<task>/task.json. The first
    extraction reads the whole archive (seconds) to keep the list of its single-file tasks in <cache>/LISTING."""
    wanted = {f"{TASKS_IN_SDIST}{n}/task.json": n for n in names}
    sdist = download(BIGBENCH, "sdist", registry or CACHE)
    listing = cache / LISTING
    known = None if listing.is_file() else []
    found = set()
    with tarfile.open(sdist) as tar:
        for member in tar:
            parts = member.name.removeprefix(TASKS_IN_SDIST).split("/")
            if known is not None and member.name.startswith(TASKS_IN_SDIST) and parts[1:] == ["task.json"]:
                known.append(parts[0])
            if member.name in wanted:
                out = bigbench_task_path(wanted[member.name], cache)
                out.parent.mkdir(parents=True, exist_ok=True)
                tmp = out.with_name(f"task.json.{os.getpid()}.tmp")
                tmp.write_bytes(tar.extractfile(member).read())
                tmp.replace(out)                           # whole files only, also with two writers
                found.add(wanted[member.name])
                if len(found) == len(wanted) and known is None:
                    break
    if known is not None:
        listing.parent.mkdir(parents=True, exist_ok=True)
        tmp = listing.with_name(f"{LISTING}.{os.getpid()}.tmp")
        tmp.write_text("".join(f"{n}\n" for n in sorted(known)))
        tmp.replace(listing)
    _refuse(list(set(wanted.values()) - found))
    return found


def _texts(value) -> List[str]:
    """A field's text(s): a string, or the strings of a list (BIG-bench `target` may be either)."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, str)]
    return []


def bigbench_items(task: dict) -> Iterator[Item]:
    """Every example of a task.json: its input, and as answers its `target` text(s) and the
    `target_scores` choices (all of them: the prompt BIG-bench formats shows every choice)."""
    for k, ex in enumerate(task["examples"]):
        answers = _texts(ex.get("target")) + list(ex.get("target_scores") or ())
        yield k, ex.get("input", ""), [a for a in answers if a.strip()]


def jsonl_items(path: Path, fields: List[str]) -> Iterator[Item]:
    """One item per line of a JSONL eval file: `fields[0]` is the input, the other fields its answers (a
    list field gives one answer per element). Item number: the line number. A line that is not a JSON
    object with a text in `fields[0]` raises, naming file:line (an eval set read wrong is a leak)."""
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{lineno}: not JSON ({err.msg}). Fix the eval file.") from None
            if not isinstance(obj, dict) or not isinstance(obj.get(fields[0]), str):
                raise ValueError(f"{path}:{lineno}: no text field {fields[0]!r} (decontaminate.eval_files fields="
                                 f"{fields}). Fix: name the field that holds the item's input first.")
            answers = [a for name in fields[1:] for a in _texts(obj.get(name))]
            yield lineno, obj[fields[0]], [a for a in answers if a.strip()]
