"""GPT-2, Llama, Ministral and Mixtral: the families pretrain/model/hf_mapping.py maps (one rule table both ways).

A GPT-layout recipe is GPT-2's; a Llama-layout one without QK-norm is Llama's, Ministral's with sliding-window
layers, Mixtral's with experts (with QK-norm it is Qwen3's: pretrain/hf/families/qwen3.py)."""
from __future__ import annotations

from typing import List

from ...config.schema import JobConfig
from ...model import hf_mapping
from ..exporters import Exporter, register


def _llama_layout(cfg: JobConfig) -> bool:
    return cfg.model.arch == "llama" and not cfg.model.mla.enabled and not cfg.model.qk_layernorm and \
        not cfg.model.attention_sinks           # sinks: gpt-oss's (pretrain/hf/families/gpt_oss.py)


def _function_mismatch(config, cfg: JobConfig) -> List[str]:
    """Config fields that change the function with the same tensors (so no shape check catches them), each named
    with its fix, or named as what no recipe computes."""
    m, problems = cfg.model, []
    if m.arch == "gpt":
        act, eps = getattr(config, "activation_function", "gelu"), config.layer_norm_epsilon
        if act != "gelu":
            problems.append(f"activation_function={act}: megatron-core's GELU here is the exact (erf) one "
                            "(pretrain/model/gpt.py), so no recipe computes this model (GPT-2's own is gelu_new)")
        if getattr(config, "scale_attn_by_inverse_layer_idx", False):
            problems.append("scale_attn_by_inverse_layer_idx=true: megatron-core scales every layer's scores by "
                            "1/sqrt(d) alone")
    else:
        act, eps = getattr(config, "hidden_act", "silu"), config.rms_norm_eps
        if act != "silu":
            problems.append(f"hidden_act={act}: the recipe's SwiGLU is silu-gated")
        for field in ("attention_bias", "mlp_bias"):
            if getattr(config, field, False):
                problems.append(f"{field}=true: the recipe's linears have no biases (model.add_bias_linear=false)")
        if cfg.moe.enabled and config.num_experts_per_tok != cfg.moe.router_topk:
            problems.append(f"num_experts_per_tok={config.num_experts_per_tok}, the recipe's moe.router_topk="
                            f"{cfg.moe.router_topk}. Fix: moe.router_topk={config.num_experts_per_tok}")
    if float(eps) != float(m.layernorm_epsilon):
        problems.append(f"norm eps {eps:g}, the recipe's model.layernorm_epsilon={m.layernorm_epsilon}. Fix: "
                        f"model.layernorm_epsilon={eps:g}")
    return problems


def _mismatch(config, cfg: JobConfig) -> str:
    return "; ".join(filter(None, [*_function_mismatch(config, cfg), hf_mapping.window_mismatch(config, cfg),
                                   hf_mapping.rope_mismatch(config, cfg)]))


def _family(name: str, architecture: str, claims) -> Exporter:
    return register(Exporter(name=name, architectures=(architecture,), claims=claims,
                             architecture=lambda cfg: architecture, unsupported=hf_mapping.unsupported,
                             to_hf=hf_mapping.to_hf, hf_config=hf_mapping.hf_config, from_hf=hf_mapping.from_hf,
                             mismatch=_mismatch, hf_groups=hf_mapping.hf_groups))


GPT2 = _family("gpt2", "GPT2LMHeadModel", lambda cfg: cfg.model.arch == "gpt" and not cfg.model.mla.enabled)
LLAMA = _family("llama", "LlamaForCausalLM", lambda cfg: _llama_layout(cfg) and not cfg.moe.enabled
                and cfg.model.window_size is None)
MINISTRAL = _family("ministral", "MinistralForCausalLM", lambda cfg: _llama_layout(cfg) and not cfg.moe.enabled
                    and cfg.model.window_size is not None)
MIXTRAL = _family("mixtral", "MixtralForCausalLM", lambda cfg: _llama_layout(cfg) and cfg.moe.enabled)
