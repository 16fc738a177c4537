"""Qwen3 and Qwen3-MoE: the Llama layout with QK-norm (Qwen3ForCausalLM, Qwen3MoeForCausalLM).

Checked against transformers 5.23's modeling_qwen3*.py and megatron-core 0.16.1 (tests/test_hf_qwen3.py: logits
within 1e-4 in fp32, both ways):
* QK-norm: megatron-core's qk_layernorm is an RMSNorm over each head's head_dim of q and k, applied after the QKV
  projection and before RoPE, with model.layernorm_epsilon; HF's q_norm / k_norm are the same (rms_norm_eps).
  Our `self_attention.{q,k}_layernorm.weight` are `self_attn.{q,k}_norm.weight` (pretrain/model/hf_mapping.py).
* head_dim is its own field in both (Qwen3-0.6B and 30B-A3B: 128 with 16 and 32 heads of d=1024 and 2048):
  model.kv_channels.
* Router: Qwen3-MoE takes a softmax over every expert, the top k, and renormalises the k when norm_topk_prob.
  megatron-core with pre_softmax=false takes the top k of the logits and a softmax over those k: the same weights
  (norm_topk_prob=true, as every published Qwen3-MoE); with pre_softmax=true the softmax over all experts, top k,
  unnormalised: norm_topk_prob=false. No shared experts (Qwen2-MoE's), no expert bias, no group-limited routing,
  no scaling of the chosen weights. Dense layers among the MoE ones are Qwen3-MoE's mlp_only_layers.
The experts are stacked as Mixtral's in transformers 5 (mlp.experts.gate_up_proj [E, 2F, H], down_proj [E, H, F]).
"""
from __future__ import annotations

from typing import List

from ...config.moe import moe_layer_pattern
from ...config.schema import JobConfig
from ...model import hf_mapping
from ..exporters import Exporter, register

DENSE, MOE = "Qwen3ForCausalLM", "Qwen3MoeForCausalLM"


def claims(cfg: JobConfig) -> bool:
    return cfg.model.arch == "llama" and cfg.model.qk_layernorm and not cfg.model.mla.enabled and \
        not cfg.model.attention_sinks


def architecture(cfg: JobConfig) -> str:
    return MOE if cfg.moe.enabled else DENSE


def unsupported(cfg: JobConfig) -> List[str]:
    """What Qwen3 / Qwen3-MoE cannot express of a QK-norm Llama-layout recipe, each naming the field."""
    problems = hf_mapping.dense_unsupported(cfg, qk_norm=True)
    moe = cfg.moe
    if cfg.model.window_size is not None:
        problems.append("model.window_size: this exporter writes Qwen3 with full attention in every layer "
                        "(use_sliding_window=false); no windowed Qwen3 is mapped")
    if not moe.enabled:
        return problems
    if moe.shared_expert_ffn_hidden_size:
        problems.append("moe.shared_expert_ffn_hidden_size (Qwen3-MoE has no shared experts)")
    if moe.score_function != "softmax" or moe.expert_bias:
        problems.append("moe.score_function/expert_bias: Qwen3-MoE's router is a softmax over the experts, "
                        "no bias (score_function=softmax, expert_bias=false)")
    if moe.num_groups is not None:
        problems.append("moe.num_groups (group-limited routing: Qwen3-MoE chooses among all experts)")
    if moe.topk_scaling_factor not in (None, 1.0):
        problems.append(f"moe.topk_scaling_factor={moe.topk_scaling_factor} (Qwen3-MoE does not scale the chosen "
                        "experts' weights)")
    return problems


def hf_config(cfg: JobConfig, vocab_size: int, bos: int, eos: int):
    """Qwen3Config or Qwen3MoeConfig of the exported model."""
    fields = dict(hf_mapping.llama_fields(cfg, vocab_size, bos, eos), intermediate_size=cfg.derived.ffn_hidden_size,
                  attention_bias=False, use_sliding_window=False, architectures=[architecture(cfg)])
    moe = cfg.moe
    if not moe.enabled:
        from transformers import Qwen3Config
        return Qwen3Config(**fields)
    from transformers import Qwen3MoeConfig
    pattern = moe_layer_pattern(moe, cfg.model.num_layers)
    return Qwen3MoeConfig(moe_intermediate_size=moe.ffn_hidden_size or cfg.derived.ffn_hidden_size,
                          num_experts=moe.num_experts, num_experts_per_tok=moe.router_topk,
                          norm_topk_prob=not moe.pre_softmax, decoder_sparse_step=1,
                          mlp_only_layers=[i for i, sparse in enumerate(pattern) if not sparse],
                          router_aux_loss_coef=moe.aux_loss_coeff, **fields)


def mismatch(config, cfg: JobConfig) -> str:
    """Where a Qwen3 directory's config differs from the recipe, each with its fix; fields no recipe reproduces
    (biases, sliding windows, another activation) named."""
    m, moe, problems = cfg.model, cfg.moe, []
    if getattr(config, "attention_bias", False):
        problems.append("attention_bias=true: the recipe's attention has no biases (model.add_bias_linear=false, "
                        "as Qwen3 needs for its MLP)")
    if getattr(config, "use_sliding_window", False):
        problems.append("use_sliding_window=true: no windowed Qwen3 is mapped")
    if getattr(config, "hidden_act", "silu") != "silu":
        problems.append(f"hidden_act={config.hidden_act}: the recipe's SwiGLU is silu-gated")
    if float(config.rms_norm_eps) != float(m.layernorm_epsilon):
        problems.append(f"rms_norm_eps={config.rms_norm_eps}, the recipe's model.layernorm_epsilon="
                        f"{m.layernorm_epsilon}. Fix: model.layernorm_epsilon={config.rms_norm_eps}")
    if moe.enabled:
        ours = moe_layer_pattern(moe, m.num_layers)
        theirs = [int(i not in config.mlp_only_layers and (i + 1) % config.decoder_sparse_step == 0)
                  for i in range(config.num_hidden_layers)]
        if theirs != ours:
            problems.append(f"its dense layers are {[i for i, x in enumerate(theirs) if not x]}, the recipe's "
                            f"{[i for i, x in enumerate(ours) if not x]}. Fix: moe.first_dense_layers / "
                            "moe.layer_freq to match mlp_only_layers and decoder_sparse_step")
        if config.num_experts_per_tok != moe.router_topk:
            problems.append(f"num_experts_per_tok={config.num_experts_per_tok}, the recipe's moe.router_topk="
                            f"{moe.router_topk}. Fix: moe.router_topk={config.num_experts_per_tok}")
        if bool(config.norm_topk_prob) == moe.pre_softmax:
            theirs = str(bool(config.norm_topk_prob)).lower()
            problems.append(f"norm_topk_prob={theirs}, the recipe has moe.pre_softmax={str(moe.pre_softmax).lower()}. "
                            f"Fix: moe.pre_softmax={str(not config.norm_topk_prob).lower()}")
    return "; ".join(filter(None, problems + [hf_mapping.rope_mismatch(config, cfg)]))


QWEN3 = register(Exporter(
    name="qwen3", architectures=(DENSE,), claims=lambda cfg: claims(cfg) and not cfg.moe.enabled,
    architecture=architecture, unsupported=unsupported, to_hf=hf_mapping.to_hf, hf_config=hf_config,
    from_hf=hf_mapping.from_hf, mismatch=mismatch, hf_groups=hf_mapping.hf_groups))
QWEN3_MOE = register(Exporter(
    name="qwen3_moe", architectures=(MOE,), claims=lambda cfg: claims(cfg) and cfg.moe.enabled,
    architecture=architecture, unsupported=unsupported, to_hf=hf_mapping.to_hf, hf_config=hf_config,
    from_hf=hf_mapping.from_hf, mismatch=mismatch, hf_groups=hf_mapping.hf_groups))
