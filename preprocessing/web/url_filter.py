"""The `url_filter` pass: documents whose URL is on a block list are removed, the list and rule kind the reason.

Lists are files the user gives (`url_filter` section, preprocessing/config.py): UT1 blacklist
folders (`<dir>/<category>/domains`, `<dir>/<category>/urls`) and plain lists of domains, URLs,
substrings and regular expressions, one entry a line, `#` comments. A removal's reason is
`url/<category>/<kind>` (kind: domain, url, substring, regex; a plain list's category is its
file name without extension).

A domain entry blocks the host and its subdomains, found by walking the host's labels up to its
registrable domain as the public-suffix list (publicsuffixlist's bundled snapshot, no network)
draws it: `example.co.uk` blocks `a.b.example.co.uk` and not `notexample.com`, and an entry that is
itself a public suffix (`co.uk`, `github.io`) blocks only that exact host, never every site under
it. A URL entry (`host/path`) blocks that host or a subdomain whose URL path starts with the entry's.
"""
from __future__ import annotations

import ipaddress
import re
from collections import Counter
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Tuple
from urllib.parse import urlsplit

from publicsuffixlist import PublicSuffixList

from ..config import PreprocessConfig, UrlFilterConfig
from ..parts import DocumentPass
from ..stages import _settings, register_pass

_PSL: Optional[PublicSuffixList] = None


def _psl() -> PublicSuffixList:
    global _PSL
    if _PSL is None:
        _PSL = PublicSuffixList()          # the snapshot in the wheel: no download at run time
    return _PSL


def _entries(path: Path) -> Iterator[Tuple[int, str]]:
    with open(path, encoding="utf-8", errors="replace") as f:
        for lineno, line in enumerate(f, 1):
            entry = line.strip()
            if entry and not entry.startswith("#"):
                yield lineno, entry


def _host_path(url: str) -> Tuple[str, str]:
    """(lowercased host without a leading www., path with query) of a URL or of a scheme-less list entry."""
    parts = urlsplit(url if "//" in url else f"//{url}")
    host = (parts.hostname or "").rstrip(".")
    host = host[4:] if host.startswith("www.") else host
    return host, parts.path + (f"?{parts.query}" if parts.query else "")


def _parents(host: str) -> List[str]:
    """The host and its parent domains down to its registrable domain (the host alone for an IP address or a
    host that is itself a public suffix)."""
    try:
        ipaddress.ip_address(host.strip("[]"))
        return [host]
    except ValueError:
        pass
    registrable = _psl().privatesuffix(host)
    if registrable is None:
        return [host]
    labels = host.split(".")
    stop = len(labels) - registrable.count(".") - 1
    return [".".join(labels[i:]) for i in range(stop + 1)]


class UrlBlockList:
    """Every list of a `url_filter` section, loaded once; `reason(url)` -> `url/<category>/<kind>` or None."""

    def __init__(self, cfg: UrlFilterConfig):
        self.domains: Dict[str, str] = {}                   # domain -> category
        self.urls: Dict[str, List[Tuple[str, str]]] = {}    # host -> [(path prefix, category)]
        self.substrings: List[Tuple[str, str]] = []
        self.regexes: List[Tuple[re.Pattern, str]] = []
        self.entries: Counter = Counter()                   # (category:kind) -> entries loaded
        for directory in map(Path, cfg.ut1_dirs):
            if not directory.is_dir():
                raise FileNotFoundError(f"url_filter.ut1_dirs: {directory} is not a folder. Fix: the UT1 blacklist "
                                        "folder holding <category>/domains and <category>/urls.")
            for category_dir in sorted(p for p in directory.iterdir() if p.is_dir()):
                if cfg.categories and category_dir.name not in cfg.categories:
                    continue
                for kind in ("domains", "urls"):
                    if (category_dir / kind).is_file():
                        self._load(category_dir / kind, category_dir.name, kind[:-1])
        for key, kind in (("domain_files", "domain"), ("url_files", "url"), ("substring_files", "substring"),
                          ("regex_files", "regex")):
            for path in map(Path, getattr(cfg, key)):
                if not path.is_file():
                    raise FileNotFoundError(f"url_filter.{key}: {path} does not exist. Fix: the path of a list, "
                                            "one entry a line.")
                self._load(path, path.stem, kind)

    def _load(self, path: Path, category: str, kind: str) -> None:
        for lineno, entry in _entries(path):
            if kind == "domain":
                self.domains.setdefault(_host_path(entry)[0], category)
            elif kind == "url":
                host, prefix = _host_path(entry)
                self.urls.setdefault(host, []).append((prefix.rstrip("/"), category))
            elif kind == "substring":
                self.substrings.append((entry.lower(), category))
            else:
                try:
                    self.regexes.append((re.compile(entry), category))
                except re.error as err:
                    raise ValueError(f"{path}:{lineno}: {entry!r} is not a regular expression ({err}). Fix: correct "
                                     "or delete that line.") from None
            self.entries[f"{category}:{kind}"] += 1

    def reason(self, url: str) -> Optional[str]:
        host, path = _host_path(url)
        parents = _parents(host) if host else []
        for domain in parents:
            if domain in self.domains:
                return f"url/{self.domains[domain]}/domain"
        for domain in parents:
            for prefix, category in self.urls.get(domain, ()):
                if path == prefix or path.startswith(prefix + "/") or not prefix or path.startswith(prefix + "?"):
                    return f"url/{category}/url"
        lowered = url.lower()
        for needle, category in self.substrings:
            if needle in lowered:
                return f"url/{category}/substring"
        for pattern, category in self.regexes:
            if pattern.search(url):
                return f"url/{category}/regex"
        return None


class UrlFilterPass(DocumentPass):
    """Remove a document whose `url_filter.url_field` is on a block list; count removals and URL-less records."""

    def __init__(self, cfg: PreprocessConfig):
        self.cfg = cfg.url_filter
        if self.cfg.missing_url not in ("keep", "remove"):
            raise ValueError(f"url_filter.missing_url={self.cfg.missing_url!r}: use 'keep' or 'remove'.")
        self.lists = UrlBlockList(self.cfg)
        self.removed: Counter = Counter()
        self.no_url = 0

    @staticmethod
    def settings_of(cfg: PreprocessConfig) -> Any:
        return _settings(cfg.url_filter)

    def apply(self, record: Dict[str, Any]) -> Optional[str]:
        url = record.get(self.cfg.url_field)
        if not isinstance(url, str) or not url.strip():
            self.no_url += 1
            reason = "no_url" if self.cfg.missing_url == "remove" else None
        else:
            reason = self.lists.reason(url.strip())
        if reason:
            self.removed[reason] += 1
        return reason

    def summary(self) -> Dict[str, Any]:
        return {"removed by rule": dict(self.removed), "records without a URL": {self.cfg.missing_url: self.no_url}}


register_pass("url_filter", UrlFilterPass, UrlFilterPass.settings_of, "URL block lists")
