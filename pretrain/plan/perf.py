"""Modelled step time of one layout: where the seconds of an optimizer step go.

One pipeline stage's micro-batch (forward + backward of its layers) is timed from first
principles, then the schedule, data-parallel reduction and optimizer are added:

* GEMMs: 6 x tokens x matmul weights / TP at the device's measured matmul ceiling (MAMF);
* attention: causal flash attention, 6 b s (s/CP) (heads x head dim) / TP FLOPs (half of the
  12 s H Q of the PaLM count, which ignores the mask) at ATTENTION_FRACTION of peak;
* element-wise work (norms, bias-dropout-add, activation, RoPE): memory bound, bytes / HBM;
* recompute: full repeats the forward (x4/3 GEMM, attention, element-wise, + the forward TP
  collectives), selective repeats core attention (x4/3 attention);
* TP: 2 all-reduces (or all-gather + reduce-scatter with SP, same bytes) forward and 2
  backward per layer of tokens x hidden, ring cost 2(t-1)/t bytes / link, not overlapped;
* CP: ring exchange of K and V, (c-1) steps forward and 2(c-1) backward, overlapped with the
  attention blocks (Transformer Engine's ring attention): only the excess counts;
* PP: one send forward and one backward per micro-batch and model chunk; the 1F1B /
  interleaved bubble is (p-1)/v micro-batch times, i.e. a fraction (p-1)/(m v) of the work;
* DP: gradient reduce-scatter + parameter all-gather (distributed optimizer / ZeRO-1/2) or
  all-reduce, overlapped with the last micro-batch's backward (grads) and the first's forward
  (params) when the engine does so (megatron overlap_grad_reduce / overlap_param_gather;
  DeepSpeed overlap_comm in the templates); ZeRO-3 gathers weights every micro-batch;
* optimizer: memory bound, ~34 bytes touched per locally held parameter (Adam, mixed precision).

Links: TP, CP and DP groups within a node use NVLink, groups that span nodes the per-GPU
InfiniBand rate times the group's members per node (NCCL runs one ring channel per NIC); Megatron
rank order: TP fastest, then CP, DP, PP. Rates: hardware.py.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..config.schema import JobConfig
from ..config.validate import pipeline_stage_layers
from ..model.inventory import layer_tensors
from .estimate import flops_per_token
from .hardware import ATTENTION_FRACTION, COLLECTIVE_LATENCY_S, FP8_GEMM_SPEEDUP, LINK_EFFICIENCY, device, peak_tflops

DDP_BUCKET_PARAMS = 40e6   # megatron-core DDP bucket size (parameters); one collective per bucket
ADAM_BYTES_TOUCHED = 34     # read fp32 master, grad, m, v (16) + write master, m, v (12) + bf16 param (2) + norm (4)


@dataclass(frozen=True)
class Rates:
    gemm: float       # FLOP/s
    attention: float  # FLOP/s
    hbm: float        # B/s
    nvlink: float     # B/s per GPU per direction, after LINK_EFFICIENCY
    ib: float
    peak: float       # dense FLOP/s of the recipe's dtype (for MFU)
    per_node: int


def rates(cfg: JobConfig, fp8: bool = False) -> Rates:
    dev = device(cfg.cluster.gpu_type)
    half = cfg.precision.half
    peak = peak_tflops(cfg.cluster.gpu_type, half) * 1e12
    bf16 = peak_tflops(cfg.cluster.gpu_type, True) * 1e12
    gemm = dev["mamf_tflops"] * 1e12 * (peak / bf16) * (FP8_GEMM_SPEEDUP if fp8 else 1.0)
    return Rates(gemm=gemm, attention=ATTENTION_FRACTION * peak, hbm=dev["hbm_tbps"] * 1e12,
                 nvlink=dev["nvlink_gbps"] * 1e9 * LINK_EFFICIENCY, ib=dev["ib_gbps"] * 1e9 * LINK_EFFICIENCY,
                 peak=peak, per_node=cfg.cluster.devices_per_node)


@dataclass(frozen=True)
class Shape:
    """Per-layer constants of the model (independent of the layout)."""
    matmul: int       # GEMM weights of one layer (TP=1)
    hidden: int
    q: int            # heads x head dim
    kv: int           # query groups x head dim
    ffn: int
    gate: int
    rope: bool
    seq: int


def shape(cfg: JobConfig) -> Shape:
    m, d = cfg.model, cfg.derived
    return Shape(matmul=sum(t.numel for t in layer_tensors(cfg) if t.matmul), hidden=m.hidden_size,
                 q=m.num_attention_heads * d.kv_channels, kv=d.num_query_groups * d.kv_channels,
                 ffn=d.ffn_hidden_size, gate=2 if m.activation == "swiglu" else 1,
                 rope=m.position_embedding_type == "rope", seq=m.seq_length)


def group_bandwidth(rate: Rates, members: int, stride: int) -> float:
    """Per-GPU bandwidth of a collective over `members` ranks `stride` apart. Within a node: NVLink.
    Across nodes, each node holds k = per_node / stride of the members, and NCCL spreads the ring
    over their k NICs (one per GPU), so the inter-node hop carries k x the per-GPU IB rate, up to NVLink."""
    if members * stride <= rate.per_node:
        return rate.nvlink
    k = max(1, rate.per_node // stride)
    return min(rate.nvlink, k * rate.ib)


def _ring(bytes_: float, n: int, bw: float, factor: float = 1.0, calls: float = 1.0) -> float:
    """`calls` ring collectives moving `bytes_` in all over n ranks: all-gather / reduce-scatter factor 1,
    all-reduce 2. A ring has (n-1) dependent hops per pass, each paying COLLECTIVE_LATENCY_S."""
    return 0.0 if n <= 1 else factor * (n - 1) / n * bytes_ / bw + calls * factor * (n - 1) * COLLECTIVE_LATENCY_S


def step_time(cfg: JobConfig, rate: Rates, sh: Shape, stage_params: list[tuple[int, float]]) -> dict:
    """Seconds per optimizer step by component, plus MFU. `stage_params`: memory.stage_param_bytes."""
    p, d = cfg.parallel, cfg.derived
    tp, pp, cp, dp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size, p.context_parallel_size, \
        d.data_parallel_size
    v = p.virtual_pipeline_model_parallel_size or 1
    b, s, m = cfg.batch.micro_batch_size, sh.seq, d.num_microbatches
    e = 2 if cfg.precision.half else 4
    tokens = b * s / cp
    rc = p.recompute_granularity
    r_fwd = 4 / 3 if rc == "full" else 1.0           # forward repeated: work x (1 fwd + 2 bwd + 1 fwd) / 3
    r_attn = 4 / 3 if rc in ("full", "selective") else 1.0

    gemm = 6 * tokens * sh.matmul / tp / rate.gemm
    attn = 6 * b * s * (s / cp) * sh.q / tp / rate.attention
    replicated = 10 * sh.hidden / (tp if p.sequence_parallel else 1)
    act = (sh.gate + 1) * sh.ffn / tp
    rope = 2 * (sh.q + sh.kv) / tp if sh.rope else 0
    elem = 3 * tokens * (replicated + act + rope) * e / rate.hbm
    per_node = rate.per_node
    tp_bw = group_bandwidth(rate, tp, 1)
    tp_calls = (6 if rc == "full" else 4) * (2 if p.sequence_parallel else 1)
    tp_comm = tp_calls * _ring(tokens * sh.hidden * e, tp, tp_bw, 2.0 / (2 if p.sequence_parallel else 1))
    cp_bw = group_bandwidth(rate, cp, tp)
    kv_bytes = b * (s / cp) * 2 * sh.kv / tp * e
    cp_comm = ((4 if rc == "full" else 3) * (cp - 1) * (kv_bytes / cp_bw + COLLECTIVE_LATENCY_S)) if cp > 1 else 0.0
    cp_exposed = max(0.0, cp_comm - attn * r_attn)
    layer = {"gemm": gemm * r_fwd, "attention": attn * r_attn, "elementwise": elem * r_fwd, "tp_comm": tp_comm,
             "cp_comm": cp_exposed}
    recompute_layer = gemm * (r_fwd - 1) + attn * (r_attn - 1) + elem * (r_fwd - 1)

    layers = pipeline_stage_layers(cfg.model.num_layers, pp, p.num_layers_in_first_pipeline_stage,
                                   p.num_layers_in_last_pipeline_stage)
    vocab = d.padded_vocab_size
    head = (6 * tokens * sh.hidden * vocab / tp / rate.gemm           # output layer GEMM
            + 4 * 4 * tokens * vocab / tp / rate.hbm)                 # fp32 logits: write, max, exp-sum, grad
    stage_times = [n * sum(layer.values()) + (head if i == pp - 1 else 0.0) for i, n in enumerate(layers)]
    worst = max(range(pp), key=lambda i: stage_times[i])
    t_mb = stage_times[worst]
    n_layers = layers[worst]

    pp_bw = rate.nvlink if tp * cp * dp < per_node else rate.ib
    p2p_bytes = tokens * sh.hidden * e / (tp if p.sequence_parallel else 1)
    p2p = 2 * v * (p2p_bytes / pp_bw + COLLECTIVE_LATENCY_S) if pp > 1 else 0.0
    slot = t_mb + p2p
    bubble = (pp - 1) / v * slot

    n_local = stage_params[worst][0]
    grad_bytes = n_local * (4 if (e == 4 or cfg.precision.grad_reduce_in_fp32) else e)
    dp_bw = group_bandwidth(rate, dp, tp * cp)
    engine_ds = p.engine == "deepspeed"
    zero = cfg.deepspeed.zero_stage if engine_ds else (1 if p.use_distributed_optimizer else 0)
    overlap_grad = engine_ds or p.overlap_grad_reduce
    overlap_param = p.overlap_param_gather and not engine_ds
    bwd, fwd = 2 / 3 * t_mb, 1 / 3 * t_mb
    buckets = max(1.0, n_local / DDP_BUCKET_PARAMS)
    if zero == 0:
        grads, params, zero3 = _ring(grad_bytes, dp, dp_bw, 2.0, buckets), 0.0, 0.0
    else:
        grads, params = _ring(grad_bytes, dp, dp_bw, 1.0, buckets), _ring(n_local * e, dp, dp_bw, 1.0, buckets)
        zero3 = 0.0
        if engine_ds and zero >= 2:   # partitioned gradients: reduce-scattered after every micro-batch
            zero3 = (m - 1) * max(0.0, grads - bwd)
        if engine_ds and zero >= 3:   # each layer's weights gathered for forward and again for backward, per
            gather = _ring(n_local * e, dp, dp_bw, 1.0, n_layers)    # micro-batch, prefetched behind compute
            zero3 = m * max(0.0, 2 * gather + grads - t_mb)
            grads = params = 0.0
    dp_exposed = (max(0.0, grads - bwd) if overlap_grad else grads) + \
        (max(0.0, params - fwd) if overlap_param else params) + zero3

    held = n_local / (dp if zero >= 1 else 1)
    optimizer = held * ADAM_BYTES_TOUCHED / rate.hbm

    out = {k: m * n_layers * val for k, val in layer.items()}
    out["head"] = m * (head if worst == pp - 1 else 0.0)
    out["pp_p2p"] = m * p2p
    out["bubble"] = bubble
    out["dp_comm"] = dp_exposed
    out["optimizer"] = optimizer
    step = sum(out.values())
    out["recompute"] = m * n_layers * recompute_layer      # included above (part of gemm/attention/elementwise)
    flops = flops_per_token(cfg, {"matmul": sh.matmul * cfg.model.num_layers + vocab * sh.hidden})
    out["step"] = step
    out["mfu"] = flops["model"] * d.tokens_per_step / (step * d.world_size * rate.peak)
    out["tflops_per_gpu"] = out["mfu"] * rate.peak / 1e12
    out["hw_tflops_per_gpu"] = out["tflops_per_gpu"] * flops["hardware"] / flops["model"]
    return out
