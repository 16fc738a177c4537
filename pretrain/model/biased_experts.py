"""Experts with biases (gpt-oss: `model.add_bias_linear` with `moe.num_experts`) on megatron-core 0.16.1's local spec.

An expert's MLP (megatron-core transformer/mlp.py) adds its fc2 bias, weighted by the token's routing probability,
in place: `output += output_bias * per_token_scale`. The output is what RowParallelLinear returns through
`_ReduceFromModelParallelRegion`, which hands its input back as-is at TP=1 (and all-reduces it in place
otherwise), so autograd refuses: "Output 0 of _ReduceFromModelParallelRegion is a view and is being modified
inplace", on GPUs too. `ExpertRowParallelLinear` returns a copy of that output where a bias follows, the fix
torch's message names; the function is unchanged: prob * (W x + b), as transformers' GptOssExperts computes it.
"""
from __future__ import annotations

from megatron.core.tensor_parallel import RowParallelLinear
from megatron.core.transformer.moe.experts import SequentialMLP


class ExpertRowParallelLinear(RowParallelLinear):
    """RowParallelLinear whose output may be added to in place (an expert's fc2 with a bias)."""

    def forward(self, input_, *args, **kwargs):
        output, bias = super().forward(input_, *args, **kwargs)
        return (output.clone() if bias is not None else output), bias


def use_biased_experts(layer_specs) -> None:
    """In every MoE layer spec (in place) whose experts are per-expert MLPs: ExpertRowParallelLinear as fc2."""
    for spec in layer_specs:
        experts = getattr(getattr(getattr(spec.submodules, "mlp", None), "submodules", None), "experts", None)
        if getattr(experts, "module", None) is SequentialMLP and experts.submodules.linear_fc2 is RowParallelLinear:
            experts.submodules.linear_fc2 = ExpertRowParallelLinear
