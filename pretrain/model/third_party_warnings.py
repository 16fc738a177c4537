"""Third-party warnings that cannot apply to a run, filtered here and nowhere else.

Imported first (before any megatron-core or DeepSpeed import) by every module that imports megatron-core
at its top (model/gpt.py, init.py, data/datasets.py, data/fim.py, engines/megatron/engine.py
and optimizers.py) and by model/hf_mapping.py. Each filter says why the warning says nothing to a user.
"""
from __future__ import annotations

import warnings

import torch

# megatron-core's TransformerConfig default; it fires for every config, whatever the recipe sets.
warnings.filterwarnings("ignore", message="full scope is deprecated")
if not torch.cuda.is_available():
    # Apex and Transformer Engine are CUDA libraries: on a machine without CUDA they can never be there.
    warnings.filterwarnings("ignore", message=".*Apex is not installed.*")
    warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex are not installed.*")
# dist_checkpointing's and DeepSpeed's own calls into torch APIs torch has deprecated: nothing a user can act on.
warnings.filterwarnings("ignore", message=".*`load_state_dict` is deprecated.*")
warnings.filterwarnings("ignore", message=".*Please use DTensor instead and we are deprecating ShardedTensor.*")
warnings.filterwarnings("ignore", message=".*torch.distributed._all_gather_base is a private function.*")
warnings.filterwarnings("ignore", message=".*torch.distributed._reduce_scatter_base is a private function.*")
warnings.filterwarnings("ignore", message=".*`torch.distributed.all_gather_into_tensor` is deprecated.*")
warnings.filterwarnings("ignore", message=".*`torch.distributed.reduce_scatter_tensor` is deprecated.*")
