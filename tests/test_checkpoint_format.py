"""Moving the project's modules moves no checkpoint: no file a checkpoint holds names a project class.

meta.json is JSON of plain values (pretrain/checkpoint/meta.py), and the engines' files hold
tensors, dicts and library objects. A pickled project class would be stored by its module path
(`pretrain.loop.LoopState`), and loading it would break when the module moves. Every pickle in the
checkpoints of both engines (megatron-core's torch_dist shards and common.pt, DeepSpeed's model and
ZeRO optimizer states) is read opcode by opcode and its imported globals are listed: none may come from
the project's packages. The same scan run on a checkpoint written at 216571d (before the runtime moved
into chapters) found none either (docs/architecture.md).
"""
import io
import pickletools
import struct
from pathlib import Path

import pytest

from tests.training import DS_K, SAVE_AT, ds_ckpt

PROJECT = ("pretrain", "evals", "launch", "common", "preprocessing", "hydra_plugins")


def pickled_globals(stream: io.BytesIO) -> set[str]:
    """'module.name' of every GLOBAL / STACK_GLOBAL of the pickle starting at the stream's position."""
    found, strings = set(), []
    for op, arg, _ in pickletools.genops(stream):
        if op.name in ("SHORT_BINUNICODE", "BINUNICODE", "UNICODE", "BINUNICODE8"):
            strings.append(arg)
        elif op.name == "GLOBAL":
            found.add(arg.replace(" ", "."))
        elif op.name == "STACK_GLOBAL" and len(strings) >= 2:
            found.add(f"{strings[-2]}.{strings[-1]}")
        elif op.name == "STOP":
            break
    return found


def checkpoint_globals(step_dir: Path) -> dict[str, set[str]]:
    """file -> globals its pickles import. torch.save writes an uncompressed zip whose `<name>/data.pkl`
    entry is the pickle; torch.distributed.checkpoint's .distcp files hold such zips one after another.
    Every local zip header naming a data.pkl is found and the pickle after it read; a file that is a
    plain pickle (protocol 2+) is read whole."""
    out = {}
    for path in sorted(p for p in step_dir.rglob("*") if p.is_file() and p.suffix in (".pt", ".distcp", ".pkl")):
        blob = path.read_bytes()
        stream, names = io.BytesIO(blob), set()
        if blob[:1] == b"\x80":
            names |= pickled_globals(stream)
        start = blob.find(b"PK\x03\x04")
        while start >= 0:
            name_len, extra_len = struct.unpack_from("<HH", blob, start + 26)
            if blob[start + 30:start + 30 + name_len].endswith(b"data.pkl"):
                stream.seek(start + 30 + name_len + extra_len)
                names |= pickled_globals(stream)
            start = blob.find(b"PK\x03\x04", start + 4)
        out[str(path.relative_to(step_dir))] = names
    return out


def project_classes(step_dir: Path) -> dict[str, list[str]]:
    scanned = checkpoint_globals(step_dir)
    ours = {f: sorted(g for g in names if g.split(".")[0] in PROJECT) for f, names in scanned.items()}
    return {f: names for f, names in ours.items() if names}


def test_the_scanner_finds_a_pickled_project_class(tmp_path):
    import collections

    import torch

    from pretrain.checkpoint.meta import LoopState
    torch.save({"w": torch.ones(2), "od": collections.OrderedDict(a=1)}, tmp_path / "plain.pt")
    torch.save({"w": torch.ones(2), "loop": LoopState(step=3)}, tmp_path / "theirs.pt")
    found = checkpoint_globals(tmp_path)
    assert {"collections.OrderedDict", "torch._utils._rebuild_tensor_v2"} <= found["plain.pt"]
    assert project_classes(tmp_path) == {"theirs.pt": ["pretrain.checkpoint.meta.LoopState"]}


@pytest.mark.slow
def test_no_checkpoint_names_a_project_class(layout_runs, ds_runs):
    megatron = [layout_runs.root / name / "checkpoints" / f"step_{SAVE_AT:08d}"
                for name in ("tp2", "pp2", "dp2-distopt")]
    deepspeed = [ds_ckpt(ds_runs["root"] / name, DS_K) for name in ("zero2", "zero3-offload-param", "tp2-zero1")]
    for step_dir in megatron + deepspeed:
        scanned = checkpoint_globals(step_dir)
        assert scanned and any(scanned.values()), f"{step_dir}: no pickle was read"
        assert project_classes(step_dir) == {}, step_dir
