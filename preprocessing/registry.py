"""One pinned package archive, straight from the sources pip is configured with, without pip's build step.

`pip download --no-binary :all: bigbench==1.0.0` unpacks the 358 MB sdist and runs its build backend in a fresh
build environment to read metadata we never use: 25 s of CPU, and ~4 s for each small sdist (2026-12-03), in
every fresh clone's `make data` and test session. Here the archive is looked up by its file name in pip's own
sources (`pip config list`: find-links, index-url, extra-index-url, the environment's PIP_* included; the
sections `global` and `download`), in pip's order of precedence, fetched, and checked against the sha256 the
index lists. What this cannot do (a source it cannot read, no file of that name, no pure wheel) it reports as
`NotInSources`, and the caller falls back to `pip download`; a hash that does not match is an error, never a
fallback.
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import shlex
import ssl
import subprocess
import sys
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Tuple

PYPI = "https://pypi.org/simple"
ACCEPT = "application/vnd.pypi.simple.v1+json, application/vnd.pypi.simple.v1+html;q=0.2, text/html;q=0.01"
SECTIONS = (":env:", "download", "global")          # pip's precedence: the environment, the command, global
TIMEOUT_S = float(os.environ.get("PIP_DEFAULT_TIMEOUT", "60"))
CHUNK = 1 << 20


class NotInSources(Exception):
    """The archive could not be found or read in pip's sources by this module; `pip download` may still."""


def normalize(name: str) -> str:
    """PEP 503's project name: runs of -, _ and . as one -, lower case."""
    return re.sub(r"[-_.]+", "-", name).lower()


@functools.lru_cache(maxsize=4)
def pip_settings(python: str = sys.executable) -> Dict[str, str]:
    """key -> value of `pip config list` (e.g. `index-url`), the first of SECTIONS that sets it (once a process:
    a `pip` start costs ~0.3 s of CPU). Do not modify the result."""
    out = subprocess.run([python, "-m", "pip", "config", "list"], capture_output=True, text=True, timeout=120)
    if out.returncode != 0:
        raise NotInSources(f"`pip config list` failed: {out.stderr.strip()[-300:]}")
    found: Dict[Tuple[str, str], str] = {}
    for line in out.stdout.splitlines():
        match = re.fullmatch(r"(:env:|[\w-]+)\.([\w-]+)='(.*)'", line.strip())
        if match:
            found[(match.group(1), match.group(2))] = match.group(3)
    keys = {key for _, key in found}
    return {key: next(found[(s, key)] for s in SECTIONS if (s, key) in found) for key in keys
            if any((s, key) in found for s in SECTIONS)}


def sources(settings: Dict[str, str]) -> List[Tuple[str, str]]:
    """("links", folder or page) for each find-links, then ("index", url) for the index and the extra indexes."""
    if settings.get("no-index", "").lower() in ("1", "true", "yes", "on"):
        indexes = []
    else:
        indexes = [settings.get("index-url", PYPI), *shlex.split(settings.get("extra-index-url", ""))]
    return [*(("links", s) for s in shlex.split(settings.get("find-links", ""))), *(("index", s) for s in indexes)]


def wanted(filename: str, name: str, version: str, kind: str) -> bool:
    """Is `filename` the sdist (.tar.gz) or a pure wheel (none-any) of name==version?"""
    if kind == "sdist":
        return filename.endswith(".tar.gz") and normalize(filename[:-len(".tar.gz")]) == normalize(
            f"{name}-{version}")
    parts = filename[:-len(".whl")].split("-") if filename.endswith(".whl") else []
    return (len(parts) in (5, 6) and normalize(parts[0]) == normalize(name) and parts[1] == version
            and parts[-2] == "none" and parts[-1] == "any")


def _open(url: str, context: ssl.SSLContext, accept: Optional[str] = None):
    request = urllib.request.Request(url, headers={"Accept": accept} if accept else {})
    return urllib.request.urlopen(request, timeout=TIMEOUT_S, context=context)


def _local(source: str) -> Optional[Path]:
    """The folder a find-links entry or file:// index names, None for http(s)."""
    if source.startswith("file:"):
        return Path(urllib.parse.unquote(urllib.parse.urlparse(source).path))
    return None if "://" in source else Path(source)


def listed(source: Tuple[str, str], name: str, context: ssl.SSLContext) -> Iterator[Tuple[str, str, Optional[str]]]:
    """(file name, url or path, sha256 or None) of every file a source offers for `name`."""
    role, where = source
    folder = _local(where)
    if role == "links" and folder is not None and folder.is_dir():     # a find-links folder: the archives themselves
        yield from ((path.name, str(path), None) for path in sorted(folder.iterdir()) if path.is_file())
        return
    # a find-links URL is one flat page of archive links; an index has a page per project
    page = where if role == "links" else f"{where.rstrip('/')}/{normalize(name)}/"
    try:
        if folder is not None:       # a local find-links page, or a file:// index's <project>/index.html (pip's way)
            body = (folder if role == "links" else folder / normalize(name) / "index.html").read_bytes()
            kind = "text/html"
        else:
            with _open(page, context, ACCEPT) as response:
                body, kind = response.read(), response.headers.get("Content-Type", "")
    except OSError as err:             # 404 or no such folder: not there; anything else: cannot read the source
        if getattr(err, "code", None) == 404 or isinstance(err, FileNotFoundError):
            return
        raise NotInSources(f"{page}: {err}") from None
    if "json" in kind:
        for f in json.loads(body)["files"]:
            yield f["filename"], urllib.parse.urljoin(page, f["url"]), f.get("hashes", {}).get("sha256")
        return
    for href, text in re.findall(r'<a\s[^>]*href="([^"]+)"[^>]*>([^<]+)</a>', body.decode("utf-8", "replace")):
        url, _, fragment = urllib.parse.urljoin(page, href.replace("&amp;", "&")).partition("#")
        digest = fragment.removeprefix("sha256=") if fragment.startswith("sha256=") else None
        yield text.strip(), url, digest


def fetch_archive(name: str, version: str, kind: str, dest: Path, settings: Dict[str, str]) -> Path:
    """The archive of name==version (kind "sdist" or "wheel") from pip's sources into dest/<its file name>,
    written whole (a .part renamed) and hash-checked where the index lists a sha256."""
    context = ssl.create_default_context(cafile=settings.get("cert"))
    for source in sources(settings):
        for filename, where, sha256 in listed(source, name, context):
            if wanted(filename, name, version, kind):
                return _copy(where, sha256, dest / filename, context)
    raise NotInSources(f"no {kind} of {name}=={version} in {sources(settings)}")


def _copy(where: str, sha256: Optional[str], out: Path, context: ssl.SSLContext) -> Path:
    part, digest = out.with_name(f".{out.name}.{os.getpid()}.part"), hashlib.sha256()
    try:
        with (_open(where, context) if "://" in where else open(where, "rb")) as src, open(part, "wb") as dst:
            while chunk := src.read(CHUNK):
                digest.update(chunk)
                dst.write(chunk)
        if sha256 and digest.hexdigest() != sha256:
            raise ValueError(f"{where}: sha256 {digest.hexdigest()}, the index lists {sha256}: a damaged or "
                             f"tampered download. Fix: retry; if it persists, check the index or mirror.")
        part.replace(out)
    except OSError as err:
        raise NotInSources(f"{where}: {err}") from None
    finally:
        part.unlink(missing_ok=True)
    return out


def pip_download(spec: str, kind: str, dest: Path) -> None:
    """pip's own download (the fallback): builds an sdist's metadata, so it costs more CPU."""
    flag = ["--no-binary", ":all:"] if kind == "sdist" else ["--only-binary", ":all:"]
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check", "-q", *flag,
                    spec, "-d", str(dest)], check=True)


def download_into(spec: str, kind: str, dest: Path) -> None:
    """spec's archive into dest: from pip's sources directly, else (reported on stderr) with `pip download`."""
    name, version = spec.split("==")
    try:
        fetch_archive(name, version, kind, dest, pip_settings())
    except NotInSources as why:
        print(f"{spec}: {why}; using `pip download`", file=sys.stderr)
        pip_download(spec, kind, dest)


