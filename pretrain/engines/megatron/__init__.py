"""The megatron-core engine (see engine.py)."""
import warnings

import torch

# megatron-core warns at import that apex/TE are missing; on a machine without CUDA they
# can never be present, so the warning says nothing there. The cuda-graph "full scope"
# warning fires for megatron-core's own default on every config.
warnings.filterwarnings("ignore", message="full scope is deprecated")
if not torch.cuda.is_available():
    warnings.filterwarnings("ignore", message=".*Apex is not installed.*")
    warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex are not installed.*")
# dist_checkpointing's own calls into torch's deprecated checkpoint APIs: nothing a user can act on.
warnings.filterwarnings("ignore", message=".*`load_state_dict` is deprecated.*")
warnings.filterwarnings("ignore", message=".*Please use DTensor instead and we are deprecating ShardedTensor.*")
