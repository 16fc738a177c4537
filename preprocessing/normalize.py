"""Stage 1: Unicode normalisation, control-character stripping, exact dedup."""
from __future__ import annotations

import hashlib
import re
import unicodedata
from typing import Optional

# C0/C1 controls except tab and newline; carriage returns become newlines.
_CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f]")


def normalize_text(text: str, form: str = "NFC") -> str:
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    return _CONTROL.sub("", unicodedata.normalize(form, text))


def content_hash(text: str) -> str:
    return hashlib.blake2b(text.encode("utf-8"), digest_size=16).hexdigest()


class ExactDedup:
    """Remembers the first id of each content hash; later equal documents are duplicates."""

    def __init__(self) -> None:
        self.first: dict[str, str] = {}

    def duplicate_of(self, doc_id: str, text: str) -> Optional[str]:
        key = content_hash(text)
        first = self.first.get(key)
        if first is None:
            self.first[key] = doc_id
        return first
