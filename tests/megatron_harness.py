"""GPTModel chunks built in a test process at a chosen TP, without an engine or torchrun: for unit tests of
modules added to megatron-core's model (PEFT methods, distillation losses) at TP=1 and at TP=2 on 2 spawned
gloo processes. The weights are layout-invariant (pretrain/model/init.py), so TP=1 and TP=2 start equal."""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

from tests.conftest import free_port
from tests.rank_pool import TASK_TIMEOUT_S, session_pool


def tiny_config(overrides=(), recipe: str = "gpt-tiny"):
    """A composed recipe on mock data (no files needed), fp32, seq 64 unless overridden."""
    from pretrain.config.compose import load_recipe
    return load_recipe(recipe, ["data=mock", "model.seq_length=64", *overrides])


def init_ranks(rank: int, world: int, port: int, tp: int) -> None:
    """This process as rank `rank` of a gloo group of `world`, megatron-core parallel state at TP=`tp`."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from pretrain.engines import cpu_compat
    cpu_compat.apply()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=tp)
    model_parallel_cuda_manual_seed(1234)


def build_model(cfg):
    """One GPTModel chunk of `cfg` at the current parallel state, layout-invariant weights, fp32 on CPU."""
    from pretrain.model.gpt import build_gpt_model, transformer_config
    from pretrain.model.init import layout_invariant_init
    config = transformer_config(cfg, on_gpu=False)
    model = build_gpt_model(cfg, config)
    layout_invariant_init(cfg, model, 0)
    return model, config


def batch(cfg, rows: int = 2, seed: int = 0) -> dict:
    """Random tokens, their next-token labels, a full loss mask and positions: [rows, seq]."""
    seq = cfg.model.seq_length
    ids = torch.randint(0, cfg.model.vocab_size, (rows, seq + 1), generator=torch.Generator().manual_seed(seed))
    return {"tokens": ids[:, :-1].contiguous(), "labels": ids[:, 1:].contiguous(),
            "loss_mask": torch.ones(rows, seq), "position_ids": torch.arange(seq).expand(rows, seq).contiguous()}


def spawn(fn, *args, nprocs: int = 2, timeout: float = TASK_TIMEOUT_S) -> dict:
    """Run fn(rank, port, out, *args) on the session's `nprocs` rank processes (tests/rank_pool.py: started once,
    shared by every spawned-rank test); returns what each put in `out`. A fresh port each call: init_ranks
    uses it only where the rank has no gloo group yet (its first task, or the one after a failed task)."""
    return session_pool(nprocs).run(fn, args, free_port(), timeout)
