"""In-loop downstream evals: lm-eval-harness multiple-choice tasks scored on the live model, no export.

`eval.downstream_tasks: [bigbench_hyperbaton, ...]` names task YAML + JSONL pairs that `make eval-data`
wrote (evals/tasks.py) under `eval.downstream_tasks_dir`. Every `eval.downstream_interval` steps (0: at
each validation) and at the end, each task's first `eval.downstream_limit` documents are scored as
`make eval` scores them with lm-eval's `hf` model on the export of the same weights:

* context = doc_to_text (zero-shot, no description), continuation = target_delimiter + choice;
* tokens as lm-eval's `TemplateLM._encode_pair` + `HFLM.tok_encode`: the context's trailing whitespace moves
  to the continuation, whole = encode(context + continuation), continuation = whole[len(encode(context)):],
  with the tokenizer the export writes, loaded as lm-eval loads it (AutoTokenizer, fast);
* input = (context + continuation)[-(max_length + 1):][:-1] (left truncation), max_length the export's
  position limit; log-likelihood = fp32 sum of the continuation's log-probs, softmax over the
  tokenizer's vocabulary (not the padded table);
* acc = argmax of the sums is gold (a list of golds: any), acc_norm = argmax of sum / len(choice) in characters.

Requests are built once, sorted by length, dealt round-robin over the DP ranks (each rank runs the same
number of micro-batches: ZeRO-3 and expert parallelism need every rank in every forward), and put together
with a MAX all-reduce (-inf where a rank did not score a request: the values come through unchanged).
"""
from __future__ import annotations

import itertools
import json
import math
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional

import yaml

from ..data.tokenizer import run_tokenizer
from .contamination import clean_scores, excluded_items


@dataclass
class Task:
    name: str
    docs: List[dict]
    text: str            # doc field of the prompt (doc_to_text)
    choices: str         # doc_to_choice field
    target: str          # doc_to_target field
    delimiter: str       # target_delimiter


def load_task(tasks_dir: Path, name: str, limit: Optional[int]) -> Task:
    """A `make eval-data` multiple-choice task: its YAML and the first `limit` documents of its JSONL."""
    path = Path(tasks_dir) / f"{name}.yaml"
    if not path.exists():
        have = sorted(p.stem for p in Path(tasks_dir).glob("*.yaml"))
        raise FileNotFoundError(f"eval.downstream_tasks names {name}; {path} does not exist ({tasks_dir} has {have}). "
                                f"Fix: `make eval-data TASKS={name.removeprefix('bigbench_')}` or pick one of those.")
    spec = yaml.safe_load(path.read_text())
    if spec.get("output_type") != "multiple_choice" or spec.get("num_fewshot") or spec.get("description"):
        raise ValueError(f"{path}: the in-loop scorer takes zero-shot multiple_choice tasks without a description "
                         f"(output_type here: {spec.get('output_type')}). Fix: score it with `make eval`.")
    data = Path(spec["dataset_kwargs"]["data_files"][spec.get("test_split", "test")])
    with data.open() as f:
        docs = [json.loads(line) for line in itertools.islice(f, limit)]
    fields = {k: spec.get(k) for k in ("doc_to_text", "doc_to_choice", "doc_to_target")}
    if not docs or any(not isinstance(v, str) or v not in docs[0] for v in fields.values()):
        raise ValueError(f"{path}: doc_to_text/doc_to_choice/doc_to_target must name fields of its documents "
                         f"(are {fields}); templates are for `make eval`.")
    return Task(name, docs, fields["doc_to_text"], fields["doc_to_choice"], fields["doc_to_target"],
                spec.get("target_delimiter", " "))


class LmEvalEncoder:
    """lm-eval's HFLM tokenisation with the tokenizer the export writes (pretrain/hf/convert.py)."""

    def __init__(self, cfg):
        from transformers import AutoTokenizer

        ours = run_tokenizer(cfg, "eval.downstream_tasks")
        self.vocab_size = ours.vocab_size             # the export's vocabulary: its logits have these columns
        with tempfile.TemporaryDirectory() as tmp:
            ours.save(tmp)
            self.tok = AutoTokenizer.from_pretrained(tmp, use_fast=True)
        self.prefix = self.tok.bos_token_id if self.tok.bos_token_id is not None else self.tok.eos_token_id
        self.prefix_text = self.tok.decode(self.prefix)

    def encode(self, text: str) -> List[int]:
        # HFLM.tok_encode: no add_special_tokens argument, unless the text starts with the prefix token
        kwargs = {"add_special_tokens": False} if text.startswith(self.prefix_text) else {}
        return self.tok.encode(text, **kwargs)

    def pair(self, context: str, continuation: str) -> tuple[List[int], List[int]]:
        if context == "":                             # TemplateLM.loglikelihood: the prefix token as context
            return [self.prefix], self.encode(continuation)
        n_spaces = len(context) - len(context.rstrip())
        if n_spaces:
            context, continuation = context[:-n_spaces], context[-n_spaces:] + continuation
        whole, ctx = self.encode(context + continuation), self.encode(context)
        return ctx, whole[len(ctx):]


@dataclass
class Request:
    task: int
    doc: int
    choice: int
    tokens: List[int]      # model input, truncated on the left to max_length
    n_cont: int            # continuation tokens: the last n_cont labels

    @property
    def labels(self) -> List[int]:
        return self.tokens[1:]


def requests_of(tasks: List[Task], enc: LmEvalEncoder, max_length: int) -> List[Request]:
    out = []
    for t, task in enumerate(tasks):
        for d, doc in enumerate(task.docs):
            for c, choice in enumerate(doc[task.choices]):
                ctx, cont = enc.pair(doc[task.text], f"{task.delimiter}{choice}")
                # tokens holds input + the last label: (ctx + cont)[-(max_length + 1):]
                out.append(Request(t, d, c, (ctx + cont)[-(max_length + 1):], len(cont)))
    return out


def accuracy(task: Task, lls: List[List[float]]) -> Dict[str, float]:
    """lm-eval's ConfigurableTask.process_results for multiple_choice, averaged over the documents; gold_ll, the
    mean log-likelihood of the (first) gold choice, moves while a small model's accuracy sits at chance."""
    import numpy as np
    acc = acc_norm = gold_ll = 0.0
    for doc, ll in zip(task.docs, lls, strict=True):
        choices, gold = doc[task.choices], doc[task.target]
        lengths = np.array([float(len(c)) for c in choices])
        pred, pred_norm = np.argmax(ll), np.argmax(np.array(ll) / lengths)
        golds = gold if isinstance(gold, list) else [gold]
        acc += float(pred in golds)
        acc_norm += float(pred_norm in golds)
        gold_ll += ll[golds[0]]
    n = len(task.docs)
    return {"acc": acc / n, "acc_norm": acc_norm / n, "gold_ll": gold_ll / n, "n": n}


def per_item(task: Task, lls: List[List[float]]) -> Dict[str, List[float]]:
    """acc and acc_norm of each document (what `accuracy` averages), for the clean subset's scores."""
    import numpy as np
    out: Dict[str, List[float]] = {"acc": [], "acc_norm": []}
    for doc, ll in zip(task.docs, lls, strict=True):
        golds = doc[task.target] if isinstance(doc[task.target], list) else [doc[task.target]]
        lengths = np.array([float(len(c)) for c in doc[task.choices]])
        out["acc"].append(float(np.argmax(ll) in golds))
        out["acc_norm"].append(float(np.argmax(np.array(ll) / lengths) in golds))
    return out


class DownstreamEvals:
    """What the loop calls (pretrain/loop.py): `due(step, final)` and `run(step)` on every rank."""

    def __init__(self, cfg, engine, metrics=None):
        self.cfg, self.engine, self.metrics = cfg, engine, metrics
        e = cfg.eval
        self.tasks = [load_task(Path(e.downstream_tasks_dir), name, e.downstream_limit) for name in e.downstream_tasks]
        self.requests: Optional[List[Request]] = None      # built at the first run (tokenizer load)
        self.vocab_size = 0
        self.excluded: List[List[int]] = []                 # per task: items sharing a 13-gram with the train data

    @classmethod
    def from_config(cls, cfg, engine, metrics) -> Optional[DownstreamEvals]:
        return cls(cfg, engine, metrics) if cfg.eval.downstream_tasks else None

    def due(self, step: int, final: bool) -> bool:
        every = self.cfg.eval.downstream_interval or self.cfg.eval.eval_interval
        return final or bool(every and step % every == 0)

    def _build(self) -> None:
        enc = LmEvalEncoder(self.cfg)
        self.vocab_size = enc.vocab_size
        reqs = requests_of(self.tasks, enc, self.cfg.derived.max_position_embeddings)
        eod = run_tokenizer(self.cfg, "eval.downstream_tasks").eod
        found = excluded_items(self.cfg, {t.name: t.docs for t in self.tasks}, enc.tok.decode, eod)   # all ranks
        self.excluded = [found[t.name] for t in self.tasks]
        self.requests = sorted(reqs, key=lambda r: -len(r.tokens))     # like lengths share a micro-batch

    def _batches(self, mine: List[int], rows: int) -> List[tuple[List[int], dict]]:
        """(request indices, micro-batch) of this rank; short ones padded with a repeat of its first row (a
        result not kept) and every row on the right to a multiple of TP (sequence parallel splits it)."""
        import torch
        tp = self.engine.layout()["tp"]
        out = []
        for i in range(0, len(mine), rows):
            idx = mine[i:i + rows]
            reqs = [self.requests[j] for j in idx]
            reqs += [reqs[0]] * (rows - len(reqs))
            width = max(len(r.tokens) - 1 for r in reqs)
            width = -(-width // tp) * tp
            tokens = torch.zeros((rows, width), dtype=torch.long)
            labels = torch.zeros((rows, width), dtype=torch.long)
            for k, r in enumerate(reqs):
                tokens[k, :len(r.tokens) - 1] = torch.tensor(r.tokens[:-1])
                labels[k, :len(r.tokens) - 1] = torch.tensor(r.labels)
            position_ids = torch.arange(width).unsqueeze(0).expand(rows, width).contiguous()
            out.append((idx, {"tokens": tokens, "labels": labels, "position_ids": position_ids}))
        return out

    def scores(self) -> tuple[Dict[str, Dict[str, float]], List[float]]:
        """({task: {"acc", "acc_norm", "gold_ll", "n"}}, the log-likelihood of each request (task, doc, choice
        order)), on every rank."""
        import torch
        import torch.distributed as dist
        if self.requests is None:
            self._build()
        n, dp, rank = len(self.requests), self.engine.dp_size, self.engine.dp_rank
        rows = self.cfg.batch.micro_batch_size
        mine = list(range(rank, n, dp))
        batches = self._batches(mine, rows)
        most = -(-n // dp)                             # requests of the rank with the most
        per_rank = -(-most // rows)
        while len(batches) < per_rank:                 # every rank runs as many forwards (ZeRO-3, EP)
            batches.append(([], self._batches([0], rows)[0][1]))
        lls = torch.full((n,), -math.inf, dtype=torch.float64)
        for idx, batch in batches:
            logprobs = self.engine.token_logprobs([batch], self.vocab_size)[0]
            for k, j in enumerate(idx):
                r = self.requests[j]
                end = len(r.tokens) - 1
                lls[j] = float(logprobs[k, end - r.n_cont:end].sum())       # fp32 sum, as lm-eval's
        device = "cuda" if torch.cuda.is_available() and dist.get_backend() == "nccl" else "cpu"
        lls = lls.to(device)
        dist.all_reduce(lls, op=dist.ReduceOp.MAX)
        lls = lls.cpu().tolist()
        per_doc = [[[0.0] * len(d[t.choices]) for d in t.docs] for t in self.tasks]
        ordered = []
        for r, ll in zip(self.requests, lls, strict=True):
            per_doc[r.task][r.doc][r.choice] = ll
        for docs in per_doc:
            ordered += [ll for doc in docs for ll in doc]
        return {task.name: {**accuracy(task, per_doc[t]), **clean_scores(per_item(task, per_doc[t]), self.excluded[t])}
                for t, task in enumerate(self.tasks)}, ordered

    def run(self, step: int) -> dict:
        started = time.perf_counter()
        results, _ = self.scores()
        record = {"kind": "downstream", "step": step, "tasks": results, "seconds": time.perf_counter() - started,
                  "time": time.time()}
        m = self.metrics
        if m is not None and m.enabled:
            m.record(record)                  # metrics.jsonl; the per-task numbers go to every tracker below
            m.log_scalars(step, {f"downstream/{name}/{k}": v for name, r in results.items() for k, v in r.items()
                                 if k != "n"})
            shown = " | ".join(f"{name} acc {r['acc']:.4f} acc_norm {r['acc_norm']:.4f} gold_ll {r['gold_ll']:.3f} "
                               f"(n={r['n']}); clean acc {r['acc_clean']:.4f} acc_norm {r['acc_norm_clean']:.4f} "
                               f"({r['excluded']} excluded)" for name, r in results.items())
            print(f"downstream step {step}: {shown} | {record['seconds']:.1f} s", flush=True)
        return record
