"""Every CPU adaptation of DeepSpeed 0.19.8, in one place, applied only without CUDA.

On GPU machines nothing here runs: DeepSpeed uses NCCL, FusedAdam and (offload) cpu_adam.
Without CUDA, DeepSpeed's CPU accelerator JIT-compiles C++ ops on first use (ninja + g++,
minutes each, per fresh machine). Each adaptation below avoids one of them with DeepSpeed's
own switch; the numerics are the same torch code the ops replace.

1. shm-comm: `deepspeed.comm` builds the `deepspeed_shm_comm` op inside `init_distributed`
   (~2-3 min) for shared-memory all-reduce; marked incompatible, collectives go to gloo.
2. torch-adam: the "optimizer" section's AdamW would be FusedAdam (~3-4 min build);
   ds_config.py fills `"torch_adam": true` on CPU (torch.optim.AdamW).
3. cpu-optimizer: with offload DeepSpeed insists on DeepSpeedCPUAdam (cpu_adam, ~6 min
   build); ds_config.py fills `"zero_force_ds_cpu_optimizer": false` on CPU, so the offloaded
   fp32 partitions are stepped by torch's AdamW on the host - the offload code path
   (partitions, grads and states on CPU, copies back) is unchanged.
"""
from __future__ import annotations

import torch

SHM_COMM_OP = "deepspeed_shm_comm"


def apply() -> bool:
    """Install the adaptations when CUDA is absent; returns whether they are active."""
    if torch.cuda.is_available():
        return False
    import deepspeed.ops
    deepspeed.ops.__compatible_ops__[SHM_COMM_OP] = False
    return True
