"""A PEFT base and a distillation teacher are pinned at a run's first start (pretrain/checkpoint/pins.py): a later
start that would resolve another checkpoint (the base run saved again, a step saved over in place) is refused
naming the field and the step to point it at."""
import json
from types import SimpleNamespace

import pytest

from common.config import ConfigError
from pretrain.checkpoint.pins import PINS, pinned_load
from pretrain.checkpoint.store import CheckpointStore
from tests.test_checkpoint import fake_save


def test_a_moved_base_or_teacher_is_refused_by_field_and_the_pinned_step_still_loads(tmp_path):
    base, teacher = CheckpointStore(tmp_path / "base"), CheckpointStore(tmp_path / "teacher")
    fake_save(base, 10)
    fake_save(teacher, 5)
    run = tmp_path / "run"
    cfg = SimpleNamespace(run_dir=str(run), peft=SimpleNamespace(base_checkpoint=str(base.root)),
                          distill=SimpleNamespace(teacher_checkpoint=str(teacher.root)))
    assert pinned_load(cfg, "peft.base_checkpoint").found.path == base.step_dir(10)     # the first start pins
    assert pinned_load(cfg, "distill.teacher_checkpoint").found.path == teacher.step_dir(5)
    pins = json.loads((run / PINS).read_text())
    assert pins["peft.base_checkpoint"]["path"] == str(base.step_dir(10).resolve())
    assert pins["peft.base_checkpoint"]["step"] == 10 and len(pins["peft.base_checkpoint"]["digest"]) == 32
    assert pinned_load(cfg, "peft.base_checkpoint").found.path == base.step_dir(10)     # a resume: the same

    fake_save(base, 20)                                              # the base run saved again
    with pytest.raises(ConfigError, match=rf"peft.base_checkpoint={base.root} resolves to "
                                          rf"{base.step_dir(20)} \(step 20\), but this run pinned "
                                          rf"{base.step_dir(10)} \(step 10, digest \w{{12}}\)") as refused:
        pinned_load(cfg, "peft.base_checkpoint")
    assert f"Fix: point peft.base_checkpoint at {base.step_dir(10)}" in str(refused.value)
    cfg.peft.base_checkpoint = str(base.step_dir(10))               # the fix: the pinned step named
    assert pinned_load(cfg, "peft.base_checkpoint").found.path == base.step_dir(10)
    assert pinned_load(cfg, "distill.teacher_checkpoint").found.path == teacher.step_dir(5)   # pinned apart

    fake_save(teacher, 5, payload=b"y" * 100)                        # step 5 saved over in place
    with pytest.raises(ConfigError, match=rf"distill.teacher_checkpoint={teacher.root} finds another checkpoint at "
                                          rf"{teacher.step_dir(5)} \(step 5, saved again\)"):
        pinned_load(cfg, "distill.teacher_checkpoint")
    (run / PINS).unlink()                                            # continuing against the new one on purpose
    assert pinned_load(cfg, "distill.teacher_checkpoint").found.path == teacher.step_dir(5)
