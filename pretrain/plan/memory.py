"""Memory per GPU: weights / grads / optimizer states / activations, per pipeline stage.

Sources (formulas in docs/planner.md):
* states: ZeRO paper (Rajbhandari et al. 2020): mixed-precision Adam holds 2-byte params,
  fp32 grads (megatron-core's main_grad when precision.grad_reduce_in_fp32), and 12 bytes
  of optimizer state (fp32 master, m, v); the distributed optimizer / ZeRO-1 divides the
  optimizer state by DP, ZeRO-2 also the grads, ZeRO-3 also the weights.
* activations: Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
  Transformer Models", eq. 1-2 and table 2, generalised to GQA, any FFN width and SwiGLU.
"""
from __future__ import annotations

from ..config.schema import JobConfig
from ..config.validate import pipeline_stage_layers
from ..model.inventory import stage_tensors
from ..optim import OPTIMIZERS

GIB = 1024**3


def _bytes_per_element(cfg: JobConfig) -> int:
    return 2 if cfg.precision.half else 4


def optimizer_state_bytes(cfg: JobConfig, tensors, tp: int) -> float:
    master = 4 if cfg.precision.half else 0        # fp32 main params beside the 2-byte model params
    state_bytes = OPTIMIZERS.get(cfg.optim.name).state_bytes
    return sum(t.per_rank(tp) * master + state_bytes(t.per_rank_shape(tp)) for t in tensors)


def activation_bytes_per_layer(cfg: JobConfig, granularity: str | None = "recipe") -> float:
    """Activations one layer keeps for backward, for one micro-batch on one TP rank.

    `granularity` defaults to the recipe's recompute setting; pass None for no recompute."""
    m, d, p = cfg.model, cfg.derived, cfg.parallel
    if granularity == "recipe":
        granularity = p.recompute_granularity
    s, b, h, t = m.seq_length, cfg.batch.micro_batch_size, m.hidden_size, p.tensor_model_parallel_size
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
    mlp = s * b * f * gate * e / t + s * b * f * e / t                   # act input + fc2 input
    core = 0.0
    flash = m.attention_backend in ("flash", "fused", "auto")
    if granularity != "selective" and not flash:
        # softmax output, plus dropout mask and output when attention dropout is on
        drop = (1 + e) if m.attention_dropout > 0 else 0
        core = a * s * s * b * (e + drop) / t
    return replicated + attention + mlp + core


def memory_per_gpu(cfg: JobConfig) -> dict:
    """Bytes per GPU for the most loaded pipeline stage, by component, in GiB."""
    p, d = cfg.parallel, cfg.derived
    tp, pp, dp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size, d.data_parallel_size
    e = _bytes_per_element(cfg)
    grad_bytes = 4 if (e == 4 or cfg.precision.grad_reduce_in_fp32) else e
    zero = cfg.deepspeed.zero_stage if p.engine == "deepspeed" else (1 if p.use_distributed_optimizer else 0)
    layers = pipeline_stage_layers(cfg.model.num_layers, pp, p.num_layers_in_first_pipeline_stage,
                                   p.num_layers_in_last_pipeline_stage)
    per_layer = activation_bytes_per_layer(cfg)
    s, b = cfg.model.seq_length, cfg.batch.micro_batch_size
    in_flight = min(pp, d.num_microbatches)   # 1F1B: stage i holds (pp - i) micro-batches

    best = None
    for i, tensors in enumerate(stage_tensors(cfg)):
        n = sum(t.per_rank(tp) for t in tensors)
        weights = n * e / (dp if zero >= 3 else 1)
        grads = n * grad_bytes / (dp if zero >= 2 else 1)
        optimizer = optimizer_state_bytes(cfg, tensors, tp) / (dp if zero >= 1 else 1)
        if p.engine == "deepspeed" and cfg.deepspeed.offload_optimizer:
            optimizer = 0.0
        if p.engine == "deepspeed" and cfg.deepspeed.offload_param:
            weights = 0.0
        activations = per_layer * layers[i] * max(1, in_flight - i)
        if p.recompute_granularity == "full":   # the recomputed group's working set in backward
            activations += activation_bytes_per_layer(cfg, None) * min(layers[i], p.recompute_num_layers)
        if i == pp - 1:                          # fp32 logits for the cross entropy
            activations += 4 * s * b * d.padded_vocab_size / tp
        stage = {"weights": weights, "grads": grads, "optimizer": optimizer, "activations": activations}
        stage["total"] = sum(stage.values())
        stage["stage"] = i
        if best is None or stage["total"] > best["total"]:
            best = stage
    return {k: (v / GIB if k != "stage" else v) for k, v in best.items()}
