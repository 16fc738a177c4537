"""Extending the runtime without touching a project file: an optimizer and an LR schedule are
defined and registered here, in the test module, and selected by recipe overrides; gpt-tiny
trains with them through the real engine and loop (1 process, gloo, mock data), and the planner
counts the registered optimizer's state."""
import json

import pytest
import torch

from common.config import ConfigError
from pretrain.config.compose import load_recipe
from pretrain.engines.megatron.optimizer_state import leaves
from pretrain.model.inventory import stage_tensors
from pretrain.optim.registry import per_element, register_optimizer
from pretrain.plan.memory import optimizer_state_bytes
from pretrain.schedules import LRParams, lr_at, register_lr_schedule
from pretrain.train import trainer_for

MOMENTUM = 0.9


@register_optimizer("test-sgd-momentum", state_bytes=per_element(4))   # one fp32 momentum buffer
def sgd_momentum(groups: list, o) -> torch.optim.Optimizer:
    return torch.optim.SGD(groups, lr=o.lr, momentum=MOMENTUM, weight_decay=o.weight_decay)


@register_lr_schedule("test-halving")
def halving(position: float, p: LRParams) -> float:
    """lr halves every 3 steps after warmup, floored at min_lr."""
    return max(p.min_lr, p.lr * 0.5 ** int((position - p.warmup - 1) // 3))


OVERRIDES = ["data=mock", "cluster.devices_per_node=1", "batch.global_batch_size=8", "batch.micro_batch_size=4",
             "model.num_layers=2", "schedule.train_iters=8", "schedule.lr_warmup=2", "optim.lr=1.0",
             "optim.min_lr=0.01", "eval.eval_interval=0", "eval.final_test=false", "logging.log_interval=1",
             "logging.tensorboard=false", "checkpoint.save_interval=0", "checkpoint.save_final=false",
             "stability.watchdog_minutes=0", "optim.name=test-sgd-momentum", "schedule.lr_decay_style=test-halving"]


def test_unregistered_names_are_refused_with_the_registered_ones():
    with pytest.raises(ConfigError) as err:
        load_recipe("gpt-tiny", ["optim.name=sgd", "schedule.lr_decay_style=steps"])
    text = str(err.value)
    assert "optim.name='sgd' is not one of" in text and "'test-sgd-momentum'" in text and "'adamw'" in text
    assert "schedule.lr_decay_style='steps' is not one of" in text and "'test-halving'" in text


def test_registered_optimizer_and_schedule_train_gpt_tiny(tmp_path, single_rank_megatron):
    cfg = load_recipe("gpt-tiny", OVERRIDES + [f"run_dir={tmp_path}"])
    trainer = trainer_for(cfg, tmp_path)
    assert all(isinstance(leaf.optimizer, torch.optim.SGD) for leaf in leaves(trainer.engine.optimizer))
    trainer.train()

    records = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    assert [r["step"] for r in train] == list(range(1, 9))
    # The loop ran the registered schedule: warmup 0.5, 1, then 1 x3, 0.5 x3.
    expected = [lr_at(s, style="test-halving", lr=1.0, min_lr=0.01, warmup=2, decay=8) for s in range(1, 9)]
    assert [r["lr"] for r in train] == pytest.approx(expected, rel=1e-12)
    assert expected == pytest.approx([0.5, 1, 1, 1, 1, 0.5, 0.5, 0.5])
    # The registered update rule ran: SGD's momentum buffers exist (made by its step), the loss fell.
    states = [s for leaf in leaves(trainer.engine.optimizer) for s in leaf.optimizer.state.values()]
    assert states and all("momentum_buffer" in s for s in states)
    assert train[-1]["loss"] < train[0]["loss"] - 0.05
    # The planner counts its state from the registry: 4 bytes per parameter (fp32, no main copy).
    (tensors,) = stage_tensors(cfg)
    held = sum(p.numel() for chunk in trainer.engine.model for p in chunk.parameters())
    assert optimizer_state_bytes(cfg, tensors, tp=1) == 4 * held


def test_a_recipe_imports_the_module_that_registers_its_parts(tmp_path, monkeypatch):
    """`imports` (what a lab's own package uses): the module is imported before validation."""
    (tmp_path / "lab_schedules.py").write_text(
        "from pretrain.schedules import register_lr_schedule\n\n"
        "@register_lr_schedule('lab-flat')\ndef flat(position, p):\n    return 0.5 * p.lr\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = load_recipe("gpt-tiny", ["imports=[lab_schedules]", "schedule.lr_decay_style=lab-flat"])
    assert lr_at(100, style=cfg.schedule.lr_decay_style, lr=1.0, min_lr=0.0, warmup=0, decay=10) == 0.5
    with pytest.raises(ConfigError, match=r"imports\[0\]='no_such_lab' cannot be imported"):
        load_recipe("gpt-tiny", ["imports=[no_such_lab]"])
