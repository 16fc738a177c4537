"""megatron-core GPTModel with multi-head latent attention (model.mla) <-> transformers' DeepseekV3ForCausalLM.

Every MLA recipe exports here (dense ones too: first_k_dense_replace = every layer). Checked against
transformers 5.23's modeling_deepseek_v3.py and megatron-core 0.16.1's multi_latent_attention.py / moe_utils.py
(tests/test_export_deepseek.py: logits within 1e-4 in fp32; docs/mla.md has the measured difference):
* Attention tensors are the same matrices under other names, no re-ordering: megatron-core's q up projection
  holds per head [qk_head_dim no-RoPE rows; qk_pos_emb_head_dim RoPE rows] as HF's q_b_proj / q_proj splits
  [qk_nope_head_dim, qk_rope_head_dim]; its kv down projection's output is [kv latent; shared rotary key] as
  kv_a_proj_with_mqa's; its kv up projection per head [qk_head_dim key rows; v_head_dim value rows] as kv_b_proj.
* RoPE: megatron-core's MLA (config.multi_latent_attention) takes the rotary dims' even then odd entries and
  rotates them as halves, which is HF's rope_interleave=True; the rotary key is shared by all heads in both.
* Softmax scale: both 1/sqrt(qk_head_dim + qk_pos_emb_head_dim); megatron's YaRN mscale is 1 with the plain
  'rope' our MLA config sets (rotary_scaling_factor=1), and HF's rope_type 'default' applies no mscale.
* Router: sigmoid scores, plus the expert bias (our `mlp.router.expert_bias` -> `mlp.gate.e_score_correction_bias`)
  for choosing only, group-limited top-k, the chosen scores renormalised (megatron-core does it for top-k > 1:
  norm_topk_prob = router_topk > 1) and scaled (topk_scaling_factor -> routed_scaling_factor).
  transformers ranks a group by the sum of its top-2 scores, megatron-core by its top router_topk // group_topk:
  the export needs that to be 2, or every group chosen.
* Shared experts: ours are one MLP of shared_expert_ffn_hidden_size; HF's one of n_shared_experts x
  moe_intermediate_size, so the width must be a multiple of the expert width.
* transformers' q/kv latent norms have eps 1e-6 whatever rms_norm_eps says (DeepseekV3RMSNorm's default);
  ours use model.layernorm_epsilon, so it must be 1e-6.
Transformer Engine specs fuse the latent norms into the up projections (`linear_q_up_proj.layer_norm_weight`,
`linear_kv_up_proj.layer_norm_weight`, per megatron-core's gpt_layer_specs); TE_MLA_NAMES renames them (not run
on CPU, where there is no Transformer Engine). MTP layers are dropped before this
(pretrain/hf/mtp_export.py); the config says num_mtp_layers=0.
"""
from __future__ import annotations

from typing import Callable, Iterator, List, Tuple

import torch

from ..config.moe import moe_layer_pattern
from ..config.schema import JobConfig
from ..model import hf_mapping
from ..model.hf_mapping import State, by_layer, canonical, merged

ARCHITECTURE = "DeepseekV3ForCausalLM"
LATENT_NORM_EPS = 1e-6      # transformers' DeepseekV3Attention builds q_a_layernorm / kv_a_layernorm with the default
TE_MLA_NAMES = {"self_attention.linear_q_up_proj.layer_norm_weight": "self_attention.q_layernorm.weight",
                "self_attention.linear_kv_up_proj.layer_norm_weight": "self_attention.kv_layernorm.weight"}
Rule = Tuple[Tuple[str, ...], Tuple[str, ...], Callable, Callable]    # our keys, HF keys, to HF, from HF


def architecture(cfg: JobConfig) -> str:
    return ARCHITECTURE


def unsupported(cfg: JobConfig) -> List[str]:
    """What DeepseekV3ForCausalLM cannot express of an MLA recipe, each naming the field (export refuses them)."""
    m, moe, problems = cfg.model, cfg.moe, hf_mapping.plain_glu_unsupported(cfg.model)
    if m.normalization != "RMSNorm" or m.activation != "swiglu" or m.add_bias_linear:
        problems.append("DeepseekV3 needs RMSNorm, SwiGLU and no biases (model.normalization/activation/"
                        "add_bias_linear)")
    if m.embedding_layernorm:
        problems.append("model.embedding_layernorm=true (DeepseekV3 has no embedding norm)")
    if m.layernorm_epsilon != LATENT_NORM_EPS:
        problems.append(f"model.layernorm_epsilon={m.layernorm_epsilon}: transformers' DeepseekV3 normalises the "
                        f"q/kv latents with eps {LATENT_NORM_EPS} whatever rms_norm_eps says, ours with "
                        f"model.layernorm_epsilon (fix: train with model.layernorm_epsilon={LATENT_NORM_EPS})")
    if not moe.enabled:
        return problems
    if moe.layer_freq != 1:
        problems.append(f"moe.layer_freq={moe.layer_freq}: DeepseekV3's dense layers are the first "
                        "first_k_dense_replace only (moe.first_dense_layers), every later one is MoE")
    if moe.score_function != "sigmoid":
        problems.append(f"moe.score_function={moe.score_function}: DeepseekV3's router scores are sigmoids")
    width = moe.ffn_hidden_size or cfg.derived.ffn_hidden_size
    shared = moe.shared_expert_ffn_hidden_size
    if not shared:
        problems.append("moe.shared_expert_ffn_hidden_size=null: DeepseekV3's MoE layers always add shared experts")
    elif shared % width:
        problems.append(f"moe.shared_expert_ffn_hidden_size={shared} is not a multiple of the expert width {width} "
                        "(moe.ffn_hidden_size): DeepseekV3's shared MLP is n_shared_experts x moe_intermediate_size")
    groups, chosen = routing_groups(cfg)
    if moe.num_groups is not None and chosen < groups and moe.router_topk // moe.group_topk != 2:
        problems.append(f"moe.router_topk={moe.router_topk} // moe.group_topk={moe.group_topk} = "
                        f"{moe.router_topk // moe.group_topk}: megatron-core ranks a group by the sum of its top "
                        "router_topk // group_topk scores, transformers' DeepseekV3 by its top 2 (fix: router_topk = "
                        "2 x group_topk, as DeepSeek-V3's 8 and 4, or group_topk = num_groups)")
    if moe.num_experts // groups < 2:
        problems.append(f"moe.num_groups={moe.num_groups} leaves {moe.num_experts // groups} expert per group: "
                        "transformers' DeepseekV3 ranks a group by its top 2")
    return problems


def routing_groups(cfg: JobConfig) -> Tuple[int, int]:
    """(n_group, topk_group): group-limited routing that chooses every group is plain top-k, exported as 1 group."""
    moe = cfg.moe
    if moe.num_groups is None or moe.group_topk >= moe.num_groups:
        return 1, 1
    return moe.num_groups, moe.group_topk


def hf_config(cfg: JobConfig, vocab_size: int, bos: int, eos: int):
    """The transformers DeepseekV3Config of the exported model."""
    from transformers import DeepseekV3Config
    m, d, moe, mla = cfg.model, cfg.derived, cfg.moe, cfg.model.mla
    expert_width = moe.ffn_hidden_size or d.ffn_hidden_size
    routing = dict(first_k_dense_replace=m.num_layers)            # dense MLA: no MoE layer
    if moe.enabled:
        groups, chosen = routing_groups(cfg)
        routing = dict(first_k_dense_replace=moe.first_dense_layers, n_routed_experts=moe.num_experts,
                       num_experts_per_tok=moe.router_topk, moe_intermediate_size=expert_width,
                       n_shared_experts=moe.shared_expert_ffn_hidden_size // expert_width, n_group=groups,
                       topk_group=chosen, norm_topk_prob=moe.router_topk > 1,
                       routed_scaling_factor=float(moe.topk_scaling_factor or 1.0))
    return DeepseekV3Config(
        vocab_size=vocab_size, hidden_size=m.hidden_size, intermediate_size=d.ffn_hidden_size,
        num_hidden_layers=m.num_layers, num_attention_heads=m.num_attention_heads,
        num_key_value_heads=m.num_attention_heads, q_lora_rank=mla.q_lora_rank, kv_lora_rank=mla.kv_lora_rank,
        qk_nope_head_dim=mla.qk_head_dim, qk_rope_head_dim=mla.qk_pos_emb_head_dim, v_head_dim=mla.v_head_dim,
        rope_parameters={"rope_type": "default", "rope_theta": float(m.rotary_base)}, rope_interleave=True,
        max_position_embeddings=d.max_position_embeddings, rms_norm_eps=m.layernorm_epsilon, hidden_act="silu",
        attention_bias=False, initializer_range=m.init_method_std, num_mtp_layers=0,
        tie_word_embeddings=not m.untie_embeddings_and_output_weights, bos_token_id=bos, eos_token_id=eos,
        architectures=[ARCHITECTURE], **routing)


def _same(w):
    return (w,)


def _halves(w):                             # SwiGLU's fc1 is [gate; up]
    return tuple(w.chunk(2, dim=0))


def _stack(*w):
    return (torch.stack(w),)


def _joined(gate, up):
    return (torch.cat([gate, up]),)


def _unstacked(w):
    return tuple(w.unbind(0))


def rules(cfg: JobConfig, vocab_size: int, expert_bias: bool) -> List[Rule]:
    """Every tensor of the main model: our keys, HF keys, the conversion each way (one table for export and
    import). `expert_bias`: the routers carry one (without, HF's correction bias is zeros)."""
    m, moe = cfg.model, cfg.moe
    unpad, pad = hf_mapping.converters(cfg, vocab_size)[:2]
    table: List[Rule] = [(("embedding.word_embeddings.weight",), ("model.embed_tokens.weight",), unpad, pad)]
    pattern = moe_layer_pattern(moe, m.num_layers) if moe.enabled else [0] * m.num_layers
    q = (("linear_q_down_proj", "q_a_proj"), ("q_layernorm", "q_a_layernorm"), ("linear_q_up_proj", "q_b_proj")) \
        if m.mla.q_lora_rank is not None else (("linear_q_proj", "q_proj"),)
    attention = q + (("linear_kv_down_proj", "kv_a_proj_with_mqa"), ("kv_layernorm", "kv_a_layernorm"),
                     ("linear_kv_up_proj", "kv_b_proj"), ("linear_proj", "o_proj"))
    for i in range(m.num_layers):
        ours, hf = f"decoder.layers.{i}.", f"model.layers.{i}."
        table += [((f"{ours}input_layernorm.weight",), (f"{hf}input_layernorm.weight",), _same, _same),
                  ((f"{ours}pre_mlp_layernorm.weight",), (f"{hf}post_attention_layernorm.weight",), _same, _same)]
        table += [((f"{ours}self_attention.{a}.weight",), (f"{hf}self_attn.{b}.weight",), _same, _same)
                  for a, b in attention]
        if not pattern[i]:
            table += _mlp_rules(f"{ours}mlp.", f"{hf}mlp.")
            continue
        local = [f"{ours}mlp.experts.local_experts.{e}." for e in range(moe.num_experts)]
        table += [((f"{ours}mlp.router.weight",), (f"{hf}mlp.gate.weight",), _same, _same),
                  (tuple(f"{x}linear_fc1.weight" for x in local), (f"{hf}mlp.experts.gate_up_proj",), _stack,
                   _unstacked),
                  (tuple(f"{x}linear_fc2.weight" for x in local), (f"{hf}mlp.experts.down_proj",), _stack,
                   _unstacked)]
        table += _mlp_rules(f"{ours}mlp.shared_experts.", f"{hf}mlp.shared_experts.")
        correction = f"{hf}mlp.gate.e_score_correction_bias"
        if expert_bias:
            table.append(((f"{ours}mlp.router.expert_bias",), (correction,), _same, _same))
        else:
            table.append(((), (correction,), lambda: (torch.zeros(moe.num_experts),), _no_bias(correction)))
    table.append((("decoder.final_layernorm.weight",), ("model.norm.weight",), _same, _same))
    if m.untie_embeddings_and_output_weights:
        table.append((("output_layer.weight",), ("lm_head.weight",), unpad, pad))
    return table


def _no_bias(name: str) -> Callable:
    """Import into a recipe without an expert bias: HF's correction bias must be zeros, or the routing differs."""
    def check(bias):
        if bias.abs().max().item() != 0:
            raise ValueError(f"{name} is non-zero, the recipe has moe.expert_bias=false (its routers would choose "
                             "other experts). Fix: moe.expert_bias=true")
        return ()
    return check


def _mlp_rules(ours: str, hf: str) -> List[Rule]:
    return [((f"{ours}linear_fc1.weight",), (f"{hf}gate_proj.weight", f"{hf}up_proj.weight"), _halves, _joined),
            ((f"{ours}linear_fc2.weight",), (f"{hf}down_proj.weight",), _same, _same)]


def to_hf(state: State, cfg: JobConfig, vocab_size: int) -> State:
    """Our state dict (MTP layers already dropped) -> DeepseekV3ForCausalLM's (vocab cut to `vocab_size`). A tensor
    no rule takes is an error, so nothing is left behind unnoticed."""
    return merged(hf_groups(state, cfg, vocab_size))


def hf_groups(state: State, cfg: JobConfig, vocab_size: int) -> Iterator[State]:
    """to_hf one decoder layer at a time (`make export` streams them into shards); the check that every tensor has
    a rule comes first, before any is converted."""
    s = {}
    for key, value in canonical(state).items():
        for te, local in TE_MLA_NAMES.items():
            if key.endswith(te):
                key = key[: -len(te)] + local
        s[key] = value
    table = rules(cfg, vocab_size, any(k.endswith("mlp.router.expert_bias") for k in s))
    left = sorted(set(s) - {k for ours, _, _, _ in table for k in ours})
    if left:
        raise ValueError(f"DeepseekV3 export: {len(left)} tensors of the checkpoint have no place in "
                         f"{ARCHITECTURE}: {left[:5]}")
    return by_layer(table, s)


def from_hf(hf: State, cfg: JobConfig) -> State:
    """DeepseekV3ForCausalLM's state dict -> ours (vocab rows padded with zeros). A tensor of either side that the
    other lacks is an error naming it; so is an MTP recipe (transformers' DeepseekV3 holds no MTP module)."""
    if cfg.model.mtp_num_layers:
        raise ValueError(f"model.mtp_num_layers={cfg.model.mtp_num_layers}: transformers' {ARCHITECTURE} holds no "
                         "multi-token prediction module to import. Fix: model.mtp_num_layers=0 (MTP layers can be "
                         "added when training from the import only with freshly initialised weights: not done here)")
    hf = {k: v.detach().float().cpu() for k, v in hf.items()}
    used = {"lm_head.weight"} if not cfg.model.untie_embeddings_and_output_weights else set()   # the tied copy
    table = rules(cfg, hf["model.embed_tokens.weight"].shape[0], cfg.moe.enabled and cfg.moe.expert_bias)
    absent = [k for _, theirs, _, _ in table for k in theirs if k not in hf]
    if absent:
        raise ValueError(f"the HF model lacks {len(absent)} tensors the recipe's model has: {absent[:4]}. Fix: a "
                         "recipe with the same features (mla.q_lora_rank, moe.first_dense_layers, untied embeddings)")
    ours: State = {}
    for our_keys, theirs, _, backward in table:
        ours.update(zip(our_keys, backward(*(hf[k] for k in theirs)), strict=True))
        used.update(theirs)
    left = sorted(set(hf) - used)
    if left:
        raise ValueError(f"{len(left)} tensors of the HF model have no place in the recipe's model: {left[:4]}")
    return {k: v.contiguous() for k, v in ours.items()}


def mismatch(config, cfg: JobConfig) -> str:
    """Where a DeepseekV3 directory's config differs from what the recipe computes, each naming the field and the
    fix; what no recipe reproduces (YaRN RoPE, as DeepSeek-V3's published config) named. Shapes are checked
    tensor by tensor at import."""
    ours = hf_config(cfg, config.vocab_size, bos=0, eos=0)
    fixes = {"first_k_dense_replace": "moe.first_dense_layers", "n_routed_experts": "moe.num_experts",
             "num_experts_per_tok": "moe.router_topk", "n_group": "moe.num_groups", "topk_group": "moe.group_topk",
             "norm_topk_prob": "moe.router_topk (renormalised when > 1)",
             "routed_scaling_factor": "moe.topk_scaling_factor", "rms_norm_eps": "model.layernorm_epsilon",
             "rope_interleave": "(megatron-core's MLA rotates interleaved only)", "hidden_act": "model.activation"}
    problems = [f"{field}={getattr(config, field, None)}, the recipe's {getattr(ours, field, None)} ({fix})"
                for field, fix in fixes.items() if getattr(config, field, None) != getattr(ours, field, None)]
    params = dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})
    kind = params.get("rope_type", params.get("type", "default"))
    if kind != "default":
        problems.append(f"rope_parameters.rope_type={kind!r}: the recipes' MLA builds plain RoPE (megatron-core "
                        "0.16.1's MLA YaRN is not wired to a recipe field), so no recipe reproduces this model")
    theta = params.get("rope_theta", getattr(config, "rope_theta", None))
    if theta is not None and float(theta) != float(cfg.model.rotary_base):
        problems.append(f"rope_theta={theta:g}, the recipe's model.rotary_base={cfg.model.rotary_base}. Fix: "
                        f"model.rotary_base={theta:.0f}")
    if getattr(config, "attention_bias", False):
        problems.append("attention_bias=true: the recipe's MLA has no biases")
    return "; ".join(problems)
