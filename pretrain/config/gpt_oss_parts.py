"""The parts gpt-oss adds to a Llama-layout model, as megatron-core 0.16.1 computes them: YaRN RoPE
(`model.position_embedding_type=yarn`, the `model.yarn` section), attention sinks (`model.attention_sinks`),
the clamped, offset GLU (`model.glu_activation`, `glu_linear_offset`, `glu_clamp`) and experts with biases
(`model.add_bias_linear` with `moe.num_experts`), with their compose-time rules.

megatron-core's TransformerConfig declares no `yarn_*` fields: GPTModel (the rotary embedding) and SelfAttention
(the concentration factor 0.1 ln(factor) + 1 on cos and sin) read them as attributes, which `yarn_attributes`
gives and model/gpt.py sets on the built config. Alternating windows are model.window_size with
model.global_every=2 (config/attention.py): windowed layers 0, 2, 4, ... as gpt-oss's `layer_types`.
"""
from __future__ import annotations

from dataclasses import dataclass

from common.config import doc

GLU_ACTIVATIONS = ("silu", "quick_gelu")       # model.glu_activation: SwiGLU's gate, gpt-oss's x * sigmoid(1.702 x)


@dataclass
class YarnConfig:
    factor: float = doc(32.0, "Context extension factor s (gpt-oss: 32); cos and sin are scaled by 0.1 ln(s) + 1.")
    original_max_position_embeddings: int = doc(4096, "The context the frequencies were fit to (gpt-oss: 4096).")
    beta_fast: float = doc(32.0, "Rotations above which a frequency is kept (extrapolated).")
    beta_slow: float = doc(1.0, "Rotations below which a frequency is divided by the factor (interpolated).")
    correction_range_round_to_int: bool = doc(False, "Round the ramp's ends to whole dimensions (megatron-core's "
                                                     "default true; gpt-oss's HF `truncate: false` is false).")


def yarn_attributes(model) -> dict:
    """The `yarn_*` attributes megatron-core 0.16.1 reads from its config with position_embedding_type='yarn'."""
    y = model.yarn
    return dict(yarn_rotary_scaling_factor=y.factor, yarn_original_max_position_embeddings=
                y.original_max_position_embeddings, yarn_beta_fast=y.beta_fast, yarn_beta_slow=y.beta_slow,
                yarn_mscale=None, yarn_mscale_all_dim=None,
                yarn_correction_range_round_to_int=y.correction_range_round_to_int)


def gpt_oss_parts_problems(cfg, add) -> None:
    """Compose-time rules for YaRN, attention sinks, the clamped GLU and experts with biases, each with the fix."""
    m = cfg.model
    if m.position_embedding_type == "yarn":
        y = m.yarn
        if y.factor <= 1 or y.original_max_position_embeddings < 1 or y.beta_fast <= y.beta_slow:
            add(f"model.yarn factor={y.factor}, original_max_position_embeddings={y.original_max_position_embeddings}"
                f", beta_fast={y.beta_fast}, beta_slow={y.beta_slow}: YaRN needs factor > 1, a positive original "
                "context and beta_fast > beta_slow. Fix: gpt-oss's 32, 4096, 32, 1.")
        if m.mla.enabled or m.arch != "llama":
            add(f"model.position_embedding_type=yarn with model.arch={m.arch}" + (" and MLA" if m.mla.enabled else "")
                + ": YaRN is built here for the Llama layout's rotary embedding only. Fix: position_embedding_type="
                "rope.")
    if m.glu_activation not in GLU_ACTIVATIONS:
        add(f"model.glu_activation={m.glu_activation!r} is not one of {list(GLU_ACTIVATIONS)}.")
    gated_extras = m.glu_activation != "silu" or m.glu_linear_offset != 0.0 or m.glu_clamp is not None
    if gated_extras and m.activation != "swiglu":
        add(f"model.glu_activation/glu_linear_offset/glu_clamp shape the gated MLP, and model.activation="
            f"{m.activation} is not gated. Fix: model.activation=swiglu, or drop them.")
    if m.glu_clamp is not None and m.glu_clamp <= 0:
        add(f"model.glu_clamp={m.glu_clamp} must be > 0 (gpt-oss: 7), or null for no clamp.")
    if m.attention_sinks:
        if m.mla.enabled or cfg.objective.name != "causal_lm":
            add("model.attention_sinks=true is built for causal Llama/GPT-layout attention (megatron-core's "
                "DotProductAttention), not MLA or an encoder. Fix: model.attention_sinks=false.")
        if cfg.parallel.tensor_model_parallel_size > 1:
            add(f"model.attention_sinks=true with parallel.tensor_model_parallel_size="
                f"{cfg.parallel.tensor_model_parallel_size}: the sinks' split over TP ranks (one per head) is not run "
                "here. Fix: TP=1 (gpt-oss-20b fits with expert parallelism).")
        if m.attention_dropout > 0:
            add(f"model.attention_sinks=true with model.attention_dropout={m.attention_dropout}: the sinks run on "
                "FlexAttention on GPUs, which has no dropout. Fix: model.attention_dropout=0 (gpt-oss has none).")
        if m.attention_backend in ("te", "flash", "fused") or (m.attention_backend == "auto" and
                                                               m.transformer_impl != "local"):
            add(f"model.attention_sinks=true with model.attention_backend={m.attention_backend} (Transformer Engine's "
                "attention on its spec): TE's learnable softmax offset is not run here. Fix: model.attention_backend="
                "torch (the sinks on FlexAttention, model/attention.py) or unfused.")
    if cfg.moe.enabled and m.add_bias_linear and (m.transformer_impl != "local" or cfg.moe.grouped_gemm):
        add("moe.num_experts with model.add_bias_linear=true needs model.transformer_impl=local and "
            "moe.grouped_gemm=false: the local spec's per-expert MLPs are the experts whose biases this project runs "
            "(model/biased_experts.py); grouped GEMMs with biases are not run here. Fix: model.transformer_impl="
            "local, moe.grouped_gemm=false.")
