"""Every bad-input reason is counted with file:line, and no good document is lost."""
import gzip
import json
import subprocess

import pytest

from preprocessing.records import BadInput, BadInputError, read_documents
from tests.conftest import PY, REPO

GOOD = [{"id": "a", "text": "good one"}, {"id": "b", "text": "good two"}]


def lines_with_bad_input():
    return [json.dumps(GOOD[0]).encode(), b'{"id": "x", "text": "unterminated', b"\xff\xfe not utf8",
            json.dumps({"id": "y", "body": "no text"}).encode(), json.dumps({"id": "z", "text": "   "}).encode(),
            json.dumps({"id": "n", "text": 5}).encode(), b"[1, 2]", json.dumps(GOOD[1]).encode()]


@pytest.mark.parametrize("suffix", [".jsonl", ".jsonl.gz", ".jsonl.zst"])
def test_each_reason_is_counted_and_good_documents_survive(tmp_path, suffix):
    import zstandard
    data = b"\n".join(lines_with_bad_input()) + b"\n"
    path = tmp_path / f"in{suffix}"
    path.write_bytes(gzip.compress(data) if suffix.endswith(".gz") else
                     zstandard.ZstdCompressor().compress(data) if suffix.endswith(".zst") else data)
    bad = BadInput()
    docs = list(read_documents([str(path)], bad=bad))
    assert [d.record for d in docs] == GOOD
    assert dict(bad.counts) == {"invalid_json": 1, "invalid_utf8": 1, "missing_text_field": 1, "empty_text": 1,
                                "text_not_a_string": 1, "not_an_object": 1}
    assert bad.examples["invalid_json"][0].startswith(f"{path}:2")
    assert bad.examples["missing_text_field"][0].startswith(f"{path}:4")


def test_file_not_of_its_declared_format(tmp_path):
    fake_gz = tmp_path / "x.jsonl.gz"
    fake_gz.write_text('{"text": "plain, not gzip"}\n')
    fake_parquet = tmp_path / "y.parquet"
    fake_parquet.write_text("not parquet")
    good = tmp_path / "ok.jsonl"
    good.write_text(json.dumps(GOOD[0]) + "\n")
    bad = BadInput()
    docs = list(read_documents([str(fake_gz), str(fake_parquet), str(good)], bad=bad))
    assert [d.record for d in docs] == [GOOD[0]]
    assert bad.counts["unreadable_file"] == 2


def test_parquet_and_text_folders(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    pq.write_table(pa.table({"id": ["p1", "p2"], "text": ["alpha", ""]}), tmp_path / "d.parquet")
    folder = tmp_path / "texts"
    folder.mkdir()
    (folder / "one.txt").write_text("first file")
    (folder / "two.txt").write_bytes(b"\xff bad")
    bad = BadInput()
    docs = list(read_documents([str(tmp_path / "d.parquet"), str(folder)], bad=bad))
    assert [d.text for d in docs] == ["alpha", "first file"]
    assert bad.counts == {"empty_text": 1, "invalid_utf8": 1}


def test_too_much_bad_input_fails_with_a_clear_message(tmp_path):
    path = tmp_path / "mostly_bad.jsonl"
    path.write_bytes(b"\n".join(lines_with_bad_input()) + b"\n")
    bad = BadInput()
    list(read_documents([str(path)], bad=bad))
    bad.check(0.8, "test")          # 6 of 8 bad: under 80% passes
    with pytest.raises(BadInputError, match=r"6 of 8 input records are unusable .* input.max_bad_fraction=0.1"):
        bad.check(0.1, "test")


@pytest.mark.slow
def test_pipeline_stage_cli_reports_bad_lines(tmp_path):
    path = tmp_path / "in.jsonl"
    path.write_bytes(b"\n".join(lines_with_bad_input()) + b"\n")
    res = subprocess.run([PY, "-m", "preprocessing.dedup", "--input", str(path), "--output", str(tmp_path / "o"),
                          "input.max_bad_fraction=0.1", "dedup.workers=1"], cwd=REPO, capture_output=True, text=True)
    assert res.returncode != 0
    assert "unusable" in res.stderr and f"{path}:2" in res.stderr


def test_outputs_never_replace_a_directory_they_did_not_write(tmp_path):
    """The tokenizer trainer swaps its finished directory in with common/files.replace_dir: a non-empty directory
    without its marker file (tokenizer.path=$HOME, say) is refused and left as it was; an empty one, or an earlier
    output of its own, is replaced."""
    from common.files import replace_dir

    def finished(name):
        tmp = tmp_path / name
        tmp.mkdir()
        (tmp / "export.json").write_text("{}")
        return tmp
    home = tmp_path / "home"
    home.mkdir()
    (home / "thesis.tex").write_text("years of work")
    with pytest.raises(FileExistsError, match="no export.json in it"):
        replace_dir(finished("a.tmp"), home, ours="export.json")
    assert [p.name for p in home.iterdir()] == ["thesis.tex"]
    earlier = tmp_path / "earlier"
    replace_dir(finished("b.tmp"), earlier, ours="export.json")          # absent: renamed in
    (earlier / "old-weights.bin").write_text("x")
    replace_dir(finished("c.tmp"), earlier, ours="export.json")          # ours: replaced whole
    assert sorted(p.name for p in earlier.iterdir()) == ["export.json"]
    empty = tmp_path / "empty"
    empty.mkdir()
    replace_dir(finished("d.tmp"), empty, ours="export.json")
    assert (empty / "export.json").exists() and not list(tmp_path.glob("*.tmp")) + list(tmp_path.glob("*.replaced"))


def test_export_over_an_earlier_export_keeps_the_other_files_and_refuses_before_converting(tmp_path):
    """Issue 50: `make export` over an earlier export deleted every other file of the directory (exit 0), refused a
    directory it did not write only after the whole conversion, and wrote the weights 0600."""
    import json
    import os

    from common.files import update_dir
    from pretrain.hf.convert import export

    def finished(name, files):
        tmp = tmp_path / name
        tmp.mkdir()
        for f in files:
            (tmp / f).write_text(name)
            os.chmod(tmp / f, 0o600)                  # as safetensors writes them
        (tmp / "export.json").write_text(json.dumps({"files": sorted(files) + ["export.json"]}))
        return tmp
    out = tmp_path / "hf"
    update_dir(finished("a.tmp", ["model-1.safetensors", "model-2.safetensors", "config.json"]), out, "export.json")
    (out / "README.md").write_text("my notes")
    update_dir(finished("b.tmp", ["model.safetensors", "config.json"]), out, "export.json")
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "config.json", "export.json", "model.safetensors"]
    assert (out / "README.md").read_text() == "my notes" and (out / "config.json").read_text() == "b.tmp"
    umask = os.umask(0)
    os.umask(umask)
    assert oct(os.stat(out / "model.safetensors").st_mode & 0o777) == oct(0o666 & ~umask)
    assert not list(tmp_path.glob("*.tmp"))
    home = tmp_path / "home"
    home.mkdir()
    (home / "thesis.tex").write_text("years of work")
    with pytest.raises(FileExistsError, match="no export.json in it"):       # not "no checkpoint": nothing was read
        export(tmp_path / "no-such-checkpoint", home)
    assert [p.name for p in home.iterdir()] == ["thesis.tex"]


def test_a_missing_run_is_called_missing_with_a_fix_the_command_takes(tmp_path):
    """make export / eval / ckpt-info take RUN= or CKPT=: their refusal names that, and says a path that does
    not exist does not exist (not "no intact checkpoint", not "point checkpoint.load at ...")."""
    from pretrain.checkpoint.store import resolve
    from pretrain.observability.report import summarize
    with pytest.raises(FileNotFoundError) as err:
        resolve(tmp_path / "nope" / "checkpoints")
    assert str(err.value) == (f"{tmp_path / 'nope' / 'checkpoints'} does not exist. Fix: RUN=<a run directory> or "
                              "CKPT=<a checkpoint directory> of a run that saved one.")
    (tmp_path / "empty" / "checkpoints").mkdir(parents=True)
    with pytest.raises(FileNotFoundError, match=r"no intact checkpoint under (.|\n)*Fix: RUN=<a run directory>"):
        resolve(tmp_path / "empty" / "checkpoints")
    with pytest.raises(FileNotFoundError, match="nope does not exist. Fix: RUN="):
        summarize(tmp_path / "nope")


def test_a_failed_tokenize_leaves_no_temporary_files(tmp_path):
    """Too much bad input stops tokenization with the count; neither <prefix>.tmp.bin nor .idx stays behind."""
    from preprocessing.config import InputConfig, TokenizeConfig
    from preprocessing.records import BadInputError
    from preprocessing.tokenize_indexed import tokenize_to_indexed
    from preprocessing.tokenizer_io import train_bpe
    tok = train_bpe(["a b c d e f"] * 4, 300, 1, tmp_path / "tok")
    (tmp_path / "in.jsonl").write_text('{"text": "fine"}\nnot json\n{"no_text": 1}\n')
    for workers, fmt in ((1, "jsonl"), (2, None)):
        with pytest.raises(BadInputError):
            tokenize_to_indexed(InputConfig(paths=[str(tmp_path / "in.jsonl")], max_bad_fraction=0.0,
                                            **({"format": fmt} if fmt else {})),
                                tok, tmp_path / "out" / "doc", TokenizeConfig(workers=workers))
        assert sorted(p.name for p in (tmp_path / "out").iterdir()) == []
