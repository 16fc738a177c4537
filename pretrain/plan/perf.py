"""Modelled step time of one layout: where the seconds of an optimizer step go.

One pipeline stage's micro-batch (forward + backward of its layers) is timed from first
principles, then the schedule, data-parallel reduction and optimizer are added:

* GEMMs: each layer GEMM (and the output layer) as its forward, data-gradient and weight-gradient
  product at its per-rank shape (tokens x in x out / TP), at the device's measured matmul ceiling
  (MAMF) times the wave-quantization efficiency of its output tiles over the SMs, plus the epilogue's
  store of the output at HBM speed (bf16 activations; the weight gradient accumulates into fp32
  main_grad, read + write) - NVIDIA's Matrix Multiplication Background guide, sec. 3;
* attention: causal flash attention, forward 2 and backward 5 matmuls of b s (s/CP) (heads x head
  dim) / TP (half the full-square count for the mask; a sliding-window layer's s(w+1) - w(w+1)/2
  pairs instead of s^2/2, as the kernel skips blocks outside the band) at ATTENTION_FRACTION of peak; with
  model.attention_backend=unfused the s x s scores are materialised: the full-square matmuls plus
  the scores' HBM traffic (softmax, dropout and their backward) per head;
* element-wise work (norms, bias-dropout-add, activation, RoPE; FP8 casts with transposes): memory
  bound, bytes / HBM, plus KERNEL_GAP_S per kernel of the layer;
* recompute: full repeats the forward (GEMMs, attention, element-wise, + the forward TP
  collectives), selective repeats core attention's forward;
* TP: 2 all-reduces (or all-gather + reduce-scatter with SP, same bytes) forward and 2
  backward per layer of tokens x hidden, ring cost 2(t-1)/t bytes / link; with tp_overlap
  (Transformer Engine userbuffers, --tp-comm-overlap) each collective is chunked behind the GEMM it
  feeds or follows: only its first chunk (1/t) and what exceeds that GEMM stay exposed;
* CP: ring exchange of K and V, (c-1) steps forward and 2(c-1) backward, overlapped with the
  attention blocks (Transformer Engine's ring attention): only the excess counts;
* PP: one send forward and one backward per micro-batch and model chunk; the 1F1B /
  interleaved bubble is (p-1)/v micro-batch times, i.e. a fraction (p-1)/(m v) of the work;
* MoE (EP): each layer's routed experts as top-k of them per token (active, not total, weights; layer_gemms):
  a rank's L = experts / EP local experts each take 1/L of its routed rows; moe.grouped_gemm runs them as one
  grouped kernel per product (waves over all L experts' tiles), off it is megatron-core's SequentialMLP: one GEMM
  per local expert (each wave-quantised alone, each launch KERNEL_GAP_S) after a host sync
  (tokens_per_expert.tolist(), HOST_SYNC_S) per layer forward; L = 1 runs the one expert directly, no sync;
  plus the token exchange (dispatch + combine, forward + backward; again forward under full recompute), NOT
  overlapped with compute (moe.exchange_seconds); expert gradients are timed as reduced over DP like the rest;
* DP: gradient reduce-scatter + parameter all-gather (distributed optimizer / ZeRO-1/2) or
  all-reduce, overlapped with the last micro-batch's backward (grads) and the first's forward
  (params) when the engine does so (megatron overlap_grad_reduce / overlap_param_gather;
  DeepSpeed overlap_comm in the templates); ZeRO-3 gathers weights every micro-batch;
* optimizer: memory bound, ~34 bytes touched per locally held parameter (Adam, mixed precision);
* PEFT: the frozen base's GEMMs skip their weight gradient (the output layer's too); the added GEMMs
  (LoRA A and B, adapters) run forward, dgrad and wgrad; DP collectives and the optimizer see the added
  parameters only. Distillation: each micro-batch adds the teacher's forward (teacher_seconds).

Kernel rates on H100 are scaled by hardware.SUSTAINED_FRACTION, the one calibrated constant (its subset and
procedure: docs/planner.md). Links: TP, CP and DP groups within a node use NVLink, groups that span nodes the per-GPU
InfiniBand rate times the group's members per node (NCCL runs one ring channel per NIC); Megatron
rank order: TP fastest, then CP, DP, PP. Rates: hardware.py.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from ..config.attention import causal_pairs, materialises_scores, window_pattern
from ..config.derive import pipeline_stage_layers
from ..config.hardware import (
    ATTENTION_FRACTION,
    ATTENTION_MATMULS,
    COLLECTIVE_LATENCY_S,
    FP8_GEMM_SPEEDUP,
    GEMM_TILE,
    HOST_SYNC_S,
    KERNEL_GAP_S,
    KERNELS_PER_LAYER,
    LINK_EFFICIENCY,
    SUSTAINED_FRACTION,
    device,
    peak_tflops,
)
from ..config.schema import JobConfig
from ..model.inventory import count_params, layer_tensors
from .moe import exchange_seconds
from .peft import layer_added_tensors, teacher_at, training_flops

DDP_BUCKET_PARAMS = 40e6   # megatron-core DDP bucket size (parameters); one collective per bucket
ADAM_BYTES_TOUCHED = 34     # read fp32 master, grad, m, v (16) + write master, m, v (12) + bf16 param (2) + norm (4)
MAIN_GRAD_BYTES = 8         # weight-gradient GEMM accumulates into the fp32 main_grad: read 4 + write 4 per element


@dataclass(frozen=True)
class Rates:
    gemm: float       # FLOP/s
    attention: float  # FLOP/s
    hbm: float        # B/s
    nvlink: float     # B/s per GPU per direction, after LINK_EFFICIENCY
    ib: float
    peak: float       # dense FLOP/s of the recipe's dtype (for MFU)
    per_node: int
    sms: int = 132
    fp8: bool = False
    tp_overlap: bool = False   # TP collectives chunked behind the GEMMs (TE userbuffers, --tp-comm-overlap)
    p2p_overlap: bool = False  # interleaved-PP sends / receives behind compute (megatron-core overlap_p2p_comm)


def rates(cfg: JobConfig, fp8: bool = False, tp_overlap: bool = False, p2p_overlap: bool = False) -> Rates:
    dev = device(cfg.cluster.gpu_type)
    half = cfg.precision.half
    peak = peak_tflops(cfg.cluster.gpu_type, half) * 1e12
    bf16 = peak_tflops(cfg.cluster.gpu_type, True) * 1e12
    sustained = SUSTAINED_FRACTION[cfg.cluster.gpu_type]
    gemm = dev["mamf_tflops"] * 1e12 * (peak / bf16) * (FP8_GEMM_SPEEDUP if fp8 else 1.0) * sustained
    attention = ATTENTION_FRACTION[cfg.cluster.gpu_type] * peak * sustained
    return Rates(gemm=gemm, attention=attention, hbm=dev["hbm_tbps"] * 1e12,
                 nvlink=dev["nvlink_gbps"] * 1e9 * LINK_EFFICIENCY, ib=dev["ib_gbps"] * 1e9 * LINK_EFFICIENCY,
                 peak=peak, per_node=cfg.cluster.devices_per_node, sms=dev["sms"], fp8=fp8, tp_overlap=tp_overlap,
                 p2p_overlap=p2p_overlap)


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
    heads: int = 1
    unfused: bool = False            # attention_backend=unfused: s x s scores materialised
    attn_dropout: bool = False
    gemms: tuple = ()                # (out, in, split) of each layer GEMM weight, inventory order
    frozen: bool = False             # PEFT: the base GEMMs compute no weight gradient
    added: tuple = ()                # (out, in, split) of each GEMM PEFT adds to a layer
    pairs: float = 0.0               # causal (query, key) pairs per layer, mean over layers (windows: fewer)
    experts: tuple = ()              # MoE: (out, in, split) of one routed expert's GEMMs, run by top-k per token
    topk: int = 0
    model_matmul: int = 0            # MoE: the ACTIVE GEMM weights a token goes through (inventory's `matmul`)
    num_experts: int = 0             # MoE: routed experts per layer (a rank holds num_experts / EP of them)
    grouped_gemm: bool = False       # MoE: a rank's local experts as one grouped GEMM (moe.grouped_gemm)


def shape(cfg: JobConfig) -> Shape:
    """An MoE model's layers are all timed as its MoE layer (router, shared experts, top-k routed experts per
    token: the active weights), whose stages bound the step in the MoE recipes (dense layers come first)."""
    m, d, moe = cfg.model, cfg.derived, cfg.moe
    tensors = [t for t in layer_tensors(cfg, moe=moe.enabled) if t.matmul]
    experts = [t for t in tensors if t.expert and ".local_experts.0." in t.name]
    tensors = [t for t in tensors if not t.expert]
    topk = moe.router_topk if moe.enabled else 0
    ffn = d.ffn_hidden_size if not moe.enabled else \
        topk * (moe.ffn_hidden_size or d.ffn_hidden_size) + (moe.shared_expert_ffn_hidden_size or 0)
    return Shape(matmul=sum(t.numel for t in tensors) + topk * sum(t.numel for t in experts), hidden=m.hidden_size,
                 q=m.num_attention_heads * d.kv_channels, kv=d.num_query_groups * d.kv_channels,
                 ffn=ffn, gate=2 if m.activation == "swiglu" else 1,
                 rope=m.position_embedding_type == "rope", seq=m.seq_length, heads=m.num_attention_heads,
                 unfused=materialises_scores(cfg), attn_dropout=m.attention_dropout > 0,
                 gemms=tuple((t.shape[0], t.shape[1], t.split) for t in tensors), frozen=cfg.peft.enabled,
                 added=tuple((t.shape[0], t.shape[1], t.split) for t in layer_added_tensors(cfg) if t.matmul),
                 pairs=sum(causal_pairs(m.seq_length, m.window_size if w else None)
                           for w in window_pattern(m) or [False] * m.num_layers) / m.num_layers,
                 experts=tuple((t.shape[0], t.shape[1], t.split) for t in experts), topk=topk,
                 model_matmul=count_params(cfg)["matmul"] if moe.enabled else 0,
                 num_experts=moe.num_experts or 0, grouped_gemm=moe.grouped_gemm)


def gemm_seconds(m: float, n: float, k: float, rate: Rates, out_bytes: float, groups: int = 1) -> float:
    """One GEMM (m x k) @ (k x n): 2mnk FLOPs at the matmul ceiling over the waves its output tiles take
    (a last partial wave idles the other SMs), plus the epilogue's store of the m x n output at HBM speed.
    `groups`: one grouped kernel running that many such GEMMs, their tiles sharing the waves."""
    tiles = groups * math.ceil(m / GEMM_TILE[0]) * math.ceil(n / GEMM_TILE[1])
    waves = math.ceil(tiles / rate.sms)
    return groups * (2 * m * n * k / rate.gemm * waves * rate.sms / tiles + m * n * out_bytes / rate.hbm)


def expert_gemm_seconds(m: float, n: float, k: float, rate: Rates, out_bytes: float, local: int,
                        grouped: bool) -> float:
    """`local` experts' GEMMs of one product, each (m x k) @ (k x n): one grouped kernel, or (SequentialMLP) one
    GEMM per expert, each quantised over the SMs on its own and each launch after the first idling KERNEL_GAP_S."""
    if grouped or local == 1:
        return gemm_seconds(m, n, k, rate, out_bytes, local)
    return local * gemm_seconds(m, n, k, rate, out_bytes) + (local - 1) * KERNEL_GAP_S


def layer_gemms(sh: Shape, tokens: float, tp: int, rate: Rates, e: int, etp: int | None = None,
                ep: int = 1) -> tuple[float, float, float, float]:
    """(forward, backward) seconds of one layer's GEMMs on one rank, and the elements the forward and
    backward GEMMs take as inputs (what FP8 casts). Column-parallel ("row" split: output features)
    and row-parallel ("col": input features) weights are cut by TP. MoE routed experts (balanced routing): the
    EP group's tokens x top-k copies spread evenly over its ranks, so a rank runs tokens x top-k x ETP / TP rows
    (SP tokens gathered over expert TP) through one expert's GEMMs cut by the expert TP degree `etp`, 1/L of them
    through each of its L = experts / `ep` local experts (expert_gemm_seconds: grouped or one GEMM each, each with
    its own weight gradient); SequentialMLP with L > 1 adds its host sync to the forward."""
    etp = etp or tp
    fwd = bwd = cast_f = cast_b = 0.0
    local = max(1, sh.num_experts // ep)
    routed = tokens * sh.topk * etp / tp
    for frozen, gemms, rows, ways, n_exp in ((sh.frozen, sh.gemms, tokens, tp, 0), (False, sh.added, tokens, tp, 0),
                                             (sh.frozen, sh.experts, routed / local, etp, local)):
        for out, inp, split in gemms:
            n, k = (out / ways, inp) if split == "row" else (out, inp / ways) if split == "col" else (out, inp)
            if n_exp:
                fwd += expert_gemm_seconds(rows, n, k, rate, e, n_exp, sh.grouped_gemm)
                bwd += expert_gemm_seconds(rows, k, n, rate, e, n_exp, sh.grouped_gemm)
                bwd += 0.0 if frozen else expert_gemm_seconds(k, n, rows, rate, MAIN_GRAD_BYTES, n_exp,
                                                              sh.grouped_gemm)
            else:
                fwd += gemm_seconds(rows, n, k, rate, e)
                bwd += gemm_seconds(rows, k, n, rate, e)
                bwd += 0.0 if frozen else gemm_seconds(k, n, rows, rate, MAIN_GRAD_BYTES)
            cast_f, cast_b = cast_f + rows * k * max(1, n_exp), cast_b + rows * n * max(1, n_exp)
    if sh.experts and local > 1 and not sh.grouped_gemm:
        fwd += HOST_SYNC_S       # tokens_per_expert.tolist(): the queue drains before the per-expert split
    return fwd, bwd, cast_f, cast_b


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


def _attention(sh: Shape, b: int, s: int, cp: int, tp: int, rate: Rates, e: int) -> tuple[float, float]:
    """(forward, backward) seconds of core attention for one micro-batch on one rank."""
    if not sh.unfused:   # flash: one causal matmul pass is 2 b (pairs / cp) q / tp FLOPs; pairs s^2/2 unwindowed
        unit = 2 * b * (sh.pairs or s * s / 2) / cp * sh.q / tp / rate.attention
        return ATTENTION_MATMULS[0] * unit, ATTENTION_MATMULS[1] * unit
    # materialised scores (full square, masked after): batched matmuls with K = head dim are bound by
    # writing / reading the scores; softmax (+ dropout with its 1-byte mask) read and write them
    scores = b * sh.heads / tp * s * (s / cp)
    flop = 2 * b * s * (s / cp) * sh.q / tp / rate.gemm
    drop = (2 * e + 1) * scores if sh.attn_dropout else 0.0
    fwd = max(2 * flop, 2 * e * scores / rate.hbm) + (2 * e * scores + drop) / rate.hbm
    bwd = max(4 * flop, 4 * e * scores / rate.hbm) + (3 * e * scores + drop) / rate.hbm
    return fwd, bwd


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
    full, again = rc == "full", rc in ("full", "selective")      # forward GEMMs / core attention repeated

    g_fwd, g_bwd, cast_f, cast_b = layer_gemms(sh, tokens, tp, rate, e, p.expert_tensor_parallel_size,
                                               p.expert_model_parallel_size)
    attn_f, attn_b = _attention(sh, b, s, cp, tp, rate, e)
    elem_f, elem_b = _elementwise(sh, tokens, tp, p.sequence_parallel, rate, e, cast_f, cast_b)
    per_node = rate.per_node
    sp = p.sequence_parallel
    one, calls_f, calls_b = _tp_collective(sh, tokens, tp, sp, rate, e)
    if rate.tp_overlap and sp and tp > 1:   # chunked behind the GEMMs: first chunk + what the GEMMs cannot hide
        tp_comm = _hidden(calls_f * one, g_fwd, tp) * (2 if full else 1) + _hidden(calls_b * one, g_bwd, tp)
    else:
        tp_comm = (calls_f * (2 if full else 1) + calls_b) * one
    cp_bw = group_bandwidth(rate, cp, tp)
    kv_bytes = b * (s / cp) * 2 * sh.kv / tp * e
    cp_comm = ((4 if full else 3) * (cp - 1) * (kv_bytes / cp_bw + COLLECTIVE_LATENCY_S)) if cp > 1 else 0.0
    attn = attn_f * (2 if again else 1) + attn_b
    cp_exposed = max(0.0, cp_comm - attn)
    layer = {"gemm": g_fwd * (2 if full else 1) + g_bwd, "attention": attn,
             "elementwise": elem_f * (2 if full else 1) + elem_b, "tp_comm": tp_comm, "cp_comm": cp_exposed,
             "ep_comm": exchange_seconds(cfg, rate) * ((6 if full else 4) / 4) if sh.topk else 0.0}
    recompute_layer = (g_fwd + elem_f if full else 0.0) + (attn_f if again else 0.0)

    layers = pipeline_stage_layers(cfg.model.num_layers, pp, p.num_layers_in_first_pipeline_stage,
                                   p.num_layers_in_last_pipeline_stage)
    vocab = d.padded_vocab_size
    n_vocab = vocab / tp
    head = (gemm_seconds(tokens, n_vocab, sh.hidden, rate, e) + gemm_seconds(tokens, sh.hidden, n_vocab, rate, e)
            + (0.0 if sh.frozen else gemm_seconds(sh.hidden, n_vocab, tokens, rate, MAIN_GRAD_BYTES))  # fwd, d/wgrad
            + 4 * 4 * tokens * vocab / tp / rate.hbm)                 # fp32 logits: write, max, exp-sum, grad
    teacher = teacher_at(cfg)
    teach = teacher_seconds(teacher, rate) if teacher is not None else 0.0   # PP=1: on the only stage
    stage_times = [n * sum(layer.values()) + (head if i == pp - 1 else 0.0) + teach for i, n in enumerate(layers)]
    worst = max(range(pp), key=lambda i: stage_times[i])
    t_mb = stage_times[worst]
    n_layers = layers[worst]

    pp_bw = rate.nvlink if tp * cp * dp < per_node else rate.ib
    p2p_bytes = tokens * sh.hidden * e / (tp if p.sequence_parallel else 1)
    p2p = 2 * v * (p2p_bytes / pp_bw + COLLECTIVE_LATENCY_S) if pp > 1 else 0.0
    if rate.p2p_overlap and v > 1:   # each chunk's transfers run behind the next chunk's compute: only the excess
        p2p = 2 * v * COLLECTIVE_LATENCY_S + max(0.0, p2p - 2 * v * COLLECTIVE_LATENCY_S - t_mb)
    slot = t_mb + p2p
    bubble = (pp - 1) / v * slot

    n_local = stage_params[worst][2]      # trained parameters: all of them, or PEFT's added ones
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
    out["teacher"] = m * teach
    out["pp_p2p"] = m * p2p
    out["bubble"] = bubble
    out["dp_comm"] = dp_exposed
    out["optimizer"] = optimizer
    step = sum(out.values())
    out["recompute"] = m * n_layers * recompute_layer      # included above (part of gemm/attention/elementwise)
    matmul = sh.model_matmul or sh.matmul * cfg.model.num_layers + vocab * sh.hidden    # MoE: active weights
    flops = training_flops(cfg, {"matmul": matmul}, teacher)
    out["step"] = step
    out["mfu"] = flops["model"] * d.tokens_per_step / (step * d.world_size * rate.peak)
    out["tflops_per_gpu"] = out["mfu"] * rate.peak / 1e12
    out["hw_tflops_per_gpu"] = out["tflops_per_gpu"] * flops["hardware"] / flops["model"]
    return out


def _elementwise(sh: Shape, tokens: float, tp: int, sp: bool, rate: Rates, e: int, cast_f: float,
                 cast_b: float) -> tuple[float, float]:
    """(forward, backward) seconds of one layer's memory-bound kernels on one rank."""
    replicated = 10 * sh.hidden / (tp if sp else 1)
    act = (sh.gate + 1) * sh.ffn / tp
    rope = 2 * (sh.q + sh.kv) / tp if sh.rope else 0
    elem_f = tokens * (replicated + act + rope) * e / rate.hbm + KERNELS_PER_LAYER / 3 * KERNEL_GAP_S
    elem_b = 2 * tokens * (replicated + act + rope) * e / rate.hbm + KERNELS_PER_LAYER * 2 / 3 * KERNEL_GAP_S
    if rate.fp8:    # Transformer Engine casts each GEMM input to FP8 and writes a transposed copy for wgrad
        elem_f, elem_b = elem_f + cast_f * (e + 2) / rate.hbm, elem_b + cast_b * (e + 2) / rate.hbm
    return elem_f, elem_b


def _tp_collective(sh: Shape, tokens: float, tp: int, sp: bool, rate: Rates, e: int) -> tuple[float, int, int]:
    """Seconds of one TP collective of a layer (an all-reduce, or one all-gather / reduce-scatter under SP), and
    how many a layer's forward and backward run."""
    one = _ring(tokens * sh.hidden * e, tp, group_bandwidth(rate, tp, 1), 2.0 / (2 if sp else 1))
    return one, 2 * (2 if sp else 1), 2 * (2 if sp else 1)


def _hidden(comm: float, gemm: float, tp: int) -> float:
    """A TP collective chunked behind a GEMM: its first chunk and what the GEMM cannot hide stay exposed."""
    return comm / tp + max(0.0, comm * (tp - 1) / tp - gemm)


def teacher_seconds(teacher: JobConfig, rate: Rates) -> float:
    """One micro-batch of a distillation teacher's forward on one rank (`teacher`: peft.teacher_at's): its
    layers' forward GEMMs, core attention, element-wise kernels and forward TP collectives, its output layer,
    and four passes over its fp32 logits (write, max, exp-sum, the KL's read). No backward, no recompute."""
    sh, p = shape(teacher), teacher.parallel
    tp, cp, sp = p.tensor_model_parallel_size, p.context_parallel_size, p.sequence_parallel
    b, e = teacher.batch.micro_batch_size, 2 if teacher.precision.half else 4
    tokens = b * sh.seq / cp
    g_fwd, _, cast_f, _ = layer_gemms(sh, tokens, tp, rate, e, p.expert_tensor_parallel_size,
                                      p.expert_model_parallel_size)
    attn_f, _ = _attention(sh, b, sh.seq, cp, tp, rate, e)
    elem_f, _ = _elementwise(sh, tokens, tp, sp, rate, e, cast_f, 0.0)
    one, calls_f, _ = _tp_collective(sh, tokens, tp, sp, rate, e)
    comm = _hidden(calls_f * one, g_fwd, tp) if rate.tp_overlap and sp and tp > 1 else calls_f * one
    vocab = teacher.derived.padded_vocab_size / tp
    head = gemm_seconds(tokens, vocab, sh.hidden, rate, e) + 4 * 4 * tokens * vocab / rate.hbm
    return teacher.model.num_layers * (g_fwd + attn_f + elem_f + comm) + head
