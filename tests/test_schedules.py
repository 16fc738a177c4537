"""Batch ramp agrees with megatron-core's calculator; LR schedules equal closed forms."""
import math

import pytest
from megatron.core.num_microbatches_calculator import RampupBatchsizeNumMicroBatchesCalculator

from pretrain.schedules import BatchRamp, lr_at


def test_batch_ramp_matches_megatron_core_step_by_step():
    ramp = BatchRamp(global_batch_size=64, start=16, increment=16, ramp_samples=300)
    ref = RampupBatchsizeNumMicroBatchesCalculator(64, 2, 4, False, 0, 16, 16, 300)
    consumed = 0
    for _ in range(40):
        ref.update(consumed, consistency_check=True)
        assert ramp.global_batch(consumed) == ref.get_current_global_batch_size()
        consumed += ramp.global_batch(consumed)
    assert ramp.steps_for_samples(consumed) == 40 and ramp.samples_after_steps(40) == consumed


@pytest.mark.parametrize("step", [0, 5, 9, 10, 37, 55, 99, 100, 150])
def test_lr_closed_forms(step):
    lr, min_lr, W, D = 1.0, 0.1, 10, 100
    pos = step + 1
    kw = dict(lr=lr, min_lr=min_lr, warmup=W, decay=D)
    if pos <= W:
        expected = {s: lr * pos / W for s in ("cosine", "linear", "constant")}
    elif pos >= D:
        expected = {"cosine": min_lr, "linear": min_lr, "constant": lr}
    else:
        r = (pos - W) / (D - W)
        expected = {"cosine": min_lr + (lr - min_lr) * 0.5 * (1 + math.cos(math.pi * r)),
                    "linear": lr - (lr - min_lr) * r, "constant": lr}
    for style, value in expected.items():
        assert lr_at(pos, style=style, **kw) == pytest.approx(value, abs=1e-12), style
    wsd = lr_at(pos, style="wsd", wsd_decay=20, **kw)
    if W < pos <= 80:
        assert wsd == lr
    elif 80 < pos < D:
        assert wsd == pytest.approx(min_lr + (lr - min_lr) * (1 - (pos - 80) / 20))
