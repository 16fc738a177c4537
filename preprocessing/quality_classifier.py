"""`make quality-classifier`: train a fastText quality classifier on positive vs negative JSONL (DCLM's recipe).

DCLM (Li et al. 2024) keeps the documents a fastText classifier with word-bigram features scores
as high quality, trained on chosen positives against random web text. This trains the same kind
of model on the user's files, so a cluster that cannot reach a model hub still gets one:

    make quality-classifier OVERRIDES='positive=[good.jsonl] negative=[web.jsonl] output=models/quality.bin'
    make quality-classifier          # the demo: data/demo/quality/{positive,negative}.jsonl, built first

Each example's id (else file:line) picks, by hash, whether it is held out (`heldout_fraction`):
the model never trains on those, and its precision and recall of the positive label on them, at
`threshold`, go into `<output>.json` with the majority-class baseline's accuracy beside its own.
The model is written to a temporary file in the output's folder and renamed into place.

The demo's data (`demo_data`): positives are documents of the demo corpus (Open Shakespeare, what
`make data` fetches); negatives are other documents of it with their words shuffled within each
line — keyword salad, the scrambled text of spam pages. Positives and negatives share their
vocabulary, so word counts alone cannot separate them: only the bigram features can.
"""
from __future__ import annotations

import hashlib
import json
import os
import random
import re
import sys
import tempfile
from pathlib import Path
from typing import Dict, Iterator, List, Tuple

from common.cli import command, overrides_from_env
from common.config import ConfigError

from .config import QualityTrainConfig
from .fetch import fetch
from .records import BadInput, read_documents, write_jsonl

POSITIVE, NEGATIVE = "__label__hq", "__label__lq"
_SPACE = re.compile(r"\s+")
DEMO_DIR = Path("data/demo/quality")


def model_line(text: str, max_chars: int = 0) -> str:
    """The text as the model sees it, in training and in the filter: one line, whitespace runs as one space."""
    return _SPACE.sub(" ", text[:max_chars] if max_chars > 0 else text).strip()


def is_heldout(doc_id: str, fraction: float, seed: int) -> bool:
    u = int(hashlib.sha256(f"quality:{seed}:{doc_id}".encode()).hexdigest()[:12], 16) / 16**12
    return u < fraction


def train_problems(cfg: QualityTrainConfig) -> List[str]:
    """What is wrong with the training config, each with its fix."""
    out = []
    for field in ("positive", "negative"):
        paths = getattr(cfg, field)
        if not paths:
            out.append(f"{field} is empty. Fix: {field}=[file.jsonl,...] (JSONL with a '{cfg.text_field}' field).")
        out += [f"{field}: {p} does not exist. Fix: the path of a JSONL file." for p in paths if not Path(p).exists()]
    for field, low in (("word_ngrams", 1), ("dim", 1), ("epoch", 1), ("min_count", 1), ("bucket", 1),
                       ("threads", 1)):
        if getattr(cfg, field) < low:
            out.append(f"{field}={getattr(cfg, field)} is below {low}. Fix: a positive integer.")
    if not 0.0 < cfg.heldout_fraction < 1.0:
        out.append(f"heldout_fraction={cfg.heldout_fraction} is not in (0, 1). Fix: e.g. 0.1.")
    if not 0.0 <= cfg.threshold <= 1.0:
        out.append(f"threshold={cfg.threshold} is not a probability. Fix: a value in [0, 1].")
    if cfg.lr <= 0:
        out.append(f"lr={cfg.lr} is not positive. Fix: e.g. 0.1.")
    return out


def _examples(cfg: QualityTrainConfig) -> Tuple[List[Tuple[str, str]], List[Tuple[str, str]], Dict[str, int]]:
    """(train, held out) lists of (label, model line); skipped examples counted by reason."""
    train, heldout, skipped = [], [], {}
    for label, paths in ((POSITIVE, cfg.positive), (NEGATIVE, cfg.negative)):
        bad = BadInput()
        for doc in read_documents(paths, fmt="jsonl", text_field=cfg.text_field, id_field="id", bad=bad):
            line = model_line(doc.text, cfg.max_chars)
            if not line:
                skipped["empty text"] = skipped.get("empty text", 0) + 1
                continue
            (heldout if is_heldout(f"{label}:{doc.id}", cfg.heldout_fraction, cfg.seed) else train).append(
                (label, line))
        bad.check(0.0, f"{label[9:]} examples {paths}")
        for reason, n in bad.counts.items():
            skipped[reason] = skipped.get(reason, 0) + n
    return train, heldout, skipped


def heldout_report(model, heldout: List[Tuple[str, str]], threshold: float) -> Dict[str, float]:
    """Precision, recall and accuracy of the positive label at `threshold`, and the majority baseline's accuracy."""
    tp = fp = fn = tn = 0
    for label, line in heldout:
        predicted = positive_probability(model, line) >= threshold
        actual = label == POSITIVE
        tp, fp, fn, tn = tp + (predicted and actual), fp + (predicted and not actual), \
            fn + (actual and not predicted), tn + (not predicted and not actual)
    n = max(1, tp + fp + fn + tn)
    return {"examples": tp + fp + fn + tn, "positives": tp + fn, "precision": tp / max(1, tp + fp),
            "recall": tp / max(1, tp + fn), "accuracy": (tp + tn) / n,
            "majority_baseline_accuracy": max(tp + fn, fp + tn) / n}


def fasttext_predict(model, line: str, k: int = 1, threshold: float = 0.0) -> tuple:
    """(labels, probabilities) of one line, best first: fastText's own `predict` without its final
    `np.array(probs, copy=False)`, which numpy 2 refuses (fasttext-wheel 0.9.2)."""
    if "\n" in line:
        raise ValueError("fastText predicts one line at a time: remove the newlines")
    pairs = model.f.predict(line, k, threshold, "strict")
    return tuple(label for _, label in pairs), [float(prob) for prob, _ in pairs]


def positive_probability(model, line: str) -> float:
    """P(high quality) of one model line (fastText's softmax over the two labels)."""
    labels, probs = fasttext_predict(model, line, k=2)
    return float(dict(zip(labels, probs, strict=True)).get(POSITIVE, 0.0))


def train(cfg: QualityTrainConfig) -> Dict[str, object]:
    """Train on the non-held-out examples, measure on the held-out ones, write the model and its report."""
    import fasttext  # the C++ extension, imported only here and in the filter

    if not hasattr(fasttext, "train_supervised"):
        raise RuntimeError(f"the `fasttext` module at {fasttext.__file__} cannot train (a predict-only package such "
                           "as fasttext-predict installs into the same folder). Fix: `.venv/bin/uv pip uninstall "
                           "fasttext-predict` then `.venv/bin/uv pip install -c constraints.txt --reinstall-package "
                           "fasttext-wheel fasttext-wheel==0.9.2`.")
    problems = train_problems(cfg)
    if problems:
        raise ConfigError(problems, source="quality-classifier")
    train_set, heldout, skipped = _examples(cfg)
    labels = {label for label, _ in train_set}
    if labels != {POSITIVE, NEGATIVE}:
        raise ConfigError([f"the training part has examples of {sorted(labels)} only ({len(train_set)} examples). "
                           "Fix: more positive and negative examples, or a smaller heldout_fraction."],
                          source="quality-classifier")
    out = Path(cfg.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    rng = random.Random(cfg.seed)
    rng.shuffle(train_set)          # fastText's SGD reads the file in order: mixed labels, not all positives first
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        train_file = Path(tmp) / "train.txt"
        train_file.write_text("".join(f"{label} {line}\n" for label, line in train_set), encoding="utf-8")
        model = fasttext.train_supervised(input=str(train_file), wordNgrams=cfg.word_ngrams, dim=cfg.dim,
                                          epoch=cfg.epoch, lr=cfg.lr, minCount=cfg.min_count, bucket=cfg.bucket,
                                          thread=cfg.threads, seed=cfg.seed, verbose=0, loss="softmax")
        report = {"train examples": len(train_set), "skipped": skipped,
                  "heldout": heldout_report(model, heldout, cfg.threshold),
                  "settings": json.loads(json.dumps(cfg, default=vars))}
        tmp_model = Path(tmp) / "model.bin"
        model.save_model(str(tmp_model))
        os.replace(tmp_model, out)                        # same folder: an atomic rename
    report_path = out.with_suffix(".json")
    tmp_report = report_path.with_name(report_path.name + ".tmp")
    tmp_report.write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
    os.replace(tmp_report, report_path)
    return report


def shuffled_lines(text: str, rng: random.Random) -> str:
    """Each line's words in a random order: the same words, no sentence left."""
    out = []
    for line in text.split("\n"):
        words = line.split()
        rng.shuffle(words)
        out.append(" ".join(words))
    return "\n".join(out)


def demo_data(corpus: Path, out_dir: Path = DEMO_DIR, limit: int = 0, seed: int = 0) -> Tuple[Path, Path]:
    """positive.jsonl (every other corpus document, by position) and negative.jsonl (the others, words shuffled
    within each line) from the demo corpus; `limit` > 0 keeps the first `limit` documents of the corpus."""
    rng = random.Random(seed)

    def docs() -> Iterator[dict]:
        with open(corpus, encoding="utf-8") as f:
            for i, line in enumerate(f):
                if limit and i >= limit:
                    return
                yield json.loads(line)
    positives, negatives = [], []
    for i, doc in enumerate(docs()):
        if i % 2 == 0:
            positives.append({"id": doc["id"], "text": doc["text"]})
        else:
            negatives.append({"id": doc["id"], "text": shuffled_lines(doc["text"], rng), "derived": "words shuffled"})
    out_dir.mkdir(parents=True, exist_ok=True)
    write_jsonl(out_dir / "positive.jsonl", positives)
    write_jsonl(out_dir / "negative.jsonl", negatives)
    return out_dir / "positive.jsonl", out_dir / "negative.jsonl"


def config_from(overrides: List[str]) -> QualityTrainConfig:
    """The training config: the schema's defaults, then `key=value` overrides (OmegaConf dotlist syntax)."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    try:
        merged = OmegaConf.merge(OmegaConf.structured(QualityTrainConfig), OmegaConf.from_dotlist(overrides))
        return OmegaConf.to_object(merged)
    except OmegaConfBaseException as err:
        raise ConfigError([f"{err}. Fix: key=value with a field of QualityTrainConfig "
                           "(preprocessing/config.py)."], source="quality-classifier") from None


@command(also=(FileNotFoundError, RuntimeError))
def main(argv: List[str] | None = None) -> int:
    """Overrides from the arguments, else $OVERRIDES (the Makefile's)."""
    overrides = list(sys.argv[1:] if argv is None else argv) or overrides_from_env()
    if not any(o.split("=", 1)[0] in ("positive", "negative") for o in overrides):      # the demo
        pos, neg = demo_data(Path(fetch("shakespeare")))
        overrides = [f"positive=[{pos}]", f"negative=[{neg}]", f"output={DEMO_DIR / 'model.bin'}", "dim=64",
                     "bucket=200000", "epoch=10", "lr=1.0", *overrides]
    cfg = config_from(overrides)
    report = train(cfg)
    h = report["heldout"]
    print(f"quality classifier -> {cfg.output} ({report['train examples']} train examples; skipped "
          f"{report['skipped'] or 'none'})\nheld out: {h['examples']} examples, precision {h['precision']:.3f}, "
          f"recall {h['recall']:.3f}, accuracy {h['accuracy']:.3f} (majority baseline "
          f"{h['majority_baseline_accuracy']:.3f}) at threshold {cfg.threshold}; report: "
          f"{Path(cfg.output).with_suffix('.json')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
