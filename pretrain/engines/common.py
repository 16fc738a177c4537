"""What both engines share: the process group, RNG state and the weight-decay rule. What they train (model,
inputs, loss) is handed to them as an `Objective` (pretrain/engines/base.py, pretrain/objectives/); the
contract they implement is pretrain/engines/base.py."""
from __future__ import annotations

import os
import random
from datetime import timedelta
from typing import List

import numpy as np
import torch
import torch.distributed as dist


def init_distributed(timeout_minutes: int = 30, expected_world_size: int = 0) -> None:
    """torch.distributed from torchrun/SLURM env: NCCL on GPUs, gloo on CPU. `expected_world_size`: the
    config's nodes x devices_per_node, from which micro-batch counts and MFU were derived; a launch with
    another process count is refused here rather than training on wrong batch arithmetic."""
    if not dist.is_initialized():
        _init_process_group(timeout_minutes)
    if expected_world_size and dist.get_world_size() != expected_world_size:
        raise RuntimeError(f"{dist.get_world_size()} processes were launched but the config derives its batch "
                           f"split for cluster.nodes x cluster.devices_per_node = {expected_world_size}. Fix: "
                           f"launch {expected_world_size} processes, or set cluster.devices_per_node (and nodes) "
                           "to what this launch has.")


def _init_process_group(timeout_minutes: int) -> None:
    if "RANK" not in os.environ and "SLURM_PROCID" in os.environ:
        # `srun` one task per GPU (launch/templates/sbatch.j2): ranks from SLURM; the batch script
        # exports MASTER_ADDR/MASTER_PORT (first host of the allocation, a port from the job id).
        os.environ.update(RANK=os.environ["SLURM_PROCID"], LOCAL_RANK=os.environ["SLURM_LOCALID"],
                          WORLD_SIZE=os.environ["SLURM_NTASKS"])
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        # a site that binds one GPU per task (--gpus-per-task, gpu-bind) shows each rank one device
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())
    dist.init_process_group(backend, timeout=timedelta(minutes=timeout_minutes))


def exempt_from_weight_decay(name: str, kinds: List[str]) -> bool:
    """optim.no_weight_decay_on: 'bias', 'norm' (any *norm* module's params), 'embedding'."""
    leaf = name.rsplit(".", 2)
    module = leaf[-2] if len(leaf) > 1 else ""
    return (("bias" in kinds and name.endswith(".bias"))
            or ("norm" in kinds and "norm" in module)
            or ("embedding" in kinds and "embedding" in name))


def rng_state() -> dict:
    """This rank's RNG streams: Python, NumPy, torch (CPU, CUDA) and megatron-core's tracker (TP dropout)."""
    from megatron.core.tensor_parallel import get_cuda_rng_tracker
    state = {"random": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
             "tracker": get_cuda_rng_tracker().get_states()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    from megatron.core.tensor_parallel import get_cuda_rng_tracker
    random.setstate(state["random"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    get_cuda_rng_tracker().set_states(state["tracker"])


def reseed(seed: int, step: int, why: str, log) -> None:
    """Saved RNG streams cannot be used (`why`): every rank reseeds from (seed, step)."""
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    seed = seed + 7919 * step
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)
    log(f"NOTE: {why}: RNG states are not restored; reseeded from seed + 7919*step = {seed}. Losses match the "
        "original run only without dropout.")
