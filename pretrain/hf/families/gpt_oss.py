"""gpt-oss (GptOssForCausalLM): the Llama layout with attention sinks, biases, YaRN, alternating windows and MoE
layers whose experts run a clamped, offset GLU.

Checked against transformers 5's modeling_gpt_oss.py and megatron-core 0.16.1 (tests/test_hf_families.py: logits
within 1e-4 in fp32 both ways; tests/test_hf_gpt_oss.py: refusals, the layout and gpt-oss-20b's count):
* sinks: megatron-core's learnable softmax offset (`self_attention.core_attention.softmax_offset`, one per head)
  is HF's `self_attn.sinks`: the same extra logit in each row's softmax denominator.
* biases: q/k/v/o (`attention_bias`), the router's (`mlp.router.bias`) and the experts' all come with
  model.add_bias_linear; an expert's fc2 bias is weighted by the routing probability in both (prob * (W x + b)).
* router: top-k of the logits, softmax over the k chosen: megatron-core's score_function=softmax, pre_softmax=false.
* experts: x_glu * sigmoid(1.702 x_glu) * (x_lin + 1) with x_glu clamped above and x_lin both ways at
  `swiglu_limit`: model.glu_activation=quick_gelu, glu_linear_offset=1, glu_clamp=<limit>.
  transformers stores them stacked and transposed with gate and up interleaved: `gate_up_proj` [E, H, 2F] whose
  even columns are the gate, odd ones the up projection (`gate_up_proj_bias` [E, 2F] alike), `down_proj` [E, F, H];
  ours are one module per expert, fc1 [2F, H] with the gate's rows first.
* windows: `layer_types` and `sliding_window` (which counts the query: model.window_size + 1), any pattern;
  gpt-oss's own alternate, windowed first: model.global_every=2.
* RoPE: YaRN (rope_type yarn, truncate false = model.yarn.correction_range_round_to_int=false) or plain.
"""
from __future__ import annotations

from typing import List

import torch

from ...config.attention import window_pattern
from ...config.schema import JobConfig
from ...model import hf_mapping
from ...model.hf_mapping import Rule, _same, apply_backward
from ..exporters import Exporter, register

ARCHITECTURE = "GptOssForCausalLM"
QUICK_GELU_ALPHA = 1.702        # megatron-core's quick_gelu: x * sigmoid(1.702 x); HF's swiglu_alpha


def claims(cfg: JobConfig) -> bool:
    return cfg.model.arch == "llama" and cfg.model.attention_sinks and not cfg.model.mla.enabled


def unsupported(cfg: JobConfig) -> List[str]:
    """What GptOss cannot express of a sinks recipe, each naming the field."""
    m, moe, problems = cfg.model, cfg.moe, []
    if not moe.enabled or moe.first_dense_layers or moe.layer_freq != 1:
        problems.append("moe.num_experts/first_dense_layers/layer_freq: every GptOss layer is MoE")
    if m.qk_layernorm or m.embedding_layernorm:
        problems.append("model.qk_layernorm/embedding_layernorm (GptOss normalises neither queries, keys nor "
                        "embeddings)")
    if m.normalization != "RMSNorm" or not m.add_bias_linear:
        problems.append("model.normalization/add_bias_linear: GptOss has RMSNorm and biases on attention, router "
                        "and experts (RMSNorm, add_bias_linear=true)")
    if m.activation != "swiglu" or m.glu_activation != "quick_gelu" or m.glu_linear_offset != 1.0 or \
            m.glu_clamp is None:
        problems.append("model.activation/glu_activation/glu_linear_offset/glu_clamp: GptOss's experts compute "
                        "(up + 1) * gate * sigmoid(1.702 gate), clamped (swiglu, quick_gelu, 1, a clamp)")
    if m.position_embedding_type not in ("rope", "yarn") or m.rotary_percent != 1.0 or m.rope_scaling:
        problems.append("model.position_embedding_type/rotary_percent/rope_scaling: GptOss rotates the whole head "
                        "by plain RoPE or YaRN (rope or yarn, rotary_percent=1, rope_scaling=false)")
    if moe.enabled:
        if moe.shared_expert_ffn_hidden_size:
            problems.append("moe.shared_expert_ffn_hidden_size (GptOss has no shared experts)")
        if moe.score_function != "softmax" or moe.pre_softmax or moe.expert_bias or moe.num_groups is not None \
                or moe.topk_scaling_factor not in (None, 1.0):
            problems.append("moe.score_function/pre_softmax/expert_bias/num_groups/topk_scaling_factor: GptOss's "
                            "router is a softmax over the top k logits, unscaled, ungrouped, with no routing bias")
    return problems


def rope_parameters(m) -> dict:
    if m.position_embedding_type != "yarn":
        return hf_mapping.rope_parameters(m)
    y = m.yarn
    return {"rope_type": "yarn", "rope_theta": float(m.rotary_base), "factor": float(y.factor),
            "beta_fast": float(y.beta_fast), "beta_slow": float(y.beta_slow),
            "original_max_position_embeddings": y.original_max_position_embeddings,
            "truncate": y.correction_range_round_to_int}


def hf_config(cfg: JobConfig, vocab_size: int, bos: int, eos: int):
    from transformers import GptOssConfig
    m, moe = cfg.model, cfg.moe
    fields = hf_mapping.llama_fields(cfg, vocab_size, bos, eos)
    pattern = window_pattern(m) or [False] * m.num_layers
    fields.update(rope_parameters=rope_parameters(m), layer_types=[
        "sliding_attention" if w else "full_attention" for w in pattern],
        sliding_window=m.window_size + 1 if m.window_size is not None else None)
    return GptOssConfig(intermediate_size=moe.ffn_hidden_size or cfg.derived.ffn_hidden_size,
                        num_local_experts=moe.num_experts, num_experts_per_tok=moe.router_topk,
                        swiglu_alpha=QUICK_GELU_ALPHA, swiglu_limit=m.glu_clamp, attention_bias=True,
                        router_aux_loss_coef=moe.aux_loss_coeff, architectures=[ARCHITECTURE], **fields)


def _interleave(gate_up: torch.Tensor, dim: int) -> torch.Tensor:
    """[.., gate rows; up rows, ..] along `dim` -> gate and up alternating (HF's gate_up layout)."""
    gate, up = gate_up.chunk(2, dim=dim)
    return torch.stack([gate, up], dim=dim + 1).flatten(dim, dim + 1)


def _deinterleave(gate_up: torch.Tensor, dim: int) -> torch.Tensor:
    index = [slice(None)] * gate_up.dim()
    gate, up = (gate_up[tuple(index[:dim] + [slice(k, None, 2)])] for k in (0, 1))
    return torch.cat([gate, up], dim=dim)


def _expert_rules(experts: int, ours: str, hf: str) -> List[Rule]:
    local = [f"{ours}mlp.experts.local_experts.{e}." for e in range(experts)]

    def names(kind):
        return tuple(f"{x}{kind}" for x in local)
    return [
        (names("linear_fc1.weight"), (f"{hf}mlp.experts.gate_up_proj",),     # E x [2F, H] <-> [E, H, 2F]
         lambda *w: (_interleave(torch.stack(w), 1).transpose(1, 2),),
         lambda w: tuple(_deinterleave(w.transpose(1, 2), 1).unbind(0))),
        (names("linear_fc1.bias"), (f"{hf}mlp.experts.gate_up_proj_bias",),  # E x [2F] <-> [E, 2F]
         lambda *b: (_interleave(torch.stack(b), 1),), lambda b: tuple(_deinterleave(b, 1).unbind(0))),
        (names("linear_fc2.weight"), (f"{hf}mlp.experts.down_proj",),        # E x [H, F] <-> [E, F, H]
         lambda *w: (torch.stack(w).transpose(1, 2),), lambda w: tuple(w.transpose(1, 2).unbind(0))),
        (names("linear_fc2.bias"), (f"{hf}mlp.experts.down_proj_bias",),
         lambda *b: (torch.stack(b),), lambda b: tuple(b.unbind(0)))]


def rules(cfg: JobConfig, vocab_size: int) -> List[Rule]:
    """Every tensor of a gpt-oss recipe's model: our keys, HF keys, the conversion each way."""
    unpad, pad, qkv_split, qkv_join = hf_mapping.converters(cfg, vocab_size)
    table: List[Rule] = [(("embedding.word_embeddings.weight",), ("model.embed_tokens.weight",), unpad, pad)]
    for i in range(cfg.model.num_layers):
        ours, hf = f"decoder.layers.{i}.", f"model.layers.{i}."
        for a, b in (("input_layernorm.weight", "input_layernorm.weight"),
                     ("pre_mlp_layernorm.weight", "post_attention_layernorm.weight"),
                     ("self_attention.linear_proj.weight", "self_attn.o_proj.weight"),
                     ("self_attention.linear_proj.bias", "self_attn.o_proj.bias"),
                     ("self_attention.core_attention.softmax_offset", "self_attn.sinks"),
                     ("mlp.router.weight", "mlp.router.weight"), ("mlp.router.bias", "mlp.router.bias")):
            table.append(((ours + a,), (hf + b,), _same, _same))
        for p in ("weight", "bias"):
            table.append(((f"{ours}self_attention.linear_qkv.{p}",),
                          tuple(f"{hf}self_attn.{x}_proj.{p}" for x in "qkv"), qkv_split, qkv_join))
        table += _expert_rules(cfg.moe.num_experts, ours, hf)
    table.append((("decoder.final_layernorm.weight",), ("model.norm.weight",), _same, _same))
    if cfg.model.untie_embeddings_and_output_weights:
        table.append((("output_layer.weight",), ("lm_head.weight",), unpad, pad))
    return table


def hf_groups(state, cfg: JobConfig, vocab_size: int):
    """to_hf one layer at a time (`make export` streams them into shards)."""
    return hf_mapping.by_layer(rules(cfg, vocab_size), hf_mapping.canonical(state))


def to_hf(state, cfg: JobConfig, vocab_size: int):
    return hf_mapping.merged(hf_groups(state, cfg, vocab_size))


def from_hf(hf, cfg: JobConfig):
    vocab = hf["model.embed_tokens.weight"].shape[0]
    tied = {"lm_head.weight"} if not cfg.model.untie_embeddings_and_output_weights else set()
    return apply_backward(hf, rules(cfg, vocab), tied)


YARN_FIELDS = {"factor": "factor", "beta_fast": "beta_fast", "beta_slow": "beta_slow",
               "original_max_position_embeddings": "original_max_position_embeddings"}


def yarn_mismatch(config, cfg: JobConfig) -> str:
    """Where a GptOss config's RoPE differs from the recipe's, each with its fix ('' where they agree)."""
    m = cfg.model
    params = dict(getattr(config, "rope_parameters", None) or {})
    if params.get("rope_type", "default") != "yarn":
        if m.position_embedding_type == "yarn":
            return (f"rope_type={params.get('rope_type')!r}, the recipe has YaRN. Fix: "
                    "model.position_embedding_type=rope")
        return hf_mapping.rope_mismatch(config, cfg)
    if m.position_embedding_type != "yarn":
        return "rope_type='yarn', the recipe's RoPE is plain. Fix: model.position_embedding_type=yarn"
    problems = [f"rope_parameters.{k} is set: megatron-core's YaRN here takes the concentration 0.1 ln(factor) + 1 "
                "only (model.yarn), so no recipe reproduces this model"
                for k in ("attention_factor", "mscale", "mscale_all_dim") if params.get(k) is not None]
    theta = params.get("rope_theta")
    if theta is not None and float(theta) != float(m.rotary_base):
        problems.append(f"rope_theta={theta:g}, the recipe's model.rotary_base={m.rotary_base}. Fix: "
                        f"model.rotary_base={theta:.0f}")
    for theirs, mine in YARN_FIELDS.items():
        value = params.get(theirs)
        if value is not None and float(value) != float(getattr(m.yarn, mine)):
            problems.append(f"rope_parameters.{theirs}={value}, the recipe's model.yarn.{mine}="
                            f"{getattr(m.yarn, mine)}. Fix: model.yarn.{mine}={value}")
    truncate = bool(params.get("truncate", True))
    if truncate != m.yarn.correction_range_round_to_int:
        problems.append(f"rope_parameters.truncate={str(truncate).lower()}, the recipe's model.yarn."
                        f"correction_range_round_to_int={str(m.yarn.correction_range_round_to_int).lower()}. Fix: "
                        f"model.yarn.correction_range_round_to_int={str(truncate).lower()}")
    return "; ".join(problems)


def mismatch(config, cfg: JobConfig) -> str:
    """Where a GptOss directory's config differs from the recipe, each with its fix or named as what no recipe
    computes."""
    m, problems = cfg.model, []
    if not getattr(config, "attention_bias", True):
        problems.append("attention_bias=false: the recipe's attention has biases (model.add_bias_linear=true, as "
                        "GptOss's router and experts need)")
    if float(getattr(config, "swiglu_alpha", QUICK_GELU_ALPHA)) != QUICK_GELU_ALPHA:
        problems.append(f"swiglu_alpha={config.swiglu_alpha}: megatron-core's quick_gelu gate is x * sigmoid(1.702 x)"
                        ", so no recipe computes this model")
    if m.glu_clamp is None or float(config.swiglu_limit) != float(m.glu_clamp):
        problems.append(f"swiglu_limit={config.swiglu_limit}, the recipe's model.glu_clamp={m.glu_clamp}. Fix: "
                        f"model.glu_clamp={config.swiglu_limit}")
    if float(config.rms_norm_eps) != float(m.layernorm_epsilon):
        problems.append(f"rms_norm_eps={config.rms_norm_eps:g}, the recipe's model.layernorm_epsilon="
                        f"{m.layernorm_epsilon}. Fix: model.layernorm_epsilon={config.rms_norm_eps:g}")
    if config.num_experts_per_tok != cfg.moe.router_topk:
        problems.append(f"num_experts_per_tok={config.num_experts_per_tok}, the recipe's moe.router_topk="
                        f"{cfg.moe.router_topk}. Fix: moe.router_topk={config.num_experts_per_tok}")
    return "; ".join(filter(None, problems + [hf_mapping.window_mismatch(config, cfg), yarn_mismatch(config, cfg)]))


GPT_OSS = register(Exporter(
    name="gpt_oss", architectures=(ARCHITECTURE,), claims=claims, architecture=lambda cfg: ARCHITECTURE,
    unsupported=unsupported, to_hf=to_hf, hf_config=hf_config, from_hf=from_hf, mismatch=mismatch,
    hf_groups=hf_groups))
