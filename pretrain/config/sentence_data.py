"""The sentence-level data the encoder objectives read, checked at compose time when the blend exists.

`make pretrain` composes again after it prepared the data, so a blend that `data.preprocess` writes is
checked too. Read with the standard library (blend.json and the .idx headers, as epochs.py does).
"""
from __future__ import annotations

from pathlib import Path

from .blend_file import blend_body
from .epochs import index_documents
from .schema import JobConfig


def sentence_data_problems(cfg: JobConfig, add) -> None:
    """The blend, when it exists already (`make pretrain` composes again after preparing the data): sentence-level
    (preprocessing's tokenize.split_sentences), and with a sentence-pair head, documents that hold a pair."""
    if cfg.objective.causal or not cfg.data.blend or not Path(cfg.data.blend).is_file():
        return
    blend = Path(cfg.data.blend)
    spec = blend_body(cfg.data.blend)
    if spec is None:
        return                          # not JSON: the loader names the file
    counts = spec.get("sentences")
    fix = ("Fix: preprocess with tokenize.split_sentences=true (preprocessing/conf/demo-sentences.yaml; "
           "docs/objectives.md), or data=demo-sentences.")
    if not counts:
        add(f"data.blend={blend} is document-level (no sentence counts): objective.name={cfg.objective.name} reads "
            f"one sequence per sentence. {fix}")
        return
    head = cfg.objective.masked_lm.binary_head
    if cfg.objective.name != "masked_lm" or not head:
        return
    train = counts.get("train", {})
    prefixes = [Path(item["prefix"]) for item in spec["splits"].get("train", [])]
    documents = sum(index_documents(p if p.is_absolute() else blend.parent / p) for p in prefixes)
    unusable = sum(train.get(k, 0) for k in ("single_sentence_documents", "empty_documents",
                                               "long_sentence_documents"))
    if documents - unusable <= 0:
        add(f"objective.masked_lm.binary_head={head} on {blend}: none of its {documents} train documents has two "
            f"sentences to pair ({train.get('single_sentence_documents', 0)} single-sentence, "
            f"{train.get('long_sentence_documents', 0)} with a sentence over 512 tokens). Fix: "
            "objective.masked_lm.binary_head=null (masked LM alone), or a corpus of multi-sentence documents.")
