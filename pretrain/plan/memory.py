"""Memory per GPU: weights / grads / optimizer states / activations, per pipeline stage.

Sources (formulas in docs/planner.md):
* states: ZeRO paper (Rajbhandari et al. 2020): mixed-precision Adam holds 2-byte params,
  fp32 grads (megatron-core's main_grad when precision.grad_reduce_in_fp32), and 12 bytes
  of optimizer state (fp32 master, m, v); the distributed optimizer / ZeRO-1 divides the
  optimizer state by DP, ZeRO-2 also the grads, ZeRO-3 also the weights.
* activations: Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
  Transformer Models", eq. 1-2 and table 2, generalised to GQA, any FFN width and SwiGLU;
  context parallelism divides the sequence (and so every activation) by CP; the interleaved
  schedule keeps (1 + (p-1)/(p*v)) times the 1F1B activations on the first stage (ibid., sec. 4.2.3).
  Selective recompute keeps no attention scores, but where they are materialised (unfused attention)
  the backward recomputes one layer's at a time: that layer's scores are added once.
* MoE: a rank holds 1/EP of the experts, split over the expert TP degree; with the distributed
  optimizer their states are sharded over the expert-data-parallel ranks (world / (ETP x EP x PP)).
  An MoE layer's MLP activations are those of top-k expert MLPs per token (tokens spread evenly over
  experts: the balanced case), plus the permuted expert inputs and the router's fp32 logits.
* PEFT: the frozen base's weights and activations as above, grads and optimizer state of the added
  parameters only (plus their weights and activations; peft.py). Distillation: the teacher's weights at
  the student's TP, and its forward working set: one layer's activations (what it would keep for backward
  bounds what one layer's forward holds at once) plus its fp32 logits [micro x seq x vocab/TP] for the KL.
* BERT / T5 (model.arch): the weights from inventory_encdec.py, the activations from plan/encdec.py (each stack
  at its own sequence length, scores materialised: the local attention those models run).
"""
from __future__ import annotations

from ..config.attention import materialises_scores, window_pattern
from ..config.derive import pipeline_stage_layers
from ..config.schema import JobConfig
from ..model.inventory import embedding_tensors, head_tensors, layer_kinds, layer_tensors, stage_tensors
from ..model.inventory_encdec import ENCDEC_ARCHS, encdec_tensors
from ..model.mla import mla_activation_bytes
from ..optim.muon import is_muon_matrix
from ..optim.registry import OPTIMIZERS
from .encdec import encdec_activation_bytes
from .fsdp2 import fsdp2, gathered_bytes
from .peft import (
    added_activation_bytes_per_layer,
    layer_added_tensors,
    prompt_activation_bytes,
    prompt_tensors,
    teacher_at,
)

GIB = 1024**3


def doc_mask(cfg: JobConfig) -> bool:
    """data.document_mask's explicit s x s mask path (CPU); on GPUs the thd path keeps no mask."""
    return cfg.data.document_mask and cfg.cluster.gpu_type == "cpu"


def _bytes_per_element(cfg: JobConfig) -> int:
    return 2 if cfg.precision.half else 4


def _state_bytes_of(cfg: JobConfig):
    """The optimizer state of one tensor (by name and per-rank shape). optim=muon trains only the hidden matrices
    (optim/muon.py's is_muon_matrix) with Muon; the embeddings, the output layer, norms, biases and routers get
    AdamW's two moments, whatever their shape (the registry's state_bytes sees shapes alone)."""
    own, adamw = OPTIMIZERS.get(cfg.optim.name).state_bytes, OPTIMIZERS.get("adamw").state_bytes
    if cfg.optim.name != "muon":
        return lambda t, shape: own(shape)
    return lambda t, shape: own(shape) if is_muon_matrix(t.name) else adamw(shape)


def optimizer_state_bytes(cfg: JobConfig, tensors, tp: int) -> float:
    master = 4 if cfg.precision.half else 0        # fp32 main params beside the 2-byte model params
    state_bytes = _state_bytes_of(cfg)
    return sum(t.per_rank(tp) * master + state_bytes(t, t.per_rank_shape(tp)) for t in tensors)


def checkpoint_bytes(cfg: JobConfig) -> float:
    """One checkpoint on disk, all ranks together: every parameter once in the params' dtype plus the optimizer's
    state (fp32 main params under bf16/fp16, Adam's two moments: 14 bytes/param for bf16 AdamW). A tied output
    layer is stored once; RNG states, the data position and meta.json are negligible beside them."""
    tensors = [*embedding_tensors(cfg), *head_tensors(cfg, tied_copy=False),
               *(t for kind in layer_kinds(cfg) for t in layer_tensors(cfg, moe=kind))]    # as count_params
    if cfg.model.arch in ENCDEC_ARCHS:
        tensors = encdec_tensors(cfg)
    return sum(t.numel for t in tensors) * _bytes_per_element(cfg) + optimizer_state_bytes(cfg, tensors, 1)


def activation_bytes_per_layer(cfg: JobConfig, granularity: str | None = "recipe", moe: bool = False) -> float:
    """Activations one layer keeps for backward, for one micro-batch on one TP rank.

    `granularity` defaults to the recipe's recompute setting; pass None for no recompute.
    `moe`: an MoE layer (top-k expert MLPs per token instead of the dense MLP)."""
    m, d, p = cfg.model, cfg.derived, cfg.parallel
    if granularity == "recipe":
        granularity = p.recompute_granularity
    s, b, h, t = m.seq_length // p.context_parallel_size, cfg.batch.micro_batch_size, m.hidden_size, \
        p.tensor_model_parallel_size
    a = m.num_attention_heads
    e = _bytes_per_element(cfg)
    q = a * d.kv_channels
    kv = d.num_query_groups * d.kv_channels
    f = d.ffn_hidden_size
    gate = 2 if m.activation == "swiglu" else 1
    sp = t if p.sequence_parallel else 1        # what SP shards that TP alone replicates
    mask = 1 if m.hidden_dropout > 0 else 0

    if granularity == "full":
        return e * s * b * h / sp               # only the layer input is kept
    # Replicated over TP unless SP: 2 norm inputs, QKV and fc1 inputs, 2 dropout masks.
    replicated = s * b * h * (4 * e + 2 * mask) / sp
    attention = s * b * (q + 2 * kv) * e / t + s * b * q * e / t        # Q, K, V + proj input
    if m.mla.enabled:
        attention = mla_activation_bytes(cfg, s * b, e)
    mlp = s * b * f * gate * e / t + s * b * f * e / t                   # act input + fc2 input
    if moe:
        mlp = _moe_mlp_bytes(cfg, s * b / sp, e)
    core = scores_bytes(cfg) if granularity != "selective" else 0.0
    return replicated + attention + mlp + core


def scores_bytes(cfg: JobConfig) -> float:
    """One layer's materialised attention scores on one rank (0 with flash attention): the softmax output, plus
    the dropout mask and output when attention dropout is on. Selective recompute drops them from what the
    layer keeps, but recomputes them in its backward: one layer's are then alive at a time."""
    m, p = cfg.model, cfg.parallel
    if not materialises_scores(cfg):        # TE's or torch's fused kernels (model/attention_record.py)
        return 0.0
    s, b, e = m.seq_length // p.context_parallel_size, cfg.batch.micro_batch_size, _bytes_per_element(cfg)
    drop = (1 + e) if m.attention_dropout > 0 else 0
    return m.num_attention_heads * s * s * b * (e + drop) / p.tensor_model_parallel_size


def window_mask_bytes(cfg: JobConfig) -> float:
    """The bool s x s mask one sliding-window layer builds and keeps for backward where scores are materialised
    and not recomputed (megatron-core's get_sliding_window_causal_mask is built per layer and call; the plain
    causal mask is one cached tensor). With flash attention a window changes no activation: O(s) per head."""
    if scores_bytes(cfg) == 0 or cfg.parallel.recompute_granularity is not None:
        return 0.0
    s = cfg.model.seq_length // cfg.parallel.context_parallel_size
    return s * s


def _moe_mlp_bytes(cfg: JobConfig, tokens: float, e: int) -> float:
    """One MoE layer's MLP activations on one rank: the router's fp32 logits, the k permuted copies of
    each token (expert inputs), each expert MLP's activation and fc2 inputs (split over expert TP),
    and the shared experts as a dense MLP."""
    m, moe, p = cfg.model, cfg.moe, cfg.parallel
    gate = 2 if m.activation == "swiglu" else 1
    etp = p.expert_tensor_parallel_size or p.tensor_model_parallel_size
    width = moe.ffn_hidden_size or cfg.derived.ffn_hidden_size
    routed = tokens * moe.router_topk
    out = tokens * moe.num_experts * 4 + routed * m.hidden_size * e + routed * width * (gate + 1) * e / etp
    if moe.shared_expert_ffn_hidden_size:
        out += tokens * moe.shared_expert_ffn_hidden_size * (gate + 1) * e / p.tensor_model_parallel_size
    return out


def stage_param_bytes(cfg: JobConfig, cache: dict | None = None) -> list[tuple[float, float, float]]:
    """(parameters, optimizer-state bytes, trained parameters) per pipeline stage on one TP rank, before any DP
    sharding; under PEFT the optimizer state and trained parameters are the added ones only.
    Depends on the model, TP and the PP split only: `cache` (a dict) memoises it across layouts."""
    p = cfg.parallel
    tp, ep, cp = p.tensor_model_parallel_size, p.expert_model_parallel_size, p.context_parallel_size
    etp = p.expert_tensor_parallel_size or tp
    key = (tp, p.pipeline_model_parallel_size, p.num_layers_in_first_pipeline_stage,
           p.num_layers_in_last_pipeline_stage, ep, etp, cp)
    if cache is not None and key in cache:
        return cache[key]
    out = []
    layers = pipeline_stage_layers(cfg.model.num_layers, p.pipeline_model_parallel_size,
                                   p.num_layers_in_first_pipeline_stage, p.num_layers_in_last_pipeline_stage)
    for i, tensors in enumerate(stage_tensors(cfg)):
        dense, experts = [t for t in tensors if not t.expert], [t for t in tensors if t.expert]
        n = sum(t.per_rank(tp) for t in dense) + sum(t.per_rank(tp, ep, etp) for t in experts)
        # Expert states are sharded over expert-DP = DP x TP x CP / (ETP x EP) ranks; memory_per_gpu
        # divides every state by DP, so they enter scaled by DP / expert-DP.
        expert_state = optimizer_state_bytes(cfg, experts, etp) / ep * (etp * ep) / (tp * cp) if experts else 0.0
        if cfg.peft.enabled:     # the base is frozen: only what PEFT adds has grads and optimizer state
            added = layer_added_tensors(cfg) * layers[i] + (prompt_tensors(cfg) if i == 0 else [])
            trained = sum(t.per_rank(tp) for t in added)
            out.append((n + trained, optimizer_state_bytes(cfg, added, tp), trained))
            continue
        out.append((n, optimizer_state_bytes(cfg, dense, tp) + expert_state, n))
    if cache is not None:
        cache[key] = out
    return out


def memory_per_gpu(cfg: JobConfig, cache: dict | None = None) -> dict:
    """Bytes per GPU for the most loaded pipeline stage, by component, in GiB."""
    p, d = cfg.parallel, cfg.derived
    tp, pp, dp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size, d.data_parallel_size
    e = _bytes_per_element(cfg)
    grad_bytes = 4 if (e == 4 or cfg.precision.grad_reduce_in_fp32) else e
    zero = cfg.deepspeed.zero_stage if p.engine == "deepspeed" else (1 if p.use_distributed_optimizer else 0)
    if fsdp2(cfg):          # FSDP2 shards like ZeRO-3, plus its gathered layers (plan/fsdp2.py)
        zero = 3
    layers = pipeline_stage_layers(cfg.model.num_layers, pp, p.num_layers_in_first_pipeline_stage,
                                   p.num_layers_in_last_pipeline_stage)
    kinds = layer_kinds(cfg)
    per_kind = {kind: activation_bytes_per_layer(cfg, moe=kind) for kind in set(kinds)}
    s, b = cfg.model.seq_length // p.context_parallel_size, cfg.batch.micro_batch_size
    in_flight = min(pp, d.num_microbatches)   # 1F1B: stage i holds (pp - i) micro-batches
    vpp = p.virtual_pipeline_model_parallel_size
    interleave = 1 + (pp - 1) / (pp * vpp) if vpp and pp > 1 else 1.0

    if cfg.peft.enabled and p.recompute_granularity != "full":    # full recompute repeats the added modules too
        added = added_activation_bytes_per_layer(cfg, s * b, e)
        per_kind = {kind: value + added for kind, value in per_kind.items()}
    teacher = teacher_at(cfg)

    best = None
    for i, (n, state_bytes, trained) in enumerate(stage_param_bytes(cfg, cache)):
        weights = n * e / (dp if zero >= 3 else 1)
        if cfg.precision.fp8:    # Transformer Engine caches each GEMM weight in FP8 and its transpose: 2 bytes
            weights += n * 2
        grads = trained * grad_bytes / (dp if zero >= 2 else 1)
        optimizer = state_bytes / (dp if zero >= 1 else 1)
        if p.engine == "deepspeed" and cfg.deepspeed.offload_optimizer:
            optimizer = 0.0
        if p.engine == "deepspeed" and cfg.deepspeed.offload_param:
            weights = 0.0
        first = sum(layers[:i])
        stage_layers = sum(per_kind[kind] for kind in kinds[first:first + layers[i]])
        stage_layers += window_mask_bytes(cfg) * sum((window_pattern(cfg.model) or [])[first:first + layers[i]])
        activations = stage_layers * max(1, in_flight - i) * (interleave if i == 0 else 1.0)
        if p.recompute_granularity == "full":   # the recomputed group's working set in backward
            working = activation_bytes_per_layer(cfg, None) + (added_activation_bytes_per_layer(cfg, s * b, e)
                                                               if cfg.peft.enabled else 0.0)
            activations += working * min(layers[i], p.recompute_num_layers)
        if p.recompute_granularity == "selective":    # the recomputed scores of the layer in backward
            activations += scores_bytes(cfg)
        if i == 0:
            activations += prompt_activation_bytes(cfg, e) * max(1, in_flight)
        if doc_mask(cfg):                        # one bool [b, 1, s, s] mask per micro-batch, shared by the layers
            activations += s * s * b * max(1, in_flight - i)
        if i == pp - 1:                          # fp32 logits for the cross entropy
            activations += 4 * s * b * d.padded_vocab_size / tp
        if cfg.model.arch in ENCDEC_ARCHS:     # BERT / T5: their stacks and heads (plan/encdec.py)
            activations = encdec_activation_bytes(cfg, activation_bytes_per_layer)
        stage = {"weights": weights, "grads": grads, "optimizer": optimizer, "activations": activations}
        if fsdp2(cfg):
            stage["gathered"] = gathered_bytes(cfg, e, grad_bytes)
        if teacher is not None:
            stage.update(teacher_bytes(teacher))
        stage["total"] = sum(stage.values())
        stage["stage"] = i
        if best is None or stage["total"] > best["total"]:
            best = stage
    return {k: (v / GIB if k != "stage" else v) for k, v in best.items()}


def teacher_bytes(teacher: JobConfig) -> dict:
    """A distillation teacher on one rank (`teacher`: peft.teacher_at's, at the student's layout; PP=1): its
    weights in the run's dtype, and its forward's working set, its largest layer's activations plus its fp32
    logits."""
    n = sum(stage[0] for stage in stage_param_bytes(teacher))
    layer = max(activation_bytes_per_layer(teacher, None, moe=kind) for kind in set(layer_kinds(teacher)))
    s, b = teacher.model.seq_length // teacher.parallel.context_parallel_size, teacher.batch.micro_batch_size
    logits = 4 * s * b * teacher.derived.padded_vocab_size / teacher.parallel.tensor_model_parallel_size
    return {"teacher_weights": n * _bytes_per_element(teacher),
            "teacher_activations": layer + logits}
