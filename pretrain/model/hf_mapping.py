"""megatron-core GPTModel state dict (one TP=1 model, whole tensors) <-> Hugging Face transformers.

GPT recipes map to GPT-2 (`GPT2LMHeadModel`: learned positions, LayerNorm, exact GELU), Llama
recipes to Llama (`LlamaForCausalLM`: RoPE, RMSNorm, SwiGLU, GQA; with sliding-window layers to
`MinistralForCausalLM`, the same tensors plus per-layer `layer_types`), Llama-layout MoE recipes to
Mixtral (`MixtralForCausalLM`). The layouts that differ:
* megatron-core's fused QKV holds, per query group, [the group's query heads; its key; its value]
  (rows of head_dim each); HF holds q, k, v separately (GPT-2: one Conv1D [h, 3h] whose columns
  are all q, then all k, then all v).
* GPT-2's Conv1D stores weights transposed (in x out).
* SwiGLU's fc1 is [gate; up] -> gate_proj, up_proj.
* MoE: our router `mlp.router.weight` is Mixtral's `mlp.gate.weight`; our experts are one module
  each (`mlp.experts.local_experts.<e>.linear_fc1/fc2`), transformers 5 holds them stacked:
  `mlp.experts.gate_up_proj` [E, 2F, H] (gate rows, then up, as our fc1) and `down_proj` [E, H, F].
  Routing is the same function: our top-k over logits then a softmax over the k chosen equals
  Mixtral's softmax over all, top-k, renormalised over the k.
* The vocabulary is padded (make_vocab_size_divisible_by x TP); HF gets the tokenizer's size.
Transformer Engine layer specs name fused norms `linear_qkv.layer_norm_*` / `linear_fc1.layer_norm_*`;
`canonical()` renames them (and grouped-GEMM experts' `linear_fc1.weight<e>` to the per-expert names),
so checkpoints of either spec export alike.
"""
from __future__ import annotations

from . import third_party_warnings  # noqa: F401  # isort: skip  (before any megatron-core import)

import re
from typing import Callable, Dict, Iterator, List, Tuple

import torch

from ..config.attention import window_pattern
from ..config.moe import moe_layer_pattern
from ..config.schema import JobConfig
from .tensors import TE_NAMES

State = Dict[str, torch.Tensor]
GROUPED_EXPERT = re.compile(r"mlp\.experts\.(linear_fc[12])\.weight(\d+)$")     # TEGroupedMLP's names


def unsupported(cfg: JobConfig) -> List[str]:
    """Recipe features GPT-2, Llama, Ministral or Mixtral cannot express (export refuses them)."""
    return dense_unsupported(cfg) + (moe_unsupported(cfg) if cfg.model.arch != "gpt" else [])


def dense_unsupported(cfg: JobConfig, qk_norm: bool = False) -> List[str]:
    """What of a recipe's attention, norms and MLP the GPT-2 or Llama layout cannot express; `qk_norm`: the target
    normalises queries and keys per head as megatron-core's qk_layernorm does (Qwen3)."""
    m, problems = cfg.model, plain_glu_unsupported(cfg.model)
    if m.attention_sinks:
        problems.append("model.attention_sinks=true (sinks export to GptOssForCausalLM, pretrain/hf/families/"
                        "gpt_oss.py: a Llama-layout recipe)")
    if m.qk_layernorm and not qk_norm:
        problems.append("model.qk_layernorm=true (neither GPT-2 nor Llama normalises queries/keys)")
    if m.embedding_layernorm:
        problems.append("model.embedding_layernorm=true (no embedding norm in GPT-2 or Llama)")
    if m.mla.enabled:
        problems.append("model.mla.enabled (multi-head latent attention: GPT-2, Llama and Mixtral have none; "
                        "MLA recipes export to DeepseekV3ForCausalLM through pretrain/hf/deepseek_export.py)")
    if m.window_size is not None and m.arch == "gpt":
        problems.append("model.window_size on the GPT layout (GPT-2 has no local layers; GPT-Neo, the GPT-2-like "
                        "architecture with them, has no q/k/v biases and does not scale scores by 1/sqrt(d))")
    if m.arch == "gpt":
        if m.position_embedding_type != "learned_absolute":
            problems.append(f"model.position_embedding_type={m.position_embedding_type} (GPT-2 has learned positions)")
        if m.normalization != "LayerNorm" or m.activation != "gelu" or not m.add_bias_linear:
            problems.append("GPT-2 needs LayerNorm, GELU and biases (model.normalization/activation/add_bias_linear)")
        if cfg.derived.num_query_groups != m.num_attention_heads:
            problems.append("GQA (model.num_query_groups) on the GPT-2 architecture")
    else:
        if m.position_embedding_type != "rope" or m.rotary_percent != 1.0:
            problems.append("Llama needs RoPE on the whole head (model.position_embedding_type=rope, rotary_percent=1)")
        if m.normalization != "RMSNorm" or m.activation != "swiglu" or m.add_bias_linear:
            problems.append("Llama needs RMSNorm, SwiGLU and no biases "
                            "(model.normalization/activation/add_bias_linear)")
    return problems


def plain_glu_unsupported(m) -> List[str]:
    """gpt-oss's GLU (quick_gelu gate, offset, clamp) in a family whose gated MLP is plain SwiGLU (model config `m`)."""
    if m.glu_activation == "silu" and m.glu_linear_offset == 0.0 and m.glu_clamp is None:
        return []
    return [f"model.glu_activation={m.glu_activation}/glu_linear_offset={m.glu_linear_offset}/glu_clamp="
            f"{m.glu_clamp}: this family's MLP is plain SwiGLU (silu, 0, null); gpt-oss's GLU exports to "
            "GptOssForCausalLM"]


def window_mismatch(config, cfg: JobConfig) -> str:
    """Where an HF config's sliding-window layers (`layer_types`, or one `sliding_window` for every layer) differ
    from the recipe's (HF's window counts the query: ours + 1); '' where they agree."""
    n = cfg.model.num_layers
    sliding = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    theirs = [t == "sliding_attention" for t in types] if types else [sliding is not None] * n
    ours = window_pattern(cfg.model) or [False] * n
    window = sliding - 1 if any(theirs) else None
    if theirs == ours and window == (cfg.model.window_size if any(ours) else None):
        return ""
    return (f"its windowed layers are {[i for i, w in enumerate(theirs) if w]} with window {window}, the recipe's "
            f"{[i for i, w in enumerate(ours) if w]} with model.window_size={cfg.model.window_size}. Fix: "
            f"model.window_size={window} and model.global_layers={[i for i, w in enumerate(theirs) if not w]}")


# The llama3 RoPE scaling megatron-core 0.16.1 applies: only the factor is a GPTModel argument, the rest are
# RotaryEmbedding._apply_scaling's defaults (models/common/embeddings/rotary_pos_embedding.py).
MEGATRON_LLAMA3 = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def rope_parameters(m) -> dict:
    """transformers' rope_parameters of the recipe's RoPE (model config `m`)."""
    if not m.rope_scaling:
        return {"rope_type": "default", "rope_theta": float(m.rotary_base)}
    return {"rope_type": "llama3", "rope_theta": float(m.rotary_base), "factor": float(m.rope_scaling_factor),
            **MEGATRON_LLAMA3}


def rope_mismatch(config, cfg: JobConfig) -> str:
    """Where an HF config's RoPE (theta; rope_parameters, older rope_scaling) differs from what the recipe builds,
    each with its fix, or what megatron-core cannot build; '' where they agree (or the recipe has no RoPE)."""
    m = cfg.model
    if m.position_embedding_type != "rope" or m.mla.enabled:
        return ""
    params = dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})
    theta = params.get("rope_theta", getattr(config, "rope_theta", None))
    kind = params.get("rope_type", params.get("type", "default"))
    problems = []
    if theta is not None and float(theta) != float(m.rotary_base):
        problems.append(f"rope_theta={theta:g}, the recipe's model.rotary_base={m.rotary_base}. Fix: "
                        f"model.rotary_base={theta:.0f}")
    if kind == "default":
        if m.rope_scaling:
            problems.append("rope_type default (no scaling), the recipe has model.rope_scaling=true. Fix: "
                            "model.rope_scaling=false")
    elif kind == "llama3":
        fallback = {"original_max_position_embeddings": getattr(config, "max_position_embeddings", None)}
        theirs = {k: params.get(k, fallback.get(k)) for k in MEGATRON_LLAMA3}
        factor = params.get("factor")
        if any(theirs[k] is None or float(theirs[k]) != v for k, v in MEGATRON_LLAMA3.items()):
            problems.append(f"rope_parameters (llama3) {theirs}: megatron-core 0.16.1 scales with {MEGATRON_LLAMA3} "
                            "only (RotaryEmbedding._apply_scaling), so no recipe reproduces this model")
        elif not m.rope_scaling or float(factor) != float(m.rope_scaling_factor):
            problems.append(f"rope_parameters rope_type=llama3 factor={factor}, the recipe has model.rope_scaling="
                            f"{str(m.rope_scaling).lower()} model.rope_scaling_factor={m.rope_scaling_factor}. Fix: "
                            f"model.rope_scaling=true model.rope_scaling_factor={factor}")
    else:
        problems.append(f"rope_parameters.rope_type={kind!r}: megatron-core 0.16.1's GPTModel scales RoPE the llama3 "
                        "way only (model.rope_scaling), so no recipe reproduces this model")
    return "; ".join(problems)


def moe_unsupported(cfg: JobConfig) -> List[str]:
    """What Mixtral cannot express of an MoE recipe (dense recipes: nothing)."""
    moe, problems = cfg.moe, []
    if not moe.enabled:
        return problems
    if cfg.model.window_size is not None:
        problems.append("model.window_size with MoE (Mixtral's sliding_window covers every layer: no global ones)")
    if cfg.model.arch != "llama":
        problems.append("moe.num_experts on the GPT-2 architecture (MoE exports to Mixtral: a Llama-layout recipe)")
    if moe.first_dense_layers or moe.layer_freq != 1:
        problems.append("dense layers between MoE layers (moe.first_dense_layers/layer_freq): every Mixtral layer is "
                        "MoE")
    if moe.shared_expert_ffn_hidden_size:
        problems.append("moe.shared_expert_ffn_hidden_size (Mixtral has no shared experts)")
    if moe.score_function != "softmax" or moe.pre_softmax:
        problems.append("moe.score_function/pre_softmax: Mixtral's router is a softmax renormalised over the chosen "
                        "k (score_function=softmax, pre_softmax=false)")
    return problems


def canonical(state: State) -> State:
    out = {}
    for key, value in state.items():
        if key.endswith("_extra_state") or value is None:
            continue
        key = GROUPED_EXPERT.sub(r"mlp.experts.local_experts.\2.\1.weight", key)
        for te, local in TE_NAMES.items():
            if key.endswith(te):
                key = key[: -len(te)] + local
        out[key] = value.detach().float().cpu()
    return out


def _split_qkv(w: torch.Tensor, cfg: JobConfig) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    d = cfg.derived
    groups, hd = d.num_query_groups, d.kv_channels
    per_group = cfg.model.num_attention_heads // groups
    w = w.reshape(groups, (per_group + 2) * hd, *w.shape[1:])
    q, k, v = torch.split(w, [per_group * hd, hd, hd], dim=1)
    return (q.reshape(groups * per_group * hd, *w.shape[2:]), k.reshape(groups * hd, *w.shape[2:]),
            v.reshape(groups * hd, *w.shape[2:]))


def _join_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cfg: JobConfig) -> torch.Tensor:
    d = cfg.derived
    groups, hd = d.num_query_groups, d.kv_channels
    rest = q.shape[1:]
    q = q.reshape(groups, -1, *rest)
    k, v = k.reshape(groups, hd, *rest), v.reshape(groups, hd, *rest)
    return torch.cat([q, k, v], dim=1).reshape(-1, *rest)


Rule = Tuple[Tuple[str, ...], Tuple[str, ...], Callable, Callable]   # ours, theirs, to HF, from HF


def _same(*t):
    return t


def _transposed(*t):                      # GPT-2's Conv1D stores (in, out)
    return tuple(x.t().contiguous() for x in t)


def converters(cfg: JobConfig, vocab_size: int) -> tuple:
    """(unpad, pad, qkv_split, qkv_join): the vocabulary rows cut to `vocab_size` and padded back to the model's
    padded size, the fused QKV split into HF's q, k, v and joined back; what every rule table's conversions share."""
    padded = cfg.derived.padded_vocab_size

    def unpad(w):
        return (w[:vocab_size],)

    def pad(w):
        return (torch.cat([w, w.new_zeros(padded - w.shape[0], *w.shape[1:])]) if w.shape[0] < padded else w,)

    def qkv_split(w):
        return _split_qkv(w, cfg)

    def qkv_join(q, k, v):
        return (_join_qkv(q, k, v, cfg),)
    return unpad, pad, qkv_split, qkv_join


def rules(cfg: JobConfig, vocab_size: int) -> List[Rule]:
    """Every tensor of the model: our keys, HF keys, and the conversion each way (one table serves
    export and import, so the two cannot drift apart)."""
    m = cfg.model
    h = m.hidden_size
    unpad, pad, qkv_split, qkv_join = converters(cfg, vocab_size)
    table: List[Rule] = []
    tied = not m.untie_embeddings_and_output_weights
    if m.arch == "gpt":
        table.append((("embedding.word_embeddings.weight",), ("transformer.wte.weight",), unpad, pad))
        table.append((("embedding.position_embeddings.weight",), ("transformer.wpe.weight",), _same, _same))
        for i in range(m.num_layers):
            ours, hf = f"decoder.layers.{i}.", f"transformer.h.{i}."
            for a, b in (("input_layernorm", "ln_1"), ("pre_mlp_layernorm", "ln_2")):
                for p in ("weight", "bias"):
                    table.append(((f"{ours}{a}.{p}",), (f"{hf}{b}.{p}",), _same, _same))
            table.append(((f"{ours}self_attention.linear_qkv.weight",), (f"{hf}attn.c_attn.weight",),
                          lambda w: (torch.cat(_split_qkv(w, cfg)).t().contiguous(),),
                          lambda w: (_join_qkv(*w.t().split(h), cfg),)))
            table.append(((f"{ours}self_attention.linear_qkv.bias",), (f"{hf}attn.c_attn.bias",),
                          lambda b: (torch.cat(_split_qkv(b, cfg)),), lambda b: (_join_qkv(*b.split(h), cfg),)))
            for a, b in (("self_attention.linear_proj", "attn.c_proj"), ("mlp.linear_fc1", "mlp.c_fc"),
                         ("mlp.linear_fc2", "mlp.c_proj")):
                table.append(((f"{ours}{a}.weight",), (f"{hf}{b}.weight",), _transposed, _transposed))
                table.append(((f"{ours}{a}.bias",), (f"{hf}{b}.bias",), _same, _same))
        for p in ("weight", "bias"):
            table.append(((f"decoder.final_layernorm.{p}",), (f"transformer.ln_f.{p}",), _same, _same))
    else:
        table.append((("embedding.word_embeddings.weight",), ("model.embed_tokens.weight",), unpad, pad))
        moe_layers = moe_layer_pattern(cfg.moe, m.num_layers) if cfg.moe.enabled else [0] * m.num_layers
        for i in range(m.num_layers):
            ours, hf = f"decoder.layers.{i}.", f"model.layers.{i}."
            for a, b in (("input_layernorm", "input_layernorm"), ("pre_mlp_layernorm", "post_attention_layernorm"),
                         ("self_attention.linear_proj", "self_attn.o_proj")):
                table.append(((f"{ours}{a}.weight",), (f"{hf}{b}.weight",), _same, _same))
            table.append(((f"{ours}self_attention.linear_qkv.weight",),
                          tuple(f"{hf}self_attn.{x}_proj.weight" for x in "qkv"), qkv_split, qkv_join))
            if m.qk_layernorm:      # per-head RMSNorm of q and k before RoPE, in both (Qwen3's q_norm, k_norm)
                table += [((f"{ours}self_attention.{x}_layernorm.weight",), (f"{hf}self_attn.{x}_norm.weight",),
                           _same, _same) for x in "qk"]
            if moe_layers[i]:
                table += _expert_rules(cfg.moe.num_experts, ours, hf)
                continue
            table.append(((f"{ours}mlp.linear_fc2.weight",), (f"{hf}mlp.down_proj.weight",), _same, _same))
            table.append(((f"{ours}mlp.linear_fc1.weight",), (f"{hf}mlp.gate_proj.weight", f"{hf}mlp.up_proj.weight"),
                          lambda w: tuple(w.chunk(2, dim=0)), lambda gate, up: (torch.cat([gate, up]),)))
        table.append((("decoder.final_layernorm.weight",), ("model.norm.weight",), _same, _same))
    if not tied:
        table.append((("output_layer.weight",), ("lm_head.weight",), unpad, pad))
    return table


def _expert_rules(experts: int, ours: str, hf: str) -> List[Rule]:
    """One MoE layer: the router, and E per-expert matrices <-> one stacked tensor per kind."""
    def stack(*w):
        return (torch.stack(w),)

    def unstack(w):
        return tuple(w.unbind(0))

    local = [f"{ours}mlp.experts.local_experts.{e}." for e in range(experts)]
    return [((f"{ours}mlp.router.weight",), (f"{hf}mlp.gate.weight",), _same, _same),
            (tuple(f"{x}linear_fc1.weight" for x in local), (f"{hf}mlp.experts.gate_up_proj",), stack, unstack),
            (tuple(f"{x}linear_fc2.weight" for x in local), (f"{hf}mlp.experts.down_proj",), stack, unstack)]


def to_hf(state: State, cfg: JobConfig, vocab_size: int) -> State:
    """Our (canonical) state dict -> the HF model's state dict (vocab cut to `vocab_size`)."""
    return merged(hf_groups(state, cfg, vocab_size))


def hf_groups(state: State, cfg: JobConfig, vocab_size: int) -> Iterator[State]:
    """to_hf one transformer layer at a time (`make export` streams them into shards)."""
    return by_layer(rules(cfg, vocab_size), canonical(state))


def by_layer(table: List[Rule], ours: State) -> Iterator[State]:
    """The HF tensors of a rule table's export direction, one group per run of rules of the same HF layer (the first
    number in the HF name; embeddings and final norms: groups of their own), each made when its turn comes."""
    group: State = {}
    layer = None
    for keys, theirs, forward, _ in table:
        number = re.search(r"\.(\d+)\.", theirs[0])
        if group and (number and number.group(1)) != layer:
            yield group
            group = {}
        layer = number and number.group(1)
        group.update(zip(theirs, (t.contiguous() for t in forward(*(ours[k] for k in keys))), strict=True))
    if group:
        yield group


def merged(groups: Iterator[State]) -> State:
    return {k: v for group in groups for k, v in group.items()}


def from_hf(hf: State, cfg: JobConfig) -> State:
    """The HF model's state dict -> ours (vocab rows padded with zeros to the padded size)."""
    vocab = hf["transformer.wte.weight" if cfg.model.arch == "gpt" else "model.embed_tokens.weight"].shape[0]
    tied = {"lm_head.weight"} if not cfg.model.untie_embeddings_and_output_weights else set()
    return apply_backward(hf, rules(cfg, vocab), tied)


def apply_backward(hf: State, table: List[Rule], tied_copies=frozenset()) -> State:
    """Our state from the HF model's by a rule table's from-HF direction; `tied_copies`: HF keys that repeat
    another (tied weights), read by no rule. Every other HF tensor must have a rule."""
    hf = {k: v.detach().float().cpu() for k, v in hf.items()}
    s: State = {}
    used = set(tied_copies)
    absent = [k for _, theirs, _, _ in table for k in theirs if k not in hf]
    if absent:
        raise ValueError(f"the HF model lacks {len(absent)} tensors the recipe's model has: {absent[:4]}. "
                         "Fix: a recipe with the same features (qk_layernorm, moe layers, untied embeddings, ...)")
    for ours, theirs, _, backward in table:
        s.update(zip(ours, backward(*(hf[k] for k in theirs)), strict=True))
        used.update(theirs)
    left = sorted(set(hf) - used)
    if left:            # a tensor the recipe has no place for (biases, extra norms) is refused, never dropped
        raise ValueError(f"{len(left)} tensors of the HF model have no place in the recipe's model: {left[:4]}. "
                         "Fix: a recipe with the same features (add_bias_linear, qk_layernorm, ...)")
    return {k: v.contiguous() for k, v in s.items()}


def llama_fields(cfg: JobConfig, vocab_size: int, bos: int, eos: int) -> dict:
    """The config fields every Llama-layout family (Llama, Ministral, Mixtral, Qwen3, Qwen3-MoE) shares."""
    m, d = cfg.model, cfg.derived
    return dict(vocab_size=vocab_size, hidden_size=m.hidden_size, num_hidden_layers=m.num_layers,
                num_attention_heads=m.num_attention_heads, num_key_value_heads=d.num_query_groups,
                head_dim=d.kv_channels, max_position_embeddings=d.max_position_embeddings,
                rms_norm_eps=m.layernorm_epsilon, rope_parameters=rope_parameters(m), hidden_act="silu",
                initializer_range=m.init_method_std, tie_word_embeddings=not m.untie_embeddings_and_output_weights,
                bos_token_id=bos, eos_token_id=eos)


def hf_config(cfg: JobConfig, vocab_size: int, bos: int, eos: int):
    """The transformers config of the exported model (GPT-2, Llama, Ministral, Mixtral)."""
    m, d = cfg.model, cfg.derived
    tied = not m.untie_embeddings_and_output_weights
    if m.arch == "gpt":
        from transformers import GPT2Config
        return GPT2Config(vocab_size=vocab_size, n_positions=d.max_position_embeddings, n_embd=m.hidden_size,
                          n_layer=m.num_layers, n_head=m.num_attention_heads, n_inner=d.ffn_hidden_size,
                          activation_function="gelu",        # megatron-core's exact (erf) GELU, not gelu_new
                          resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, layer_norm_epsilon=m.layernorm_epsilon,
                          initializer_range=m.init_method_std, scale_attn_weights=True,
                          tie_word_embeddings=tied, bos_token_id=bos, eos_token_id=eos,
                          architectures=["GPT2LMHeadModel"])
    common = llama_fields(cfg, vocab_size, bos, eos)
    moe = cfg.moe
    if moe.enabled:
        from transformers import MixtralConfig
        return MixtralConfig(intermediate_size=moe.ffn_hidden_size or d.ffn_hidden_size,
                             num_local_experts=moe.num_experts, num_experts_per_tok=moe.router_topk,
                             router_aux_loss_coef=moe.aux_loss_coeff, sliding_window=None,
                             architectures=["MixtralForCausalLM"], **common)
    pattern = window_pattern(m)
    if pattern:     # Ministral: Llama's layout with per-layer sliding/full attention; HF's window counts the query
        from transformers import MinistralConfig
        return MinistralConfig(intermediate_size=d.ffn_hidden_size, sliding_window=m.window_size + 1,
                               layer_types=["sliding_attention" if w else "full_attention" for w in pattern],
                               architectures=["MinistralForCausalLM"], **common)
    from transformers import LlamaConfig
    return LlamaConfig(intermediate_size=d.ffn_hidden_size, attention_bias=False, mlp_bias=False,
                       architectures=["LlamaForCausalLM"], **common)
