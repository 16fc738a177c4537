"""Sentence splitting for the sentence-level objectives (BERT NSP/SOP pairs, BART sentence permutation).

The splitter is spaCy's rule-based `sentencizer` on a blank English pipeline (`spacy.blank("en")`):
spaCy 3.8 is already pinned (a datatrove dependency), needs no model download (the Hugging Face hub and
spaCy's model packages are out of reach at run time), and its English tokenizer keeps abbreviations
such as "Mr.", "St.", "Dr.", "e.g." as one token, so the sentencizer - which ends a sentence at a
punctuation *token* (". ! ?" and their equivalents in other scripts) - does not split after them ("cf." and
"etc." it does cut). It needs no per-corpus model, unlike NLTK's Punkt (its English model is hub data); against
Punkt trained on the demo corpus and pySBD: preprocessing/bench/sentences.py, docs/sentence-data.md.

Nothing is dropped: the sentences of a document are spans of the document itself, stripped of the
whitespace around them, so their concatenation has the document's non-whitespace characters in order;
a whitespace-only span (a run of newlines spaCy tokenises on its own) has none and is left out.
"""
from __future__ import annotations

from functools import lru_cache
from typing import Iterable, Iterator, List

# spaCy refuses texts over `nlp.max_length` (default 1e6 characters) because its parser and NER take
# about 1 GB per 100k characters; this pipeline has neither (tokenizer + sentencizer are linear in the
# text), so a long document is split, not refused.
MAX_CHARS = 10**9


@lru_cache(maxsize=1)
def pipeline():
    """The blank English pipeline with the sentencizer, loaded once per process (spawned workers load their own)."""
    import spacy

    nlp = spacy.blank("en")
    nlp.add_pipe("sentencizer")
    nlp.max_length = MAX_CHARS
    return nlp


def split_sentences(texts: Iterable[str], batch_size: int = 256) -> Iterator[List[str]]:
    """One list of sentence strings per text, in order (an empty or whitespace-only text gives [])."""
    for doc in pipeline().pipe(texts, batch_size=batch_size):
        yield [s for s in (sent.text.strip() for sent in doc.sents) if s]


def split_one(text: str) -> List[str]:
    """The sentences of one text (`split_sentences` is faster on many: spaCy batches them)."""
    return next(split_sentences([text]))
