"""JobConfig -> megatron-core TransformerConfig and GPTModel (one PP stage / VP chunk)."""
from __future__ import annotations

from . import third_party_warnings  # noqa: F401  # isort: skip  (before any megatron-core import)

from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core.activations import quick_gelu
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_layer_local_spec
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.enums import AttnBackend
from megatron.core.transformer.transformer_config import MLATransformerConfig
from megatron.core.utils import init_method_normal

from ..config.attention import window_pattern
from ..config.gpt_oss_parts import yarn_attributes
from ..config.mla import mla_config_kwargs
from ..config.moe import moe_layer_pattern
from ..config.schema import JobConfig
from . import fusions
from .attention import use_torch_attention
from .attention_record import core_attention, require_transformer_engine, te_spec
from .biased_experts import use_biased_experts
from .mla_attention import use_latent_attention
from .mtp import fit_mtp_stage, mtp_block_spec, mtp_config


def transformer_config(cfg: JobConfig, *, on_gpu: Optional[bool] = None) -> TransformerConfig:
    m, p, d, pr = cfg.model, cfg.parallel, cfg.derived, cfg.precision
    on_gpu = torch.cuda.is_available() if on_gpu is None else on_gpu
    dtype = pr.torch_dtype
    # megatron-core's enum only sets TE's NVTE_* switches (process-wide, asserted equal on every later build);
    # which module runs is model/attention_record.py's call. Without TE's attention it is 'local' whatever the
    # recipe asks, so that runs sharing a process (tests/run_jobs.py) agree.
    backend = m.attention_backend if m.attention_backend in ("unfused", "flash", "fused") else "auto"
    if not on_gpu or not use_transformer_engine(cfg) or core_attention(cfg, True) == "torch":
        backend = "local"
    kwargs = dict(
        num_layers=m.num_layers,
        hidden_size=m.hidden_size,
        num_attention_heads=m.num_attention_heads,
        num_query_groups=d.num_query_groups,
        kv_channels=d.kv_channels,
        ffn_hidden_size=d.ffn_hidden_size,
        normalization=m.normalization,
        layernorm_epsilon=m.layernorm_epsilon,
        activation_func=(quick_gelu if m.glu_activation == "quick_gelu" else F.silu) if m.activation == "swiglu"
        else F.gelu,
        gated_linear_unit=m.activation == "swiglu",
        glu_linear_offset=m.glu_linear_offset,
        activation_func_clamp_value=m.glu_clamp,
        softmax_type="learnable" if m.attention_sinks else "vanilla",
        add_bias_linear=m.add_bias_linear,
        init_method_std=m.init_method_std,
        hidden_dropout=m.hidden_dropout,
        attention_dropout=m.attention_dropout,
        qk_layernorm=m.qk_layernorm,
        attention_backend=AttnBackend[backend],
        attention_softmax_in_fp32=pr.attention_softmax_in_fp32,
        apply_query_key_layer_scaling=False,
        tensor_model_parallel_size=p.tensor_model_parallel_size,
        pipeline_model_parallel_size=p.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=p.virtual_pipeline_model_parallel_size,
        num_layers_in_first_pipeline_stage=p.num_layers_in_first_pipeline_stage,
        num_layers_in_last_pipeline_stage=p.num_layers_in_last_pipeline_stage,
        context_parallel_size=p.context_parallel_size,
        sequence_parallel=p.sequence_parallel,
        recompute_granularity=p.recompute_granularity,
        recompute_method=p.recompute_method if p.recompute_granularity == "full" else None,
        recompute_num_layers=p.recompute_num_layers if p.recompute_granularity == "full" else None,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=pr.bf16,
        fp16=pr.fp16,
        use_cpu_initialization=not on_gpu,
        # Each fusion only where its kernel is present (model/fusions.py): megatron-core imports the kernel
        # at the first forward, so a flag set without it is a crash minutes into the job.
        **fusions.decide(cfg, on_gpu, te_spec=use_transformer_engine(cfg)),
    )
    if pr.fp8:
        kwargs.update(fp8_config(cfg))
    if not m.scaled_output_init:
        kwargs["output_layer_init_method"] = init_method_normal(m.init_method_std)
    if cfg.moe.enabled:
        kwargs.update(moe_config(cfg))
    kwargs.update(mtp_config(cfg))          # model.mtp_num_layers (multi-token prediction, model/mtp.py)
    pattern = window_pattern(m)
    if pattern:
        # (w, 0): keys i-w..i. The list form (1 = windowed) is indexed by megatron-core's 1-based global layer
        # number, so one pattern holds for every PP stage.
        kwargs.update(window_size=(m.window_size, 0), window_attn_skip_freq=[int(x) for x in pattern])
        if not use_transformer_engine(cfg):
            # megatron-core's fused upper-triangular softmax kernel applies the causal mask only, not the window
            kwargs["masked_softmax_fusion"] = False
    if m.mla.enabled:
        # megatron-core fuses MLA's RoPE only for YaRN (it raises otherwise); MLA rotates with 'rope' here
        kwargs.update(mla_config_kwargs(m), apply_rope_fusion=False)
        return MLATransformerConfig(**kwargs)
    config = TransformerConfig(**kwargs)
    if m.position_embedding_type == "yarn":     # attributes megatron-core reads, no declared fields (gpt_oss_parts.py)
        for name, value in yarn_attributes(m).items():
            setattr(config, name, value)
    return config


def fp8_config(cfg: JobConfig) -> dict:
    """`precision.fp8*` as megatron-core TransformerConfig fields (Transformer Engine runs the FP8 GEMMs)."""
    pr = cfg.precision
    delayed = pr.fp8_recipe == "delayed"
    return dict(fp8=pr.fp8, fp8_recipe=pr.fp8_recipe,
                fp8_amax_history_len=pr.fp8_amax_history_len if delayed else 1,
                fp8_amax_compute_algo="max" if delayed else "most_recent",
                first_last_layers_bf16=pr.fp8_bf16_layers > 0,
                num_layers_at_start_in_bf16=pr.fp8_bf16_layers, num_layers_at_end_in_bf16=pr.fp8_bf16_layers)


def moe_config(cfg: JobConfig) -> dict:
    """The `moe` section and expert parallel sizes as megatron-core TransformerConfig fields."""
    moe, p = cfg.moe, cfg.parallel
    return dict(
        num_moe_experts=moe.num_experts,
        moe_router_topk=moe.router_topk,
        moe_ffn_hidden_size=moe.ffn_hidden_size or cfg.derived.ffn_hidden_size,
        moe_layer_freq=moe_layer_pattern(moe, cfg.model.num_layers),
        moe_shared_expert_intermediate_size=moe.shared_expert_ffn_hidden_size,
        moe_router_load_balancing_type=moe.load_balancing,
        moe_aux_loss_coeff=moe.aux_loss_coeff,
        moe_z_loss_coeff=moe.z_loss_coeff or None,
        moe_expert_capacity_factor=moe.capacity_factor,
        moe_pad_expert_input_to_capacity=moe.pad_to_capacity,
        moe_token_drop_policy=moe.drop_policy,
        moe_router_score_function=moe.score_function,
        moe_router_pre_softmax=moe.pre_softmax,
        moe_router_enable_expert_bias=moe.expert_bias,
        moe_router_bias_update_rate=moe.expert_bias_update_rate,
        moe_router_num_groups=moe.num_groups,
        moe_router_group_topk=moe.group_topk,
        moe_router_topk_scaling_factor=moe.topk_scaling_factor,
        moe_token_dispatcher_type=moe.dispatcher,
        moe_grouped_gemm=moe.grouped_gemm,
        moe_permute_fusion=moe.permute_fusion,
        moe_router_fusion=moe.router_fusion,
        moe_router_dtype="fp32",          # routing decisions in fp32 under bf16/fp16 (Megatron-LM recommends it)
        expert_model_parallel_size=p.expert_model_parallel_size,
        expert_tensor_parallel_size=p.expert_tensor_parallel_size or p.tensor_model_parallel_size,
    )


def use_transformer_engine(cfg: JobConfig) -> bool:
    return te_spec(cfg)


def layer_spec(cfg: JobConfig, config: TransformerConfig, vp_stage: Optional[int] = None):
    """One layer spec (dense), or the block's per-layer specs (MoE layers where moe.layer_freq says), with the
    core attention model/attention_record.py decides."""
    require_transformer_engine(cfg)
    torch_attention = core_attention(cfg, use_transformer_engine(cfg)) == "torch"
    if cfg.moe.enabled:
        block = get_gpt_decoder_block_spec(config, use_transformer_engine=use_transformer_engine(cfg),
                                           normalization=cfg.model.normalization, vp_stage=vp_stage)
        use_latent_attention(block.layer_specs)      # MLA layers (model/mla_attention.py)
        if cfg.model.add_bias_linear:
            use_biased_experts(block.layer_specs)     # model/biased_experts.py
        if torch_attention:
            use_torch_attention(block.layer_specs)
        return block
    if use_transformer_engine(cfg):
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec
        spec = get_gpt_layer_with_transformer_engine_spec(qk_layernorm=config.qk_layernorm,
                                                          multi_latent_attention=config.multi_latent_attention)
    else:
        spec = get_gpt_layer_local_spec(qk_layernorm=config.qk_layernorm, normalization=cfg.model.normalization,
                                        multi_latent_attention=config.multi_latent_attention)
    use_latent_attention([spec])
    if torch_attention:
        use_torch_attention([spec])
    return spec


def add_embedding_norm(model: GPTModel, cfg: JobConfig, config: TransformerConfig) -> None:
    """model.embedding_layernorm: a norm on the embedding output (BLOOM's word_embeddings_layernorm),
    which megatron-core's GPTModel lacks. A child of the embedding (checkpoint key
    `embedding.embedding_norm.*`) applied by a forward hook; replicated over TP, and under sequence
    parallel its params carry `sequence_parallel` so their grads are all-reduced over TP."""
    norm_cls = torch.nn.LayerNorm if cfg.model.normalization == "LayerNorm" else torch.nn.RMSNorm
    device = "cpu" if config.use_cpu_initialization else torch.cuda.current_device()
    norm = norm_cls(cfg.model.hidden_size, eps=cfg.model.layernorm_epsilon, device=device, dtype=config.params_dtype)
    for param in norm.parameters():
        param.sequence_parallel = config.sequence_parallel
    model.embedding.embedding_norm = norm
    model.embedding.register_forward_hook(lambda module, args, output: module.embedding_norm(output))


def build_gpt_model(cfg: JobConfig, config: TransformerConfig, *, pre_process: bool = True,
                    post_process: bool = True, vp_stage: Optional[int] = None) -> GPTModel:
    model = _gpt_model(cfg, config, pre_process=pre_process, post_process=post_process, vp_stage=vp_stage)
    fit_mtp_stage(model)                    # model.mtp_num_layers under PP>1 (model/mtp.py)
    if cfg.model.embedding_layernorm and pre_process:
        add_embedding_norm(model, cfg, config)
    return model


def language_model_args(cfg: JobConfig, pre_process: bool, post_process: bool) -> dict:
    """What megatron-core's GPTModel, BertModel and T5Model take alike from the recipe."""
    m, d = cfg.model, cfg.derived
    return dict(vocab_size=d.padded_vocab_size, max_sequence_length=d.max_position_embeddings,
                pre_process=pre_process, post_process=post_process,
                share_embeddings_and_output_weights=not m.untie_embeddings_and_output_weights,
                position_embedding_type=m.position_embedding_type, rotary_percent=m.rotary_percent)


def _gpt_model(cfg: JobConfig, config: TransformerConfig, *, pre_process: bool, post_process: bool,
               vp_stage: Optional[int]) -> GPTModel:
    spec = layer_spec(cfg, config, vp_stage)
    return GPTModel(config=config, transformer_layer_spec=spec,
                    mtp_block_spec=mtp_block_spec(config, spec, use_transformer_engine(cfg), vp_stage),
                    rotary_base=cfg.model.rotary_base, rope_scaling=cfg.model.rope_scaling,
                    rope_scaling_factor=cfg.model.rope_scaling_factor, vp_stage=vp_stage,
                    **language_model_args(cfg, pre_process, post_process))
